"""The shape gate's tables: each check against the target, two drafters side by side, and the version page's
section."""

from __future__ import annotations

from typing import Any


def table(checks: list[Any]) -> str:
    """drafter/analysis/compat.py's checks: name, expected, actual, verdict."""
    lines = ["| check | expected | actual | verdict |", "|---|---|---|---|"]
    lines += [f"| {c.name} | {c.expected} | {c.actual} | {c.verdict} |" for c in checks]
    return "\n".join(lines)


def comparison_table(rows, a: str, b: str) -> str:
    lines = [f"| tensor | {a} | {b} | match |", "|---|---|---|---|"]
    lines += [f"| {name} | {x} | {y} | {m} |" for name, x, y, m in rows]
    return "\n".join(lines)


def section(target: str, result: str, md: str) -> str:
    return f"## Shape gate vs `{target}`: {result}\n\n{md}\n"
