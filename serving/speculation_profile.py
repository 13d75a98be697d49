"""`speculation_profile.json` (schema 1.0, NVIDIA ModelOpt's specdec_bench) out, and outside measurements in.

Out: the portable summary that travels with a draft checkpoint, written from our histograms with every
evaluation and beside the weights `export` writes. Both rate vectors are named (conditional and marginal), both
means too, and the file carries its own checks: |1 + sum(marginal) - mean| within 0.02, marginals non-increasing.

In: another tool's measurement, a `speculation_profile.json` or a speculators `acceptance.csv`, read as an
outside figure that `compare --external` shows beside ours with its definition and conditions named. It is never
evidence (unsigned, measured on a workload we did not pin). A file that fails its own consistency check is bad
input, said in one line naming the file and the field.
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.errors import BadInput
from serving.acceptance import BLOCK, CHAIN, Histograms, accept_len_from_marginals

SCHEMA_VERSION = "1.0"
MEAN_TOLERANCE = 0.02  # |1 + sum(marginal) - mean|, as ModelOpt's own check
MAX_BYTES = 16 * 1024 * 1024
CHAIN_METHODS = frozenset({"eagle", "eagle1", "eagle2", "eagle3", "draft_model"})


def build(
    h: Histograms,
    method: str,
    draft_checkpoint: dict[str, Any],
    target_model: dict[str, Any],
    conditions: dict[str, Any],
) -> dict[str, Any]:
    """The schema-1.0 profile of one measurement (the histogram keyed by acceptance length j + 1, as ModelOpt
    keys it; per_category one entry per traffic class)."""
    marginal, conditional = h.marginal, h.conditional
    mean = h.accept_len
    by_k = h.accept_len_by_k()
    per_category = {
        name: {
            "mean_accept_length": round(part.accept_len, 6),
            "mean_accept_length_per_request": round(part.accept_len_per_request, 6),
            "num_requests": len(part.requests),
            "num_spec_steps": part.verify_steps,
        }
        for name, part in h.by_class().items()
        if name
    }
    return {
        "schema_version": SCHEMA_VERSION,
        "measured": True,
        "method": method,
        "draft_checkpoint": draft_checkpoint,
        "target_model": target_model,
        "num_speculative_tokens": h.k,
        "block_size": h.k + 1 if h.shape == BLOCK else None,
        "max_supported_k": h.k,
        "verification_method": "longest_prefix",
        "conditional_accept_rates": [round(x, 6) for x in conditional],
        "marginal_accept_rates": [round(x, 6) for x in marginal],
        "mean_accept_length": round(mean, 6),
        "mean_accept_length_per_request": round(h.accept_len_per_request, 6),
        "accept_length_model": "chain_analytic" if h.shape == CHAIN else "measured_per_k",
        "accept_length_by_k": {str(d): round(v, 6) for d, (v, how) in by_k.items() if how == "measured"}
        if h.shape == BLOCK
        else {str(d): round(v, 6) for d, (v, _) in by_k.items()},
        "acceptance_length_histogram": {str(j + 1): n for j, n in enumerate(h.total)},
        "per_category": per_category or None,
        "measurement_conditions": conditions,
        "validation": validation(mean, marginal),
    }


def validation(mean: float, marginal: list[float]) -> dict[str, Any]:
    """The profile's own two checks, as ModelOpt records them."""
    implied = accept_len_from_marginals(marginal)
    delta = abs(implied - mean)
    violations = [{"position": i, "value": marginal[i], "previous": marginal[i - 1]}
                  for i in range(1, len(marginal)) if marginal[i] > marginal[i - 1] + 1e-9]  # fmt: skip
    return {
        "mean_consistency": {
            "implied_mean_accept_length": round(implied, 6),
            "reported_mean_accept_length": round(mean, 6),
            "abs_delta": round(delta, 6),
            "tolerance": MEAN_TOLERANCE,
            "passed": delta <= MEAN_TOLERANCE,
        },
        "marginal_monotonicity": {"passed": not violations, "violations": violations},
    }


def stub(k: int, method: str, draft_checkpoint: dict[str, Any]) -> dict[str, Any]:
    """An unmeasured placeholder (`measured` false, no figures): distinguishable from a missing profile."""
    return {"schema_version": SCHEMA_VERSION, "measured": False, "method": method, "draft_checkpoint": draft_checkpoint,
            "target_model": None, "num_speculative_tokens": k, "block_size": None, "max_supported_k": k,
            "verification_method": "longest_prefix", "conditional_accept_rates": [0.0] * k,
            "marginal_accept_rates": [0.0] * k, "mean_accept_length": None, "mean_accept_length_per_request": 0.0,
            "accept_length_model": "chain_analytic" if chain_method(method) else "measured_per_k",
            "accept_length_by_k": {}, "acceptance_length_histogram": None, "per_category": None,
            "measurement_conditions": None, "validation": None}  # fmt: skip


