"""What an entry point's parameters say, read as typed values in one place: the words MLproject passes for
"not given" (`auto`, `none`), and numbers and lists of numbers (checked, never rounded; bad input names the
parameter). The steps and the services under them (evaluation/, registry/) read their arguments with these."""

from __future__ import annotations

import math

from common.errors import BadInput

NOT_GIVEN = ("", "none", "None", "auto")


def none_if_empty(value: str | None) -> str | None:
    """MLproject parameters cannot be absent: the words `auto` (worked out by the step) and `none`
    (not used) stand for 'not given', so that no run shows an empty parameter."""
    return value if value not in (None, *NOT_GIVEN) else None


MAX_ROUNDS = 100  # served timing rounds: past this a measurement is hours, not a better figure
MAX_CONCURRENCY = 64  # requests in flight a served measurement keeps
MAX_DRAFT_STEPS = 64


def integer(value: str, name: str, low: int = 0, high: int | None = None) -> int:
    """A whole-number parameter (`--name`) in [low, high]; anything else (2.7, nan, inf, words) is bad input
    naming it, never silently rounded."""
    try:
        out = int(value)
    except (TypeError, ValueError):
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = float("nan")
        if not number.is_integer():
            raise BadInput(f"--{name} must be a whole number, got {value!r}") from None
        out = int(number)
    if out < low:
        raise BadInput(f"--{name} must be >= {low}, got {value!r}")
    if high is not None and out > high:
        raise BadInput(f"--{name} must be <= {high}, got {value!r}")
    return out


def number(value: str, name: str, low: float = -math.inf, high: float = math.inf, what: str | None = None) -> float:
    """A finite number parameter in [low, high] (nan and inf are bad input, as are words); `what` names the
    range in the message when it says more than the bounds (a share, an open interval)."""
    if what is None:
        what = f"a finite number >= {low:g}" if high == math.inf else f"a finite number in [{low:g}, {high:g}]"
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise BadInput(f"--{name} must be a number, got {value!r}") from None
    if not math.isfinite(out) or not low <= out <= high:
        raise BadInput(f"--{name} must be {what}, got {value!r}")
    return out


def integers(value: str, name: str, low: int, high: int | None = None, repeats: bool = False) -> list[int]:
    """Comma-separated whole numbers in [low, high], sorted; a repeat is bad input unless `repeats` (then
    merged)."""
    span = f"from {low} to {high}" if high is not None else f">= {low}"
    try:
        items = [float(x) for x in str(value).split(",") if x.strip()]
    except ValueError:
        raise BadInput(f"--{name} must be comma-separated whole numbers, got {value!r}") from None
    if not items or any(
        not math.isfinite(x) or x != int(x) or x < low or (high is not None and x > high) for x in items
    ):
        raise BadInput(f"--{name} must be whole numbers {span}, got {value!r}")
    if len(set(items)) != len(items) and not repeats:
        raise BadInput(f"--{name} repeats a value: {value!r}")
    return sorted({int(x) for x in items})


def draft_depth(value: str) -> int:
    """A draft depth: a whole number from 1 to 64 (2.7, nan, inf and 1e9 are bad input, not rounded)."""
    try:
        return integer(value, "draft_steps", 1, MAX_DRAFT_STEPS)
    except BadInput:
        raise BadInput(f"--draft_steps must be a whole number from 1 to {MAX_DRAFT_STEPS}, got {value!r}") from None


def traffic_shares(value: str, loads: list[int]) -> dict[int, float]:
    """--shares: the traffic share of each concurrency (empty or auto: equal), one each, summing to 1."""
    if not none_if_empty(value):
        return {c: 1 / len(loads) for c in loads}
    try:
        shares = [float(x) for x in value.split(",")]
    except ValueError:
        raise BadInput(f"--shares must be comma-separated numbers, got {value!r}") from None
    if len(shares) != len(loads) or any(not 0 <= s <= 1 for s in shares) or abs(sum(shares) - 1) > 1e-6:
        raise BadInput(f"--shares needs one share in [0, 1] per concurrency ({len(loads)}), summing to 1")
    return dict(zip(loads, shares, strict=True))
