"""The deployment profile: the target's plain decode speed, what one speculative cycle costs, the
operating points calibrate measured, and the traffic it serves; loaded from configs/profiles/, every field
checked."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import yaml

from common.errors import BadInput
from common.paths import PROFILE_DIR
from serving.cycle_model import OperatingPoint, parse_operating_points, primary, timed_or_fitted
from serving.workload import TrafficClass, context_buckets, parse_workload

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
    "draft_step_params": 0,
}
WHOLE = ("draft_steps", "min_prompts", "eval_max_new_tokens", "draft_step_params")
BOUNDS = {"draft_steps": 64, "min_prompts": 100_000, "eval_max_new_tokens": 65_536, "draft_step_params": 10**13}


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
    # measured by `calibrate` (serving/cycle_model): the loads the deployment serves at, and provenance
    operating_points: tuple[OperatingPoint, ...] = field(default=())
    measured: dict = field(default_factory=dict, compare=False)
    concurrency: int | None = None  # set on a view of the profile at one operating point
    cycle_points: tuple[tuple[int, float], ...] = field(default=())  # timed cycles at this point, by depth
    # the deployment's target (a folder, resolved against the profile's own folder, or a hub id): evidence
    # counts only when measured on it (registry.ledger.deployment); not in the digest, it is checked by its own
    target: str = ""
    trusted_evaluators: dict = field(
        default_factory=dict, compare=False
    )  # name -> "ed25519:..." (registry.ledger.trust)
    signed: dict = field(default_factory=dict, compare=False)  # calibrate's signature over values and measured
    # context bucket (serving.workload.context_buckets) -> the projected speed-up its conversations must reach
    context_floors: tuple[tuple[str, float], ...] = field(default=())
    # parameters one draft step reads (drafter.analysis.step_cost) of the drafter draft_step_ms was timed with: a
    # drafter whose step reads more is priced up by the ratio (serving.cost.priced_for); 0: not recorded
    draft_step_params: int = 0
    # what the production watch does about a drop (registry/watch.Policy's fields): action, tolerance, ...
    watch: dict = field(default_factory=dict, compare=False)
    # the cycle shape and method of the drafter this view prices (drafter/methods): set by `shaped`, never in the
    # digest
    draft_shape: str = "chain"
    draft_method: str = ""

    @property
    def method_cycle_points(self) -> tuple[tuple[int, float], ...]:
        """The priced method's own timed cycles by width at this view's point (the primary point's on the profile
        itself); none where calibrate did not time that method there."""
        if not self.operating_points:
            return ()
        if self.concurrency is None:
            return primary(self.operating_points).method_points()
        return next((op.method_points() for op in self.operating_points if op.concurrency == self.concurrency), ())

    @property
    def cycle_ms(self) -> float:
        if self.method_cycle_points:  # the method's own cycles, timed by width
            return timed_or_fitted(self.method_cycle_points, self.draft_steps)
        if self.draft_shape == "block":  # one drafter pass drafts the whole block, at any width
            return self.verify_ms + self.draft_step_ms
        return dict(self.cycle_points).get(self.draft_steps, self.verify_ms + self.draft_steps * self.draft_step_ms)

    def shaped(self, shape: str, method: str = "") -> Profile:
        """This profile pricing a drafter of this cycle shape ("chain" or "block") and method (drafter/methods NAME),
        at every operating point: by the method's own cycles where calibrate timed them, else by its shape."""
        if shape not in ("chain", "block"):
            raise ValueError(f"unknown cycle shape {shape!r}")
        ops = tuple(replace(op, draft_shape=shape, draft_method=method) for op in self.operating_points)
        return replace(self, draft_shape=shape, draft_method=method, operating_points=ops)

    def method_timed(self) -> bool:
        """Whether this view's method was timed by calibrate (its break-even its own cycles'), not shape-priced."""
        return bool(self.method_cycle_points)

    def with_draft_steps(self, k: int) -> Profile:
        return replace(self, draft_steps=k)

    @property
    def calibrated(self) -> bool:
        """Break-even measured on the serving engine by `calibrate`, not typed by hand."""
        return bool(self.operating_points) and bool(self.measured.get("engine"))

    def at(self, op: OperatingPoint) -> Profile:
        """This profile as served at one operating point (its plain speed and cycle costs)."""
        return replace(self, baseline_tps=op.plain_tps, verify_ms=op.verify_ms, draft_step_ms=op.draft_step_ms,
                       cycle_points=op.cycle_ms_measured, concurrency=op.concurrency)  # fmt: skip

    def serving_points(self) -> list[Profile]:
        """One view per operating point that carries traffic (the profile itself when it names none)."""
        return [self.at(op) for op in self.operating_points if op.share > 0] or [self]

    def binding(self) -> Profile:
        """The operating point with the highest break-even: beating it beats every one that carries traffic."""
        # break-even is baseline_tps * cycle_ms / 1000 (serving.cost); the product orders the points alike
        return max(self.serving_points(), key=lambda point: point.baseline_tps * point.cycle_ms)

    def basis(self) -> str:
        """Where the break-even comes from, said in every decision."""
        if not self.calibrated:
            return f"break-even assumed, not measured (profile {self.name} was not calibrated on its serving engine)"
        m = self.measured
        points = ", ".join(op.label() for op in self.operating_points)
        return f"break-even measured by calibrate on {m.get('engine')} ({m.get('date', 'undated')}) at {points}"

    def values(self) -> dict[str, object]:
        """What decisions depend on (the description and provenance do not; a class's file is its digest,
        not its path). Fields a hand-written profile leaves empty are left out, so its digest is unchanged."""
        skip = {
            "description",
            "measured",
            "operating_points",
            "concurrency",
            "cycle_points",
            "target",
            "trusted_evaluators",
            "signed",
            "context_floors",
            "draft_step_params",
            "watch",
            "draft_shape",
            "draft_method",
        }
        out: dict[str, object] = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}
        out["workload"] = [c.identity() for c in self.workload]
        if self.operating_points:
            out["operating_points"] = [op.identity() for op in self.operating_points]
        if self.context_floors:  # left out when empty: a profile without them keeps its digest
            out["context_floors"] = dict(self.context_floors)
        if self.draft_step_params:  # likewise: recorded, it is a value decisions depend on
            out["draft_step_params"] = self.draft_step_params
        if self.watch:  # likewise: the watch's policy is a decision's terms
            out["watch"] = dict(self.watch)
        if self.concurrency is not None:
            out["concurrency"] = self.concurrency
            out["cycle_points"] = [list(p) for p in self.cycle_points]
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