def write(profile: dict[str, Any], folder: Path) -> Path:
    path = Path(folder) / "speculation_profile.json"
    path.write_text(json.dumps(profile, indent=2) + "\n")
    return path


@dataclass(frozen=True)
class External:
    """Another tool's measurement, as that tool defined it: never evidence."""

    source: str  # the file
    kind: str  # "speculation_profile.json" or "speculators acceptance.csv"
    accept_len: float  # pooled per verify step
    accept_len_per_request: float | None  # None: the file has no per-request mean
    marginal: list[float]
    k: int
    method: str = ""
    conditions: dict[str, Any] = field(default_factory=dict)
    per_category: dict[str, float] = field(default_factory=dict)  # pooled accept_len by the file's categories

    @property
    def definition(self) -> str:
        both = " and the mean of per-request values" if self.accept_len_per_request is not None else ""
        return f"1 + accepted / verify steps, pooled over steps{both}, at {self.k} draft tokens"


def read_external(path: Path) -> External:
    """An outside measurement: a speculation_profile.json or a speculators acceptance.csv (BadInput, one line
    naming the file and the field, when it is neither or fails its own consistency check)."""
    path = Path(path)
    if not path.is_file():
        raise BadInput(f"{path}: no such file")
    if path.stat().st_size > MAX_BYTES:
        raise BadInput(f"{path}: over {MAX_BYTES // (1024 * 1024)} MiB, not a measurement summary")
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError) as exc:
        raise BadInput(f"{path}: not readable text ({type(exc).__name__})") from None
    if path.suffix.lower() == ".csv":
        return _from_acceptance_csv(path, text)
    return _from_profile(path, text)


