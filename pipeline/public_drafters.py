"""The mini world's public drafters, imported and evaluated beside the main job's own drafters: every K2.5-era
family and every other draft method (miniworld/families.py, miniworld/methods.py). Each goes to the model compare
would import it into, so the bake-off finds it by content and reuses its evaluation instead of running it again."""

from __future__ import annotations

from typing import Any

from common.paths import MINIWORLD
from pipeline.bakeoff import import_name
from pipeline.nested import Pipeline

PUBLIC_DRAFTERS = ("ls-mini-eagle3-mla", "nv-mini-eagle3", "rh-mini-eagle3", "zl-mini-dflash", "pe-mini-peagle")


def folders() -> list[str]:
    """The public drafters the mini world holds (a partial build may lack some)."""
    return [str(MINIWORLD / name) for name in PUBLIC_DRAFTERS if (MINIWORLD / name).is_dir()]


def method_drafters() -> str:
    """The public drafter of each method besides EAGLE-3 (comma-separated): calibrate times each method's own
    cycles with it, so every method's break-even is its own."""
    from drafter.methods import DEFAULT, folder_method_or_default  # torch-free, but read only when calibrating

    return ",".join(f for f in folders() if folder_method_or_default(f) is not DEFAULT)


def evaluations(p: Pipeline, c: Any, target: str, profile: str) -> list[tuple[str, dict[str, str], tuple[int, ...]]]:
    """Each public drafter imported (two at a time), and the `evaluate` call compare would make of it (the
    profile's own settings: evidence it reuses)."""
    found = folders()
    p.steps([("import_drafter", {"source": f, "target": target, "name": import_name(f)}, (0,)) for f in found])
    versions = [c.get_model_version_by_alias(import_name(f), "imported").version for f in found]
    return [("evaluate", {"model": f"models:/{import_name(f)}/{v}", "target": target, "profile": profile}, (0,))
            for f, v in zip(found, versions, strict=True)]  # fmt: skip
