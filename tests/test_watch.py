"""The production watch against an engine metrics endpoint of the tests' own (tests/helpers/engine_metrics.py,
vLLM's counters in the exposition format): a baseline learnt and signed, quiet through restarts, gaps,
another model and a missing metric; a drop warned about, then demoted by the profile's policy; a
restarted watch reading its signed baseline back; bad input refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import pytest

from tests.helpers.steps import run_step
from tests.helpers.watch import NAME, audit_lines, copy_store, metrics_endpoint, promote_for_watch, run_watch


@pytest.fixture(scope="module")
def promoted(tiny_targets, trained_tiny, tmp_path_factory):
    _, wrapped = tiny_targets
    return promote_for_watch(tmp_path_factory.mktemp("watch"), wrapped, trained_tiny)


def test_a_baseline_is_learnt_signed_and_quiet_through_a_restart_and_a_gap(promoted, tmp_path):
    tmp = copy_store(promoted, tmp_path)
    engine = metrics_endpoint(promoted, restart_at=(14,), down=(18,))
    try:
        res = run_watch(tmp, engine.url, 36)
    finally:
        engine.close()
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "watch: baseline accept_len" in res.stdout and "0 drop(s) detected" in res.stdout, res.stdout
    lines = {r.data.tags["decision"]: r for r in audit_lines(tmp)}
    assert "watch:production:baseline" in lines and "watch:production:warn" not in lines
    reasons = " ".join(r.data.tags["reason"] for r in audit_lines(tmp))
    assert "counters went back" in reasons and "gave no reading" in reasons
    c = mlflow.MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    record = json.loads(Path(c.download_artifacts(lines["watch:production:baseline"].info.run_id,
                                                  "watch_baseline.json", str(tmp))).read_text())  # fmt: skip
    from registry.ledger.signing import verify
    from registry.ledger.trust import load_trust

    assert verify(record, "promoter", load_trust()) is None
    assert record["baseline"]["acceptance"] == pytest.approx([0.8, 0.6], abs=0.01)
    run = c.search_runs([c.get_experiment_by_name("drafterops").experiment_id],
                        filter_string="tags.`drafterops.step` = 'watch'")[0]  # fmt: skip
    assert len(c.get_metric_history(run.info.run_id, "accept_len")) >= 20
    assert {a.path for a in c.list_artifacts(run.info.run_id)} >= {"watch.png"}
    assert str(c.get_model_version_by_alias(NAME, "production").version) == "1"


def test_its_lines_reach_a_pipe_as_they_are_printed_and_sigterm_stops_it(promoted, tmp_path):
    """A service's log is a pipe (systemd, `| tee`): the baseline line arrives while the watch still runs,
    without PYTHONUNBUFFERED, and SIGTERM ends it at the next interval with its summary and exit 0."""
    import signal
    import subprocess
    import sys
    import threading
    import time

    from tests.helpers.steps import step_env

    tmp = copy_store(promoted, tmp_path)
    engine = metrics_endpoint(promoted)
    env = {k: v for k, v in step_env(tmp).items() if k != "PYTHONUNBUFFERED"}
    args = ["--model", NAME, "--endpoints", engine.url, "--profile", str(tmp / "watch.yaml"), "--interval", "0.05",
            "--max_intervals", "0", "--recertify", "no"]  # fmt: skip
    watch = subprocess.Popen([sys.executable, "-m", "steps.watch", *args], cwd=tmp, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(watch.stdout.readline, "")), daemon=True).start()
    try:
        deadline = time.monotonic() + 240
        while not any("baseline accept_len" in x for x in lines) and time.monotonic() < deadline:
            assert watch.poll() is None, "the watch ended before its baseline: " + "".join(lines)
            time.sleep(0.2)
        assert any("baseline accept_len" in x for x in lines), "no line while it runs: " + "".join(lines)
        watch.send_signal(signal.SIGTERM)
        watch.wait(timeout=120)
    finally:
        if watch.poll() is None:
            watch.kill()
        engine.close()
    time.sleep(0.5)  # the reader's last lines
    assert watch.returncode == 0 and "drop(s) detected" in "".join(lines), "".join(lines)


def test_a_drop_is_warned_about_then_demoted_by_the_profiles_policy(promoted, tmp_path):
    tmp = copy_store(promoted, tmp_path, "watch:\n  action: demote\n")
    engine = metrics_endpoint(promoted, drop_at=28, drop=0.3)
    try:
        res = run_watch(tmp, engine.url, 45)
    finally:
        engine.close()
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    assert "watch: warn:" in res.stdout and "watch: demote:" in res.stdout and "demoted" in res.stdout
    decisions = [r.data.tags["decision"] for r in audit_lines(tmp)]
    assert decisions.index("watch:production:warn") < decisions.index("watch:production:demote")
    c = mlflow.MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    assert "production" not in c.get_registered_model(NAME).aliases
    from registry.ledger.sanction import holder

    assert holder(c, NAME, "production").version is None  # a signed clearing: the guard keeps it so
    # serve.sh (export's) asks the registry at start: speculation on while v1 held production, off now
    before, after = _serve(promoted[0], promoted[0]), _serve(promoted[0], tmp)
    assert "--speculative-config" in before.stdout and "no longer holds" not in before.stderr
    assert "--speculative-config" not in after.stdout and promoted[1] not in after.stdout
    assert "k25-tiny-eagle3@production no longer holds v1: serving without speculation" in after.stderr


def _serve(export_store: Path, store: Path):
    """export's serve.sh with an interpreter that answers the registry question for real and prints the
    server command it would start instead of starting it."""
    import os
    import subprocess
    import sys

    fake = store / "fake-python"
    fake.write_text(f'#!/usr/bin/env bash\nif [ "$1" = -c ]; then exec {sys.executable} "$@"; fi\necho SERVER "$@"\n')
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake), "MLFLOW_TRACKING_URI": f"sqlite:///{store}/mlflow.db"}
    res = subprocess.run(["bash", str(export_store / "export" / "serve.sh")], env=env, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stderr
    return res


@pytest.mark.parametrize("fault", ["other_at", "missing_at"])
def test_another_model_or_a_missing_metric_is_a_finding_never_an_alarm(promoted, tmp_path, fault):
    """The counts drop exactly when the endpoint stops serving production's drafter (or stops counting by
    position): the watch says so and acts on none of it."""
    tmp = copy_store(promoted, tmp_path, "watch:\n  action: demote\n")
    engine = metrics_endpoint(promoted, drop_at=28, drop=0.3, **{fault: 28})
    try:
        res = run_watch(tmp, engine.url, 36)
    finally:
        engine.close()
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "0 drop(s) detected" in res.stdout
    said = " ".join(r.data.tags["reason"] for r in audit_lines(tmp))
    assert ("serves some-other-model" if fault == "other_at" else "reports no") in said, said
    c = mlflow.MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    assert str(c.get_model_version_by_alias(NAME, "production").version) == "1"


def test_a_restarted_watch_keeps_its_signed_baseline_and_ignores_a_planted_one(promoted, tmp_path):
    tmp = copy_store(promoted, tmp_path)
    engine = metrics_endpoint(promoted)
    try:
        first = run_watch(tmp, engine.url, 24)
        c = mlflow.MlflowClient(f"sqlite:///{tmp}/mlflow.db")
        key = next(r.data.params["drafterops.watch_baseline"] for r in audit_lines(tmp)
                   if r.data.tags["decision"] == "watch:production:baseline")  # fmt: skip
        planted = c.create_run(c.get_experiment_by_name("drafterops-audit").experiment_id)
        c.log_param(planted.info.run_id, "drafterops.watch_baseline", key)  # what finds it, copied
        junk = {"kind": "watch-baseline", "baseline": {"acceptance": [0.99, 0.99]}}
        c.log_text(planted.info.run_id, json.dumps(junk), "watch_baseline.json")
        again = run_watch(tmp, engine.url, 5, "--policy", "demote")
    finally:
        engine.close()
    assert first.returncode == 0 and "watch: baseline accept_len" in first.stdout, first.stdout + first.stderr
    assert again.returncode == 0, again.stdout + again.stderr
    assert "watch: baseline accept_len" not in again.stdout  # not learnt again: read back
    assert f"baseline run {planted.info.run_id}: unsigned; ignored" in again.stdout


def test_an_engine_version_that_changed_is_a_finding_and_recertify_runs(promoted, tmp_path, monkeypatch):
    """recertify runs as its own process; here it finds no vLLM to measure on (an interpreter that is not
    there), so it ends at once with its own exit 2 and run: the watch goes on either way."""
    monkeypatch.setenv("DRAFTEROPS_VLLM_PYTHON", str(tmp_path / "no-such-python"))
    tmp = copy_store(promoted, tmp_path)
    engine = metrics_endpoint(promoted, version_at=6)
    try:
        args = ["--model", NAME, "--endpoints", engine.url, "--profile", str(tmp / "watch.yaml"), "--interval", "0.02",
                "--max_intervals", "8"]  # fmt: skip
        res = run_step("watch", args, tmp)
    finally:
        engine.close()
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "engine 0.32.0 then, 0.33.0 now; recertify runs" in res.stdout
    c = mlflow.MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    runs = c.search_runs([c.get_experiment_by_name("drafterops").experiment_id],
                         filter_string="tags.`drafterops.step` = 'recertify'")  # fmt: skip
    assert runs, "recertify did not run"


def test_bad_input_is_one_line_and_exit_2(promoted, tmp_path):
    import http.server
    import threading

    tmp = copy_store(promoted, tmp_path)
    # a point without traffic priced below a plain step: the watch interpolates through it, so it is refused
    idle = (tmp / "watch.yaml").read_text().replace("  share: 0.5\n  plain_tps: 26", "  share: 0.0\n  plain_tps: 10")
    (tmp / "idle-point.yaml").write_text(idle.replace("  share: 0.5\n", "  share: 1.0\n", 1))

    class Page(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a) -> None:  # noqa: ANN002
            pass

        def do_GET(self) -> None:  # noqa: N802
            body = b"<html><body>not an engine</body></html>"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    page = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=page.serve_forever, daemon=True).start()
    engine = metrics_endpoint(promoted)
    cases = {
        "not a serving engine's metrics endpoint": ["--endpoints", f"http://127.0.0.1:{page.server_address[1]}"],
        "no calibration by load": ["--endpoints", engine.url, "--profile", str(tmp / "lenient.yaml")],
        "break-even <= 1 at concurrency 8: fix the calibration": [
            "--endpoints",
            engine.url,
            "--profile",
            str(tmp / "idle-point.yaml"),
        ],
        "does not answer": ["--endpoints", "http://127.0.0.1:9"],
        "http(s) base URLs": ["--endpoints", "ftp://example"],
        "no sanctioned version holds staging": ["--endpoints", engine.url, "--alias", "staging"],
        "policy action must be one of": ["--endpoints", engine.url, "--policy", "promote"],
    }
    try:
        for said, args in cases.items():
            full = ["--model", NAME, "--profile", str(tmp / "watch.yaml"), "--max_intervals", "1", *args]
            res = run_step("watch", full, tmp)
            assert res.returncode == 2, (said, res.stdout[-1000:], res.stderr[-1000:])
            assert said in res.stderr and len(res.stderr.strip().splitlines()) == 1, (said, res.stderr)
    finally:
        engine.close()
        page.shutdown()
    assert not audit_lines(tmp)  # nothing written


def test_the_figure_draws_an_interval_read_between_two_gaps():
    """A server restarting leaves gaps; the one interval read between them (often the one the watch acts on)
    must still show on the live curve: a line alone never draws a lone point, a marker does."""
    from reports.watch import WatchHistory, watch_figure

    h = WatchHistory()
    for value in (1.8, 1.82, None, None, 1.3, None):
        h.add(value, 1.65 if value else None, (0.5, 0.4) if value else ())
    h.events.append((5, "demote"))
    fig = watch_figure(h, [0.5, 0.4], 1.81, 0.2, "watch")
    live = fig.axes[0].lines[0]
    assert live.get_label() == "live accept_len"
    assert live.get_marker() not in ("None", "", None)
    assert list(live.get_xdata())[4] == 5 and live.get_ydata()[4] == 1.3
    positions = [line for line in fig.axes[1].lines if line.get_label().startswith("position")]
    assert len(positions) == 2 and all(line.get_marker() not in ("None", "", None) for line in positions)