def _number(path: Path, field_name: str, value: Any, low: float = 0.0, high: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise BadInput(f"{path}: '{field_name}' is {value!r}, not a number")
    if not low <= value <= high:
        raise BadInput(f"{path}: '{field_name}' is {value}, outside [{low:g}, {high:g}]")
    return float(value)


def _from_profile(path: Path, text: str) -> External:
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadInput(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(raw, dict):
        raise BadInput(f"{path}: not a speculation profile (a JSON object)")
    if raw.get("schema_version") != SCHEMA_VERSION:
        raise BadInput(f"{path}: 'schema_version' is {raw.get('schema_version')!r}, not {SCHEMA_VERSION!r}")
    if raw.get("measured") is not True:
        raise BadInput(f"{path}: 'measured' is not true: an unmeasured placeholder carries no figures")
    k = raw.get("num_speculative_tokens")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 64:
        raise BadInput(f"{path}: 'num_speculative_tokens' is {k!r}, not a depth from 1 to 64")
    marginal = raw.get("marginal_accept_rates")
    if not isinstance(marginal, list) or len(marginal) != k:
        raise BadInput(f"{path}: 'marginal_accept_rates' is not a list of {k} rates")
    marginal = [_number(path, f"marginal_accept_rates[{i}]", v, 0.0, 1.0) for i, v in enumerate(marginal)]
    mean = _number(path, "mean_accept_length", raw.get("mean_accept_length"), 1.0, k + 1.0)
    per_request = raw.get("mean_accept_length_per_request")
    per_request = None if per_request in (None, 0, 0.0) else _number(
        path, "mean_accept_length_per_request", per_request, 1.0, k + 1.0
    )  # fmt: skip
    _consistent(path, "mean_accept_length", mean, marginal)
    histogram = raw.get("acceptance_length_histogram")
    if histogram is not None:
        _histogram_agrees(path, histogram, mean, k)
    conditions = raw.get("measurement_conditions") if isinstance(raw.get("measurement_conditions"), dict) else {}
    cats = raw.get("per_category") if isinstance(raw.get("per_category"), dict) else {}
    per_category = {}
    for name, fig in cats.items():
        value = fig.get("mean_accept_length") if isinstance(fig, dict) else None
        per_category[str(name)] = _number(path, f"per_category.{name}.mean_accept_length", value, 1.0, k + 1.0)
    return External(str(path), "speculation_profile.json", mean, per_request, marginal, k,
                    str(raw.get("method") or ""), conditions, per_category)  # fmt: skip


def _consistent(path: Path, field_name: str, mean: float, marginal: list[float]) -> None:
    check = validation(mean, marginal)
    if not check["marginal_monotonicity"]["passed"]:
        at = check["marginal_monotonicity"]["violations"][0]["position"]
        raise BadInput(f"{path}: 'marginal_accept_rates' rises at position {at}: no longest-prefix measurement does")
    if not check["mean_consistency"]["passed"]:
        implied = check["mean_consistency"]["implied_mean_accept_length"]
        raise BadInput(f"{path}: '{field_name}' {mean:g} is not 1 + sum of the marginal rates ({implied:g}) within "
                       f"{MEAN_TOLERANCE}: its own consistency check fails")  # fmt: skip


def _histogram_agrees(path: Path, histogram: Any, mean: float, k: int) -> None:
    """The histogram (keyed by acceptance length 1..k+1) gives the mean it sits beside."""
    if not isinstance(histogram, dict) or not histogram:
        raise BadInput(f"{path}: 'acceptance_length_histogram' is not a map of acceptance length to steps")
    steps = total = 0.0
    for key, n in histogram.items():
        length = int(key) if str(key).isdigit() else -1
        if not 1 <= length <= k + 1:
            raise BadInput(f"{path}: 'acceptance_length_histogram' has length {key!r}, outside 1..{k + 1}")
        n = _number(path, f"acceptance_length_histogram.{key}", n)
        steps, total = steps + n, total + length * n
    if steps <= 0:
        raise BadInput(f"{path}: 'acceptance_length_histogram' holds no verify steps")
    if abs(total / steps - mean) > MEAN_TOLERANCE:
        raise BadInput(f"{path}: 'acceptance_length_histogram' gives {total / steps:.4f}, not its "
                       f"'mean_accept_length' {mean:g}")  # fmt: skip


CSV_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_length")


def _from_acceptance_csv(path: Path, text: str) -> External:
    """speculators' acceptance.csv: one row per subset, its counter differences and acceptance_at_pos_i (the
    accepted count at position i over drafts: a marginal rate)."""
    try:
        rows = list(csv.DictReader(io.StringIO(text)))
    except csv.Error as exc:
        raise BadInput(f"{path}: not CSV ({exc})") from None
    if not rows:
        raise BadInput(f"{path}: no rows")
    header = list(rows[0])
    missing = [c for c in CSV_COUNTERS if c not in header]
    if missing:
        raise BadInput(f"{path}: no column {missing[0]!r} (speculators' acceptance.csv has {', '.join(CSV_COUNTERS)})")
    positions = sorted((c for c in header if c.startswith("acceptance_at_pos_")), key=lambda c: int(c.rsplit("_")[-1])
                       if c.rsplit("_")[-1].isdigit() else -1)  # fmt: skip
    if not positions or [c.rsplit("_")[-1] for c in positions] != [str(i) for i in range(len(positions))]:
        raise BadInput(f"{path}: the columns acceptance_at_pos_0..N are missing or not numbered from 0")
    drafts = accepted = 0.0
    per_pos = [0.0] * len(positions)
    per_category = {}
    for r, row in enumerate(rows, start=2):
        where = f"line {r}"
        figures = {c: _cell(path, where, c, row.get(c)) for c in (*CSV_COUNTERS, *positions)}
        d, t, a = figures["num_drafts"], figures["num_draft_tokens"], figures["num_accepted_tokens"]
        if d <= 0:
            raise BadInput(f"{path}: {where}: 'num_drafts' is {d:g}: no verify steps")
        if a > t or t > d * len(positions) + 1e-6:
            raise BadInput(f"{path}: {where}: 'num_accepted_tokens' {a:g} and 'num_draft_tokens' {t:g} are not "
                           f"possible at {len(positions)} drafts per step over {d:g} steps")  # fmt: skip
        rates = [figures[c] for c in positions]
        if any(not 0 <= v <= 1 for v in rates):
            raise BadInput(f"{path}: {where}: an acceptance_at_pos rate is outside [0, 1]")
        if abs(figures["acceptance_length"] - (1 + a / d)) > MEAN_TOLERANCE:
            raise BadInput(f"{path}: {where}: 'acceptance_length' {figures['acceptance_length']:g} is not 1 + "
                           f"num_accepted_tokens / num_drafts ({1 + a / d:.4f})")  # fmt: skip
        _consistent(path, f"{where}: acceptance_length", figures["acceptance_length"], rates)
        drafts, accepted = drafts + d, accepted + a
        per_pos = [p + v * d for p, v in zip(per_pos, rates, strict=True)]
        per_category[str(row.get("subset") or f"row {r - 1}")] = figures["acceptance_length"]
    marginal = [p / drafts for p in per_pos]
    return External(str(path), "speculators acceptance.csv", 1 + accepted / drafts, None, marginal, len(positions),
                    per_category=per_category)  # fmt: skip


def _cell(path: Path, where: str, column: str, value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise BadInput(f"{path}: {where}: '{column}' is {value!r}, not a number") from None
    if not math.isfinite(number) or number < 0:
        raise BadInput(f"{path}: {where}: '{column}' is {value}, not a finite count or rate >= 0")
    return number


def chain_method(method: str) -> bool:
    return method.lower() in CHAIN_METHODS


def checkpoint_id(path: str) -> str:
    """A checkpoint's last two path parts (`org/model`): a published profile carries no local layout."""
    parts = [p for p in str(path).replace("\\", "/").split("/") if p]
    return "/".join(parts[-2:])
