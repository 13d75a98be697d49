"""`plan`: break-even and required-acceptance table for a deployment profile. No model needed."""

from __future__ import annotations

import argparse

from cli.spec import Param, Spec
from cli.step import log_params, run_step, step_run
from common import metric_names as names
from common.errors import BadInput
from common.values import none_if_empty
from registry.ledger.deployment import basis_of
from serving.cost import break_even_accept_len, plan_table
from serving.profile import Profile, load_profile

DEFAULT_TPS = "82,100,150,200"


SPEC = Spec(
    "plan",
    __doc__,
    (
        Param("profile", default="kimi-k2.5-8xrtxpro6000", help="profile name or YAML path"),
        Param("tps", default=DEFAULT_TPS, help="comma-separated target speeds (tok/s)"),
        Param("draft_steps", default="auto", help="draft steps k (auto: the profile's)", cli=True),
        Param("no-mlflow", help="print only, log nothing", flag=True, off=True, dest="mlflow", cli=True),
    ),
)


def build() -> argparse.ArgumentParser:
    return SPEC.parser()


def parse_tps(text: str) -> list[float]:
    try:
        values = [float(x) for x in str(text).replace(" ", "").strip("[]").split(",") if x]
    except ValueError:
        raise BadInput(f"--tps must be comma-separated numbers, got {text!r}") from None
    if not values or any(not (0 < v < float("inf")) for v in values):  # nan fails both comparisons
        raise BadInput(f"--tps must hold positive finite numbers, got {text!r}")
    return values


def table_frame(profile: Profile, tps: list[float]):
    import pandas as pd  # deferred: pandas takes seconds to import, and --help or refused input needs none of it

    k = profile.draft_steps
    rows = plan_table(profile, tps)
    return pd.DataFrame(
        {
            "target_tps": [r.target_tps for r in rows],
            "required_accept_len": [round(r.required_accept_len, 3) for r in rows],
            "acc_unbounded": [round(r.acc_unbounded, 4) for r in rows],
            f"acc_{k}_steps": [round(r.acc_k_steps, 4) if r.acc_k_steps is not None else None for r in rows],
            "note": ["" if r.acc_k_steps is not None else f"unreachable with {k} steps (max {k + 1})" for r in rows],
        }
    )


def render(profile: Profile, tps: list[float]) -> str:
    k = profile.draft_steps
    lines = [
        f"profile {profile.name}: baseline {profile.baseline_tps:g} tok/s, cycle {profile.cycle_ms:g} ms "
        f"({k} draft steps); break-even accept_len {break_even_accept_len(profile):.2f}",
        "",
        f"| target tok/s | required accept_len | cond. acceptance (unbounded) | cond. acceptance ({k} steps) |",
        "|---:|---:|---:|---:|",
    ]
    for r in plan_table(profile, tps):
        kcol = f"{r.acc_k_steps:.0%}" if r.acc_k_steps is not None else f"unreachable with {k} steps"
        lines.append(f"| {r.target_tps:g} | {r.required_accept_len:.2f} | {r.acc_unbounded:.0%} | {kcol} |")

    lines += ["", basis_of(profile)]
    if profile.operating_points:
        depths = sorted({d for op in profile.operating_points for d, _ in op.cycle_ms_measured} | {k})
        lines += ["", "| concurrency (share) | plain tok/s | " + " | ".join(f"break-even k={d}" for d in depths) + " |",
                  "|---" * (len(depths) + 2) + "|"]  # fmt: skip
        for op in profile.operating_points:
            cells = " | ".join(f"{op.break_even(d):.3f}" for d in depths)
            lines.append(f"| {op.concurrency} ({op.share:.0%}) | {op.plain_tps:.1f} | {cells} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    profile = load_profile(args.profile)
    if none_if_empty(args.draft_steps):
        try:
            k = int(args.draft_steps)
        except ValueError:
            raise BadInput(f"--draft_steps must be an integer, got {args.draft_steps!r}") from None
        if k < 1:
            raise BadInput(f"--draft_steps must be >= 1, got {k}")
        profile = profile.with_draft_steps(k)
    tps = parse_tps(args.tps)
    text = render(profile, tps)
    print(text)
    if args.mlflow:
        import mlflow  # deferred: mlflow takes seconds to import, and --help or refused input needs none of it

        with step_run("plan"):
            log_params({"profile": profile.name, "draft_steps": profile.draft_steps, "tps": args.tps})
            mlflow.log_metric("break_even_accept_len", break_even_accept_len(profile))
            for view in profile.serving_points() if profile.operating_points else []:
                mlflow.log_metric(names.at_concurrency("break_even_accept_len", view.concurrency),
                                  break_even_accept_len(view))  # fmt: skip
            mlflow.log_table(table_frame(profile, tps), artifact_file="plan_table.json")
            mlflow.log_text(text + "\n", "plan.md")
    return 0


def main(argv: list[str] | None = None) -> None:
    run_step("plan", build, run, argv)


if __name__ == "__main__":
    main()