def profile_path(name_or_path: str, profile_dir: Path = PROFILE_DIR) -> Path:
    """configs/profiles/<name>.yaml for a name, else the YAML file given."""
    path = Path(name_or_path)
    if not (path.suffix in {".yaml", ".yml"} and path.is_file()):
        path = profile_dir / f"{name_or_path}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in profile_dir.glob("*.yaml"))
        raise BadInput(f"unknown profile {name_or_path!r} (known: {', '.join(known)})")
    return path


def load_profile(name_or_path: str, profile_dir: Path = PROFILE_DIR) -> Profile:
    """A profile by name (configs/profiles/<name>.yaml) or by path; every field is checked."""
    path = profile_path(name_or_path, profile_dir)
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise BadInput(f"{path}: not valid YAML ({exc.__class__.__name__})") from None
    if not isinstance(raw, dict):
        raise BadInput(f"{path}: expected a mapping of profile fields")
    values: dict = {"name": str(raw.get("name", path.stem)), "description": str(raw.get("description", ""))}
    known = set(NUMBERS) | {
        "name",
        "description",
        "measured",
        "workload",
        "eval_prompts",
        "eval_prompts_sha256",
        "operating_points",
        "target",
        "trusted_evaluators",
        "signed",
        "context_floors",
        "watch",
    }
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
    values["operating_points"] = parse_operating_points(raw.get("operating_points"), path)
    values["measured"] = _measured(raw.get("measured"), values, path)
    values["target"] = _target(raw.get("target"), path)
    values["context_floors"] = _context_floors(raw.get("context_floors"), path)
    values["watch"] = _watch(raw.get("watch"), path)
    for key in ("trusted_evaluators", "signed"):
        if not isinstance(raw.get(key) or {}, dict):
            raise BadInput(f"{path}: {key} must be a mapping")
        values[key] = dict(raw.get(key) or {})
    if values["operating_points"]:
        values["cycle_points"] = primary(values["operating_points"]).cycle_ms_measured
    return Profile(**values)


