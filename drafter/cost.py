"""Throughput model: when does speculation pay, and what acceptance does a target speed need?

cycle_ms = verify_ms + draft_steps * draft_step_ms; projected_tps = accept_len * 1000 / cycle_ms;
break-even accept_len = baseline_tps * cycle_ms / 1000. With constant conditional acceptance p and
k draft steps, E[accept_len] = (1 - p^(k+1)) / (1 - p); unbounded depth gives 1 / (1 - p).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, fields, replace
from pathlib import Path

import yaml

from drafter.errors import BadInput

PROFILE_DIR = Path(__file__).resolve().parent.parent / "configs" / "profiles"


DEFAULT_MIN_PROMPTS = 20


@dataclass(frozen=True)
class Profile:
    """A deployment: the target's plain decode speed and what one speculative cycle costs.

    verify_ms is everything a cycle costs besides the draft steps (the verify forward, acceptance,
    cache bookkeeping, the drafter's extend): measured as a whole cycle, as the seed's 30 ms was.
    min_prompts: the fewest held-out prompts an evaluation needs to count as promotion evidence."""

    name: str
    baseline_tps: float
    verify_ms: float
    draft_step_ms: float
    draft_steps: int
    min_prompts: int = DEFAULT_MIN_PROMPTS
    description: str = ""

    @property
    def cycle_ms(self) -> float:
        return self.verify_ms + self.draft_steps * self.draft_step_ms

    def with_draft_steps(self, k: int) -> Profile:
        return replace(self, draft_steps=k)

    def values(self) -> dict[str, float | int | str]:
        """What decisions depend on (the description does not)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "description"}

    @property
    def digest(self) -> str:
        """Identity of the values, not the name: a file that reuses a profile's name with other figures
        has another digest, so evidence measured under it cannot pass for the real profile's."""
        return hashlib.sha256(json.dumps(self.values(), sort_keys=True).encode()).hexdigest()


def load_profile(name_or_path: str, profile_dir: Path = PROFILE_DIR) -> Profile:
    """A profile by name (configs/profiles/<name>.yaml) or by path; every field is checked."""
    path = Path(name_or_path)
    if not (path.suffix in {".yaml", ".yml"} and path.is_file()):
        path = profile_dir / f"{name_or_path}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in profile_dir.glob("*.yaml"))
        raise BadInput(f"unknown profile {name_or_path!r} (known: {', '.join(known)})")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise BadInput(f"{path}: not valid YAML ({exc.__class__.__name__})") from None
    if not isinstance(raw, dict):
        raise BadInput(f"{path}: expected a mapping of profile fields")
    values: dict = {"name": str(raw.get("name", path.stem)), "description": str(raw.get("description", ""))}
    known = {f.name for f in fields(Profile)} | {"measured"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise BadInput(f"{path}: unknown profile field(s) {', '.join(unknown)}")
    for f in fields(Profile):
        if f.name in values:
            continue
        if f.name not in raw:
            if f.name == "min_prompts":
                continue
            raise BadInput(f"{path}: profile is missing field '{f.name}'")
        value = raw[f.name]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise BadInput(f"{path}: profile field '{f.name}' must be a number, got {value!r}")
        values[f.name] = int(value) if f.name in ("draft_steps", "min_prompts") else float(value)
    if values["baseline_tps"] <= 0 or values["verify_ms"] <= 0 or values["draft_step_ms"] < 0:
        raise BadInput(f"{path}: baseline_tps and verify_ms must be > 0, draft_step_ms >= 0")
    if values["draft_steps"] < 1:
        raise BadInput(f"{path}: draft_steps must be >= 1")
    if values.get("min_prompts", DEFAULT_MIN_PROMPTS) < 1:
        raise BadInput(f"{path}: min_prompts must be >= 1")
    return Profile(**values)


def break_even_accept_len(profile: Profile) -> float:
    return profile.baseline_tps * profile.cycle_ms / 1000.0


def projected_tps(accept_len: float, profile: Profile) -> float:
    return accept_len * 1000.0 / profile.cycle_ms


def expected_accept_len(p: float, k: int | None) -> float:
    """E[tokens per cycle] with constant conditional acceptance p; k=None for unbounded depth."""
    if not 0 <= p <= 1:
        raise ValueError(f"p must be in [0, 1], got {p}")
    if k is None:
        return float("inf") if p == 1 else 1.0 / (1.0 - p)
    return float(k + 1) if p == 1 else (1.0 - p ** (k + 1)) / (1.0 - p)


def required_acceptance(accept_len: float, k: int | None) -> float | None:
    """The p that gives this accept_len; None when k steps can never reach it (accept_len > k+1)."""
    if accept_len <= 1.0:
        return 0.0
    if k is None:
        return 1.0 - 1.0 / accept_len
    if accept_len > k + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if expected_accept_len(mid, k) < accept_len:
            lo = mid
        else:
            hi = mid
    return hi


def fit_conditional_acceptance(accept_len: float, k: int) -> float:
    """cond_acc: the constant p whose k-step expectation equals a measured accept_len."""
    return required_acceptance(min(max(accept_len, 1.0), k + 1.0), k) or 0.0


@dataclass(frozen=True)
class PlanRow:
    target_tps: float
    required_accept_len: float
    acc_unbounded: float
    acc_k_steps: float | None  # None: unreachable with k steps


def plan_table(profile: Profile, target_tps: list[float]) -> list[PlanRow]:
    """Required accept_len and conditional acceptance for each target speed (break-even first)."""
    rows = []
    for tps in target_tps:
        need = tps * profile.cycle_ms / 1000.0
        rows.append(PlanRow(tps, need, required_acceptance(need, None), required_acceptance(need, profile.draft_steps)))
    return rows
