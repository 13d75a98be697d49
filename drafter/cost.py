"""Throughput model: when does speculation pay, and what acceptance does a target speed need?

cycle_ms = verify_ms + draft_steps * draft_step_ms; projected_tps = accept_len * 1000 / cycle_ms;
break-even accept_len = baseline_tps * cycle_ms / 1000. With constant conditional acceptance p and
k draft steps, E[accept_len] = (1 - p^(k+1)) / (1 - p); unbounded depth gives 1 / (1 - p).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import yaml

from drafter.errors import BadInput
from drafter.workload import TrafficClass, parse_workload

PROFILE_DIR = Path(__file__).resolve().parent.parent / "configs" / "profiles"


DEFAULT_MIN_PROMPTS = 20
# numeric fields with their defaults (None: required); whole numbers are integers
NUMBERS: dict[str, float | int | None] = {
    "baseline_tps": None,
    "verify_ms": None,
    "draft_step_ms": None,
    "draft_steps": None,
    "min_prompts": DEFAULT_MIN_PROMPTS,
    "min_share": 0.05,
    "class_floor": 1.0,
    "eval_max_new_tokens": 64,
    "eval_temperature": 0.0,
}
WHOLE = ("draft_steps", "min_prompts", "eval_max_new_tokens")
BOUNDS = {"draft_steps": 64, "min_prompts": 100_000, "eval_max_new_tokens": 65_536}


@dataclass(frozen=True)
class Profile:
    """A deployment: the target's plain decode speed and what one speculative cycle costs.

    verify_ms is everything a cycle costs besides the draft steps (the verify forward, acceptance,
    cache bookkeeping, the drafter's extend): measured as a whole cycle, as the seed's 30 ms was.
    min_prompts: the fewest held-out prompts an evaluation needs to count as promotion evidence.
    workload: the prompts evidence must be measured on (traffic classes with shares; one class 'all'
    for a single pinned set; none: no evaluation can stand as evidence for this profile), decoded with
    eval_max_new_tokens at eval_temperature. Production needs every class with at least min_share of the
    traffic projected at class_floor times plain decoding or better."""

    name: str
    baseline_tps: float
    verify_ms: float
    draft_step_ms: float
    draft_steps: int
    min_prompts: int = DEFAULT_MIN_PROMPTS
    min_share: float = 0.05
    class_floor: float = 1.0
    eval_max_new_tokens: int = 64
    eval_temperature: float = 0.0
    workload: tuple[TrafficClass, ...] = field(default=())
    description: str = ""

    @property
    def cycle_ms(self) -> float:
        return self.verify_ms + self.draft_steps * self.draft_step_ms

    def with_draft_steps(self, k: int) -> Profile:
        return replace(self, draft_steps=k)

    def values(self) -> dict[str, object]:
        """What decisions depend on (the description does not; a class's file is its digest, not its path)."""
        out: dict[str, object] = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "description"}
        out["workload"] = [c.identity() for c in self.workload]
        return out

    def traffic_class(self, name: str) -> TrafficClass:
        for c in self.workload:
            if c.name == name:
                return c
        known = ", ".join(c.name for c in self.workload) or "none"
        raise BadInput(f"profile {self.name} has no traffic class {name!r} (classes: {known})")

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
    known = set(NUMBERS) | {"name", "description", "measured", "workload", "eval_prompts", "eval_prompts_sha256"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise BadInput(f"{path}: unknown profile field(s) {', '.join(unknown)}")
    for key, default in NUMBERS.items():
        if key not in raw:
            if default is None:
                raise BadInput(f"{path}: profile is missing field '{key}'")
            continue
        values[key] = _number(raw[key], key, path)
    if values["baseline_tps"] <= 0 or values["verify_ms"] <= 0 or values["draft_step_ms"] < 0:
        raise BadInput(f"{path}: baseline_tps and verify_ms must be > 0, draft_step_ms >= 0")
    for key in WHOLE:
        if values.get(key, 1) < 1:
            raise BadInput(f"{path}: {key} must be >= 1")
    if not 0 <= values.get("min_share", 0.05) <= 1:
        raise BadInput(f"{path}: min_share must be in [0, 1]")
    if values.get("class_floor", 1.0) <= 0 or values.get("eval_temperature", 0.0) < 0:
        raise BadInput(f"{path}: class_floor must be > 0 and eval_temperature >= 0")
    values["workload"] = parse_workload(raw, path)
    return Profile(**values)


def _number(value: object, key: str, path: Path) -> float | int:
    """A finite number; whole where the field counts something, and within a sane bound."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise BadInput(f"{path}: profile field '{key}' must be a finite number, got {value!r}")
    if key in WHOLE:
        if value != int(value):
            raise BadInput(f"{path}: profile field '{key}' must be a whole number, got {value!r}")
        if value > BOUNDS[key]:
            raise BadInput(f"{path}: profile field '{key}' is {value!r}, more than {BOUNDS[key]}")
        return int(value)
    return float(value)


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