WATCH_FIELDS = {"action": str, "tolerance": float, "false_alarm_intervals": float, "baseline_intervals": int,
                "command": str, "webhook": str}  # fmt: skip


def _watch(raw: object, path: Path) -> dict:
    """The production watch's policy: a mapping of known fields of the right kinds (their ranges are checked
    where the watch reads them, registry/watch.Policy)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise BadInput(f"{path}: watch must be a mapping of {', '.join(WATCH_FIELDS)}")
    out = {}
    for key, value in raw.items():
        kind = WATCH_FIELDS.get(key)
        if kind is None:
            raise BadInput(f"{path}: watch: unknown field {key!r} (known: {', '.join(WATCH_FIELDS)})")
        ok = isinstance(value, str) if kind is str else (isinstance(value, int | float) and not isinstance(value, bool))
        if not ok or (kind is int and value != int(value)) or (kind is not str and not math.isfinite(value)):
            raise BadInput(f"{path}: watch: {key} must be {'text' if kind is str else 'a number'}, not {value!r}")
        out[key] = kind(value)
    return out


def _context_floors(raw: object, path: Path) -> tuple[tuple[str, float], ...]:
    """{bucket: floor}: the conversations of that length must project at least `floor` times plain
    decoding, as a class floor holds a traffic class."""
    if raw is None:
        return ()
    known = context_buckets()
    if not isinstance(raw, dict) or not raw:
        raise BadInput(f"{path}: context_floors must map context buckets ({', '.join(known)}) to floors")
    out = []
    for name, floor in raw.items():
        if name not in known:
            raise BadInput(f"{path}: context_floors: unknown bucket {name!r} (buckets: {', '.join(known)})")
        if isinstance(floor, bool) or not isinstance(floor, int | float) or not math.isfinite(floor) or floor <= 0:
            raise BadInput(f"{path}: context_floors.{name} must be a number > 0, got {floor!r}")
        out.append((name, float(floor)))
    return tuple(sorted(out, key=lambda item: known.index(item[0])))


def _target(raw: object, path: Path) -> str:
    """A folder named relative to the profile (as its prompt files are), else the name as written."""
    if raw is None:
        return ""
    if not isinstance(raw, str) or not raw.strip():
        raise BadInput(f"{path}: target must name the deployment's target (a folder or a hub id)")
    here = path.parent / raw
    return str(here.resolve()) if here.is_dir() else raw


def _measured(raw: object, values: dict, path: Path) -> dict:
    """The provenance block; a calibrated one (it names an engine) must agree with the figures it explains."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise BadInput(f"{path}: measured must be a mapping")
    ops = values["operating_points"]
    if not ops:
        if raw.get("engine"):
            raise BadInput(f"{path}: measured names an engine but the profile has no operating_points")
        return dict(raw)
    head = primary(ops)
    for key, got, want in (("baseline_tps", values["baseline_tps"], head.plain_tps),
                           ("verify_ms", values["verify_ms"], head.verify_ms),
                           ("draft_step_ms", values["draft_step_ms"], head.draft_step_ms)):  # fmt: skip
        if abs(got - want) > 1e-6 * max(1.0, abs(want)):
            raise BadInput(
                f"{path}: {key} {got:g} contradicts operating point concurrency {head.concurrency} ({want:g}), "
                "the one that carries the most traffic"
            )
    depths, loads = raw.get("draft_steps"), raw.get("concurrency")
    if depths is not None and any(sorted(depths) != [k for k, _ in op.cycle_ms_measured] for op in ops):
        raise BadInput(f"{path}: measured.draft_steps {depths} are not the depths each operating point was timed at")
    if loads is not None and sorted(loads) != [op.concurrency for op in ops]:
        raise BadInput(f"{path}: measured.concurrency {loads} are not the profile's operating points")
    return dict(raw)


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
