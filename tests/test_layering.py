"""The rooms keep their walls: no import cycles, and each room imports only the rooms below it (torch
stays out of the serving economics and the reports; the torch library knows nothing of MLflow)."""

from __future__ import annotations

from tests.helpers.import_graph import cycles, graph, imported_names, modules, room_edges

# which rooms each room may import (docs/design.md, Layout)
ALLOWED = {
    "common": set(),
    "serving": {"common"},
    "reports": {"common", "serving"},
    "drafter": {"common", "serving"},
    "engines": {"common", "serving", "drafter"},
    "registry": {"common", "serving", "drafter"},
    "tuning": {"common", "serving", "reports", "drafter", "registry"},
    "evaluation": {"common", "serving", "reports", "drafter", "engines", "registry"},
    "pipeline": {"common", "serving", "reports", "drafter", "engines", "registry", "evaluation"},
    "cli": {"common", "registry", "tuning"},
    "steps": {
        "common",
        "serving",
        "reports",
        "drafter",
        "engines",
        "registry",
        "tuning",
        "evaluation",
        "pipeline",
        "cli",
    },
    "miniworld": {"common", "drafter"},
}


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_each_room_imports_only_the_rooms_below_it():
    wrong = {room: sorted(got - ALLOWED[room]) for room, got in room_edges(graph()).items() if got - ALLOWED[room]}
    assert wrong == {}


def test_no_torch_in_serving_reports_or_common_and_no_mlflow_in_drafter():
    found = []
    for name, path in modules().items():
        heavy = {n.split(".")[0] for n in imported_names(path)}
        if name.split(".")[0] in ("common", "serving", "reports") and "torch" in heavy:
            found.append(f"{name} imports torch")
        if name.split(".")[0] == "drafter" and "mlflow" in heavy:
            found.append(f"{name} imports mlflow")
    assert found == []


def test_the_graph_sees_imports_inside_functions():
    """The check would pass vacuously if it missed the lazy imports most steps use."""
    assert "registry.access.store" in graph()["registry.access.resolve"]
