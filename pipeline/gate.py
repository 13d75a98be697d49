"""The shape gate as a service: from headers and configs alone, whether a drafter fits a target, and the run (and,
for a registered version, the tags, page section and audit line) that records it. The shape_gate step calls it
with its own parameters, compare with each candidate's."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.runs import OpenRun
from drafter.analysis.compat import check_compat, compare_drafters, drafter_facts, target_facts, verdict
from drafter.methods import folder_method
from registry.access.naming import run_label
from reports.gate import comparison_table, section, table


def engine_table(aux_ids: list[int], num_layers: int | None) -> tuple[str, list[dict]]:
    """Which target layers each engine would feed this drafter, handed the ids each engine is given
    (drafter/formats/aux_layers.py: vLLM reads an id as a layer's input, so it is handed id + 1)."""
    from drafter.formats.aux_layers import mapping

    rows = [mapping(list(aux_ids), engine) for engine in ("sglang", "vllm")]
    lines = [
        "| engine | ids handed | engine reads id i as | target layer outputs fed | as trained |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        in_range = num_layers is None or all(0 <= i < num_layers for i in r["target_layer_outputs_fed"])
        ok = "yes" if r["matches_training"] and in_range else "NO"
        fed = r["target_layer_outputs_fed"]
        lines.append(f"| {r['engine']} | {r['handed_ids']} | {r['engine_reads_id_as']} | {fed} | {ok} |")
    return "\n".join(lines), rows


def facts_for(ref: str):
    """(DrafterFacts, ModelVersion or None) for any way of naming a drafter."""
    if ref.startswith("models:/"):
        from registry.access import store

        mv, folder = store.version_folder(ref)
        facts = drafter_facts(folder)
        facts.source = f"models:/{mv.name}/{mv.version}"
        return facts, mv
    return drafter_facts(ref), None


@dataclass
class Gate:
    """The gate's checks from headers and configs, its verdict, and the tables that show them."""

    model: str  # as named
    target: str
    reference: str | None  # a second drafter shown side by side
    mv: Any
    label: str
    checks: list
    result: str  # passed, failed or unproven
    md: str
    engine_rows: list
    comparison: str | None  # the side-by-side table against the reference, if given
    lines: list[str]

    @property
    def ok(self) -> bool:
        return self.result != "failed"


def measure(model: str, target: str, reference: str | None = None) -> Gate:
    """Every check of the drafter against the target (headers and configs only), and the engines' aux ids."""
    other = other_method(model)
    if other is not None:
        return measure_method(*other, model, target)
    facts, mv = facts_for(model)
    if mv is not None:
        from registry.access import store
        from registry.ledger import reconcile

        reconcile.warn_if_disagreeing(store.client(), mv.name, "shape_gate")
    tfacts = target_facts(target)
    checks = check_compat(facts, tfacts)
    result = verdict(checks)
    md = table(checks)
    engines_md, engine_rows = engine_table(list(facts.config.aux_layer_ids), tfacts.config.num_hidden_layers)
    md += "\n\nAux layers as each serving engine is handed them:\n\n" + engines_md
    lines = [f"shape_gate: {facts.source} vs target {tfacts.source}", "", md]
    cmp_md = None
    if reference:
        ref_facts, _ = facts_for(reference)
        cmp_md = comparison_table(compare_drafters(ref_facts.header, facts.header), reference, model)
        lines += ["", f"side by side: {reference} vs {model}", "", cmp_md]
    failed = [c.name for c in checks if c.ok is False]
    unproven = [c.name for c in checks if c.ok is None and not c.informational]
    detail = failed or unproven
    lines += ["", f"shape_gate: {result.upper()}" + (f" ({', '.join(detail)})" if detail else "")]
    if unproven and result != "failed":
        lines.append("shape_gate: some checks could not be made; production needs a gate against the target's weights")
    label = facts.source.split("/")[-1] if mv is None else run_label(mv, str(target))
    return Gate(model, target, reference, mv, label, checks, result, md, engine_rows, cmp_md, lines)


def other_method(model: str) -> tuple[Any, dict[str, Any], Path, Any] | None:
    """(method, raw config, folder, version or None) for a drafter of another draft method (drafter/methods), named
    by folder or registry URI; None for an EAGLE-3 drafter."""
    if model.startswith("models:/"):
        from registry.access import store

        mv, folder = store.version_folder(model)
        found = folder_method(folder)
        return None if found is None else (*found, Path(folder), mv)
    found = folder_method(model) if Path(model).is_dir() else None
    return None if found is None else (*found, Path(model), None)


def measure_method(method: Any, raw: dict[str, Any], folder: Path, mv: Any, model: str, target: str) -> Gate:
    """A drafter of another method (drafter/methods): its config read and its rules checked against the target,
    from the config and the weights' header (when the folder has weights)."""
    method.read_config(raw, str(folder / "config.json"))  # a malformed config is bad input before the target
    tfacts = target_facts(target)
    checks = method.fit_checks(folder, target)
    result, md = verdict(checks), table(checks)
    failed = [c.name for c in checks if c.ok is False]
    lines = [f"shape_gate: {model} ({method.NAME}) vs target {tfacts.source}", "", md, "",
             f"shape_gate: {result.upper()}" + (f" ({', '.join(failed)})" if failed else "")]  # fmt: skip
    if result == "passed-config-only":
        lines.append("shape_gate: no weights beside the config: the tensors were not checked")
    label = folder.name if mv is None else run_label(mv, str(target))
    return Gate(model, target, None, mv, label, checks, result, md, [], None, lines)


def publish(gate: Gate, open_run: OpenRun, asked: Mapping[str, object], context: str = "") -> None:
    """The run (the checks as a table, the text, the engines' aux ids) and, for a version, its gate tags, page
    section and audit line. `context` tells a gate run inside another step's apart (" (bake-off)")."""
    import mlflow
    import pandas as pd

    mv, result, md, target = gate.mv, gate.result, gate.md, str(gate.target)
    params = {"model": gate.model, "target": gate.target, "reference": gate.reference or ""}
    with open_run("shape_gate", f"shape_gate {gate.label} vs {Path(target).name}{context}", params, asked):
        mlflow.log_table(
            pd.DataFrame([c.__dict__ | {"verdict": c.verdict} for c in gate.checks]).drop(columns=["ok"]),
            artifact_file="shape_gate.json",
        )
        mlflow.log_text(md + ("\n\n" + gate.comparison if gate.comparison else "") + "\n", "shape_gate.md")
        mlflow.log_dict({"engines": gate.engine_rows}, "aux_layers_by_engine.json")
        mlflow.set_tags({"shape_gate": result, "shape_gate.target": gate.target})
        if mv is None:
            return
        from registry.access import describe, naming, store
        from registry.ledger import audit

        c = store.client()
        c.set_model_version_tag(mv.name, mv.version, naming.TAG_GATE, result)
        c.set_model_version_tag(mv.name, mv.version, naming.TAG_GATE_TARGET, target)
        describe.set_section(c, mv.name, mv.version, f"shape_gate:{target}", section(target, result, md))
        audit.record(c, mv.name, mv.version, f"shape_gate:{result}", md, target=target)
