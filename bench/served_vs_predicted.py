"""Does the calibrated profile predict what the engine serves? For the latest `evaluate --engine vllm` run of each
drafter in a store made under a calibrated profile: the speed-up the profile predicts from the engine's accept_len at
each operating point, against the served decode speed-up measured at that load (batch 1, and the run's
`--concurrency`), with the hand-written `host` profile's prediction beside it. Writes
bench/results/served_vs_predicted.json.

    python -m bench.served_vs_predicted --store sqlite:///mlflow.db [--profile PATH]
"""

from __future__ import annotations

import argparse

from bench._common import write_results
from common import metric_names as names
from drafter.methods import DEFAULT, named
from evaluation.measure import served_speedups
from reports.operating import served_vs_predicted
from serving.cost import break_even_accept_len
from serving.profile import load_profile


def rows(store: str, profile_path: str | None) -> list[dict]:
    from mlflow import MlflowClient

    c = MlflowClient(store)
    runs = c.search_runs(
        [e.experiment_id for e in c.search_experiments()],
        "tags.engine = 'vllm'",
        order_by=["attributes.start_time ASC"],
    )
    host = load_profile("host")
    latest = {}
    for run in runs:  # oldest first: the latest evaluation of each drafter on each profile stands
        latest[(run.data.params.get("model", ""), run.data.params.get("profile", ""))] = run
    out = []
    for run in latest.values():
        m, params = run.data.metrics, run.data.params
        path = params.get("profile", "")
        if not names.by_concurrency(m, "predicted_served_speedup"):
            continue
        k = int(params.get("resolved.draft_steps", params.get("draft_steps", host.draft_steps)))
        method = named(run.data.tags.get("draft_method", DEFAULT.NAME))  # what evaluate priced it as
        host_k = host.shaped(method.SHAPE, method.NAME).with_draft_steps(k)
        row = {
            "run": run.info.run_id,
            "model": params.get("model", ""),
            "profile": path,
            "k": k,
            "engine_accept_len": m["engine_accept_len"],
            "delivered_share": m.get("engine_delivered_share"),  # None: a run from before the correction
            "host_predicted_speedup": m["engine_accept_len"] / break_even_accept_len(host_k),
        }
        served = served_speedups(m)
        predicted = names.by_concurrency(m, "predicted_served_speedup")
        row["method"] = method.NAME
        if profile_path:  # another calibration's prediction from the same served figures, for the run's method
            shaped = load_profile(profile_path).shaped(method.SHAPE, method.NAME)
            share = m.get("engine_delivered_share", 1.0)
            again = served_vs_predicted(shaped, k, m["engine_accept_len"], served, share)
            predicted = names.by_concurrency(again, "predicted_served_speedup")
        for c_, value in predicted.items():
            if c_ in served:
                row[f"c{c_}"] = {"predicted": value, "served": served[c_], "error": served[c_] / value - 1}
        out.append(row)
    return out


def report_rows(table: list[dict]) -> list[dict]:
    """One row a drafter and draft depth: served / predicted speed-up (error) at each load measured."""
    loads = sorted(
        {key for r in table for key in r if key.startswith("c") and key[1:].isdigit()}, key=lambda x: int(x[1:])
    )
    out = []
    for r in table:
        share = f"{r['delivered_share']:.3f}" if r.get("delivered_share") else "- (uncorrected)"
        row = {"drafter": r["model"], "method": r.get("method", DEFAULT.NAME), "k": r["k"],
               "engine accept_len": f"{r['engine_accept_len']:.3f}", "delivered share": share}  # fmt: skip
        for c in loads:
            x = r.get(c)
            served = (
                f"{x['served']:.2f}x / {x['predicted']:.2f}x ({100 * x['error']:+.1f}%)" if x and x["served"] else "-"
            )
            row[f"concurrency {c[1:]}: served / predicted (error)"] = served
        row["host.yaml predicts"] = f"{r['host_predicted_speedup']:.2f}x"
        out.append(row)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--store", default="sqlite:///mlflow.db")
    p.add_argument("--profile", default=None, help="predict from this calibrated profile instead of the run's own")
    p.add_argument("--notes", default="", help="what the runs in the store were (written under the table)")
    args = p.parse_args()
    table = rows(args.store, args.profile)
    if not table:
        raise SystemExit("no evaluate --engine vllm run under a calibrated profile in this store")
    print(write_results("served_vs_predicted", report_rows(table), args.notes))


if __name__ == "__main__":
    main()
