"""A version's description as the place a person reads its story: marked sections that the steps
replace in place (one per shape gate target, per evaluated profile, and the promotion verdict), so
the latest word of each stays on the version page without burying the rest."""

from __future__ import annotations

import re
from typing import Any

ORDER = (
    "decision",
    "aliases",
    "promotion",
    "evaluation",
    "probe",
    "scale",
    "shape_gate",
    "lineage",
    "contents",
)  # the decision first; where the version came from, its settings and its inventory last
_SECTION = re.compile(r"<!-- ([^>]+?) -->\n(.*?)\n<!-- /\1 -->", re.S)


def upsert_section(text: str, key: str, body: str) -> str:
    """`text` with the section `key` replaced by `body` (or added), the sections ordered by ORDER under
    the unmarked head's title line (what the version is), so the verdict reads before the lineage,
    the settings and the inventory."""
    sections = {m.group(1): m.group(2) for m in _SECTION.finditer(text)}
    head = _SECTION.sub("", text).strip()
    title, _, rest = head.partition("\n")
    if rest.strip() and "lineage" not in sections:  # the title stays on top; lineage and settings go below
        head, sections["lineage"] = title.strip(), rest.strip()
    sections[key] = body.strip()

    def rank(k: str) -> int:
        kind = k.split(":")[0]
        return ORDER.index(kind) if kind in ORDER else len(ORDER)

    blocks = [f"<!-- {k} -->\n{sections[k]}\n<!-- /{k} -->" for k in sorted(sections, key=rank)]
    return "\n\n".join([head, *blocks] if head else blocks)


def run_md(run_id: str, experiment_id: str | None = None) -> str:
    """A run id as a link the UI follows (markdown in a description; the hash route of MLflow's UI)."""
    if not run_id:
        return "none"
    if experiment_id is None:
        import mlflow

        experiment_id = mlflow.get_run(run_id).info.experiment_id
    return f"[`{run_id[:8]}`](#/experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning)"


def set_section(c: Any, name: str, version: str, key: str, body: str) -> None:
    mv = c.get_model_version(name, version)
    c.update_model_version(name, version, description=upsert_section(mv.description or "", key, body))


def contents(hashes: dict[str, str], header: dict[str, Any]) -> str:
    """The files (with their sha256) and tensors (shape, dtype) of a drafter folder, from its headers;
    every version's page lists them, whatever made the version."""
    rows = "\n".join(f"| `{k}` | {list(v.shape)} | {v.dtype} |" for k, v in sorted(header.items()))
    files = "\n".join(f"| `{k}` | `{v}` |" for k, v in hashes.items())
    return (
        f"### Files\n\n| file | sha256 |\n|---|---|\n{files}\n\n"
        f"### Tensors\n\n| tensor | shape | dtype |\n|---|---|---|\n{rows}\n"
    )


def parameter_count(header: dict[str, Any]) -> int:
    """Trainable parameters from the headers (the shared embedding is not the drafter's)."""
    width = {"BF16": 2, "F16": 2, "F32": 4}
    return sum(v.nbytes // width[v.dtype] for v in header.values() if v.dtype in width)


def refresh_model_page(c: Any, name: str, last_decision: str | None = None) -> None:
    """The registered model's page answers "which drafter is where, and why": one row per alias, then
    every version with what it is, its aliases and its latest evaluations, and the last promotion decision."""
    from registry.access import naming

    rm = c.get_registered_model(name)
    aliases = dict(getattr(rm, "aliases", {}) or {})
    versions = {
        str(mv.version): mv
        for mv in c.search_model_versions(f"name={naming.quote_filter_value(name)}")
        if mv.tags.get(naming.TAG_COMPLETE) == "true"  # a crash leftover is no version to list
    }
    rows = []
    for alias in naming.ALIASES:
        version = aliases.get(alias)
        mv = versions.get(str(version)) if version is not None else None
        if mv is None:
            rows.append(f"| `{alias}` | none | | |")
            continue
        rows.append(f"| `{alias}` | v{version} | {role(mv)} | {_evaluations(mv.tags)} |")
    every = []
    for v in sorted(versions, key=int):
        mine = sorted(a for a, at in aliases.items() if str(at) == v)
        every.append(
            f"| v{v} | {role(versions[v])} | {', '.join(f'`{a}`' for a in mine) or 'none'} | "
            f"{_evaluations(versions[v].tags)} |"
        )
    body = (
        "## Where each alias points\n\n| alias | version | what it is | latest evaluation |\n|---|---|---|---|\n"
        + "\n".join(rows)
        + "\n\n### Every version\n\n| version | what it is | aliases | latest evaluation |\n|---|---|---|---|\n"
        + "\n".join(every)
        + "\n\n`staging` and `production` move only through `promote`; "
        + guard_sentence(c)
    )
    text = upsert_section(rm.description or "", "aliases", body)
    if last_decision:
        text = upsert_section(text, "decision", f"## Last promotion decision\n\n{last_decision}")
    c.update_registered_model(name, description=text)


def role(mv: Any) -> str:
    """What a version is, from the first line of its description ('Fine-tuned from models:/x/1')."""
    head = next((ln.lstrip("# ").strip() for ln in (mv.description or "").splitlines() if ln.strip()), "")
    return head.replace("|", "/") or "?"


def guard_sentence(c: Any) -> str:
    """Whether a guard watches this registry (its webhook is installed), said as it is."""
    from mlflow.exceptions import MlflowException

    try:
        hooks = [h for h in c.list_webhooks() if h.name == "drafterops-guard" and str(h.status).endswith("ACTIVE")]
    except MlflowException:  # a store without webhooks (older servers, some backends)
        hooks = []
    if hooks:
        return "a guard (webhook `drafterops-guard`) reverts any other move and reconciles on a timer."
    return (
        "no guard is installed on this registry: nothing reverts another move until "
        "`python -m steps.guard --reconcile` runs (from cron or CI) or a guard is installed."
    )


def _rounded(value: str | None, digits: int) -> str:
    """A tag's number rounded (never sliced: '1.6325' is 1.633, not '1.632')."""
    try:
        return f"{float(value):.{digits}f}"
    except (TypeError, ValueError):
        return "?"


def _evaluations(tags: dict[str, str]) -> str:
    """'1.910 [1.752, 2.065] vs break-even 2.46 on profile' for each profile the version was evaluated on."""
    out = []
    for key in sorted(tags):
        if key.startswith("eval.") and key.endswith(".accept_len"):
            p = key[len("eval.") : -len(".accept_len")]
            low, high, be = (
                _rounded(tags.get(f"eval.{p}.{k}"), digits)
                for k, digits in (("accept_len_ci_low", 3), ("accept_len_ci_high", 3), ("break_even", 2))
            )
            out.append(f"{_rounded(tags[key], 3)} [{low}, {high}] vs break-even {be} on `{p}`")
    return "; ".join(out) or "not evaluated"
