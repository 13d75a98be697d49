"""Outside measurements in words: each file's figures under its own definition and conditions, beside ours in a
bake-off, said never to be evidence (serving/speculation_profile.read_external reads and checks them)."""

from __future__ import annotations

from common.errors import BadInput
from serving.speculation_profile import External, read_external


def read_all(arg: str) -> list[External]:
    """Every file named in a comma-separated --external (none: no file), each checked before anything runs."""
    names = [x.strip() for x in str(arg).split(",")]
    if [x.lower() for x in names] in (["none"], [""]):
        return []
    if "" in names:
        raise BadInput(f"--external: an empty entry in {arg!r}")
    return [read_external(name) for name in names]


def markdown(outside: list[External]) -> str:
    """The outside figures as their tools define them, and why none of them decides anything here."""
    lines = ["Outside measurements (not evidence: unsigned, and measured on a workload this profile does not pin):", "",
             "| file | kind | method | draft tokens | accept_len (pooled per verify step) | per-request mean | "
             "conditions |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for ext in outside:
        per_request = f"{ext.accept_len_per_request:.3f}" if ext.accept_len_per_request is not None else "not given"
        conditions = ", ".join(f"{k}: {v}" for k, v in sorted(ext.conditions.items()) if v not in (None, "")) or "-"
        lines.append(f"| {ext.source} | {ext.kind} | {ext.method or '-'} | {ext.k} | {ext.accept_len:.3f} | "
                     f"{per_request} | {conditions[:200]} |")  # fmt: skip
        if ext.per_category:
            cats = ", ".join(f"{name} {v:.3f}" for name, v in ext.per_category.items())
            lines.append(f"| | by category | | | {cats} | | |")
    lines += ["", "Each is 1 + accepted drafts / verify steps pooled over steps, as ours is (docs/metrics.md); a "
              "per-request mean averages requests without weights and can rank drafters the other way."]  # fmt: skip
    return "\n".join(lines)
