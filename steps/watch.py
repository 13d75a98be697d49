"""`watch`: production's live acceptance, read from the serving engines' metrics every interval, tested for
a drop against its own signed baseline (serving/drift.py) and held against break-even at the load the
engines report; a drop leads to the profile's policy (warn, or warn then demote), each action audited
and signed by the service's promoter key (registry/ledger/watch.py). A long-running service: it stops after
--max_intervals, or when stopped (Ctrl-C, SIGTERM), or once it has demoted (exit 1). It never promotes.

    python -m steps.watch --model k2.5-mini-eagle3 --endpoints http://127.0.0.1:8000 --profile host-vllm
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import time
from typing import Any

from cli.spec import Param, Spec
from cli.step import log_params, run_step, step_run
from common.errors import BadInput
from common.values import none_if_empty, number
from engines import endpoint, exposition
from pipeline.promotion import decision_of, require_promoter_key
from pipeline.readings import Watched, take
from pipeline.watching import (
    FIGURE_EVERY,
    State,
    expected_digest,
    poll_recertify,
    priced_for_holder,
    publish_figure,
    ready,
    start_monitor,
    step,
)
from registry.access import naming
from registry.ledger import sanction
from registry.ledger import watch as policy_
from registry.ledger.trust import load_trust
from serving import drift
from serving.profile import load_profile

RECERTIFY_WAIT_S = 120  # at the watch's end, how long a recertify it started is waited for

SPEC = Spec(
    "watch",
    __doc__,
    (
        Param("model", default="k2.5-mini-eagle3", help="registered model name"),
        Param("alias", default="production", choices=("staging", "production")),
        Param("endpoints", help="comma-separated base URLs of the engines serving the alias"),
        Param("profile", default="host-vllm", help="the deployment's calibrated profile (break-even by load)"),
        Param("interval", default="10", help="seconds between reads"),
        Param("max_intervals", default="0", help="stop after this many intervals (0: until stopped)"),
        Param("policy", default="auto", help="warn or demote (auto: the profile's watch.action, else warn)"),
        Param("tolerance", default="auto", help="relative drop to detect (auto: the profile's, else 0.02)"),
        Param("draft_steps", default="auto", help="the served depth (auto: the promotion decision's)"),
        Param("recertify", default="yes", help="run recertify when the engine moves", choices=("yes", "no")),
    ),
)


def build() -> argparse.ArgumentParser:
    return SPEC.parser()


def run(args: argparse.Namespace) -> int:
    # deferred: torch comes with these, and --help or refused input needs none of it
    from registry.access import store

    state = setup(store.client(), args)
    interval = number(args.interval, "interval", 0.01, 86400, "seconds between reads")
    limit = int(number(args.max_intervals, "max_intervals", 0, 1e9, "a whole number"))
    stop = {"now": False}
    with contextlib.suppress(ValueError):  # only the main thread may install a handler
        signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    label = f"watch {state.name} @{state.alias} v{state.version}"
    with step_run("watch", run_name=label):
        log_params({"model": state.name, "alias": state.alias, "endpoints": ",".join(w.url for w in state.endpoints),
                    "profile": state.profile.name, "interval": interval, "max_intervals": limit,
                    "policy": state.policy.action, "tolerance": state.policy.tolerance, "draft_steps": state.k,
                    "false_alarm_intervals": state.policy.false_alarm_intervals,
                    "recertify": args.recertify})  # fmt: skip
        ready()
        code, n = 0, 0
        try:
            while not stop["now"] and (limit == 0 or n < limit):
                n += 1
                time.sleep(interval)
                if step(store.client(), state, n, args.recertify == "yes") == "demoted":
                    code = 1
                    break
                if n % FIGURE_EVERY == 0:
                    publish_figure(state)
        except KeyboardInterrupt:
            pass
        publish_figure(state)
        poll_recertify(state, wait_s=RECERTIFY_WAIT_S)
    print(f"watch: {n} intervals; {state.detections} drop(s) detected" + ("; demoted" if code else ""))
    return code


def setup(c: Any, args: argparse.Namespace) -> State:
    """What is watched and by what rule; bad input (exit 2) before anything is read twice."""
    from registry.access import store  # deferred: torch comes with it, and --help needs none of it

    naming.check_name(args.model, "--model")
    urls = endpoint.base_urls(args.endpoints)
    profile = load_profile(args.profile)
    if not profile.operating_points:
        raise BadInput(f"profile {profile.name} has no calibration by load (operating_points): run calibrate first")
    raw = dict(profile.watch)
    for key, given in (("action", args.policy), ("tolerance", args.tolerance)):
        if none_if_empty(given) is not None:
            raw[key] = given if key == "action" else number(given, key, 0, 0.5, "a relative drop")
    policy = policy_.Policy.read(raw, f"profile {profile.name}: watch")
    require_promoter_key()  # actions are signed: refused before anything is watched
    created = store.model_created(c, args.model)
    held = sanction.holder(c, args.model, args.alias)
    if held.version is None:
        raise BadInput(f"{args.model}: no sanctioned version holds {args.alias}; nothing to watch")
    k = served_depth(c, args, held)
    expected = endpoint.drafter_name(expected_digest(c, args.model, held.version, profile))
    window = drift.BaselineWindow(policy.tolerance, policy.baseline_intervals)
    priced = priced_for_holder(c, args.model, held.version, profile)  # the holder's own cycle
    state = State(args.model, args.alias, held.version, expected, k, policy, priced, [], window=window,
                  created=created, profile_arg=args.profile)  # fmt: skip
    for url in urls:
        try:
            first = endpoint.read(url)
        except endpoint.Unreachable as exc:
            raise BadInput(f"{url}: does not answer ({exc})") from None
        except exposition.NotExposition as exc:
            raise BadInput(f"{url}/metrics: {exc}: not a serving engine's metrics endpoint") from None
        except endpoint.Malformed as exc:
            raise BadInput(f"{url}: {exc}: not a serving engine's endpoint") from None
        w = Watched(url, version=first.version)
        got = take(w, first, expected, k)  # a good first reading is the first interval's base; a bad one is said
        if got.finding:  # said here, and into the audit trail at the first interval that finds it again
            print(f"watch: finding: {got.finding[1]}")
        state.endpoints.append(w)

    baseline, findings = policy_.recorded_baseline(c, state.subject, load_trust())
    for line in findings:
        print(f"watch: finding: {line}")
    if baseline is not None and len(baseline.acceptance) != k:
        print(f"watch: finding: the signed baseline counts {len(baseline.acceptance)} positions, not the served "
              f"depth {k}: a new one is learnt")  # fmt: skip
    elif baseline is not None:  # a restart keeps the baseline production settled on, not today's traffic
        start_monitor(state, baseline)
    return state


def served_depth(c: Any, args: argparse.Namespace, held: Any) -> int:
    if none_if_empty(args.draft_steps) is not None:
        return int(number(args.draft_steps, "draft_steps", 1, 64, "a whole number of draft tokens"))

    _, k = decision_of(c, args.model, [args.alias])
    if not k:
        raise BadInput(f"{args.model}@{args.alias}: no promotion decision gives the served depth: give --draft_steps")
    return int(k)


def main(argv: list[str] | None = None) -> None:
    run_step("watch", build, run, argv)


if __name__ == "__main__":
    main()
