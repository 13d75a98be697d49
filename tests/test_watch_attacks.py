"""The production watch and the sanction chain under glitches, lies and attackers: what an exporter, a proxy,
an operator's routine or someone with store access alone can send it, each case once. Nothing here may demote
production on a glitch, blind the watch, crash it, or stop a real demotion.

Most cases are the watch's reading rules (pipeline/readings.py) on readings made from exposition text; those
that need the store, the chain or the step run the watch as a user does against an engine metrics endpoint
of the tests' own (tests/helpers/engine_metrics.py)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from engines import endpoint, exposition
from pipeline.readings import Watched, settled_version, take
from tests.helpers.checks import one_line_exit_2
from tests.helpers.engine_metrics import EngineMetrics, Script
from tests.helpers.promotion import evaluate, register_gated
from tests.helpers.steps import run_step
from tests.helpers.watch import (
    NAME,
    audit_lines,
    client,
    copy_store,
    metrics_endpoint,
    promote_for_watch,
    run_watch,
    watch_against,
)

DEMOTE = "watch:\n  action: demote\n"
K = 2
SERVED = ("target", "drafterops-0123456789abcdef")


@pytest.fixture(scope="module")
def promoted(tiny_targets, trained_tiny, tmp_path_factory):
    _, wrapped = tiny_targets
    return promote_for_watch(tmp_path_factory.mktemp("watch-attacks"), wrapped, trained_tiny)


def reasons(tmp: Path) -> str:
    return " ".join(r.data.tags["reason"] for r in audit_lines(tmp))


def production(tmp: Path) -> str | None:
    from registry.ledger.sanction import holder

    return holder(client(tmp), NAME, "production").version


# ---- readings: each is checked before it counts (pipeline/readings.py, engines/exposition.py) ----


def vllm_text(drafts: float, per_pos: list[float], tokens: float | None = None, accepted: float | None = None,
              model: str = "target") -> str:  # fmt: skip
    """vLLM's speculative counters as it exposes them, values given as they are (a glitch included)."""
    lab = f'engine="0",model_name="{model}"'
    rows = [
        "# TYPE vllm:spec_decode_num_drafts counter", f"vllm:spec_decode_num_drafts_total{{{lab}}} {drafts!r}",
        "# TYPE vllm:spec_decode_num_draft_tokens counter",
        f"vllm:spec_decode_num_draft_tokens_total{{{lab}}} {tokens if tokens is not None else drafts * K!r}",
        "# TYPE vllm:spec_decode_num_accepted_tokens counter",
        f"vllm:spec_decode_num_accepted_tokens_total{{{lab}}} {accepted if accepted is not None else sum(per_pos)!r}",
        "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter",
        *(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{lab},position="{i}"}} {a!r}'
          for i, a in enumerate(per_pos)),
        "# TYPE vllm:num_requests_running gauge", f"vllm:num_requests_running{{{lab}}} 2.0", "",
    ]  # fmt: skip
    return "\n".join(rows)


def reading(text: str, served: tuple[str, ...] = SERVED, version: str = "0.32.0") -> endpoint.Reading:
    return endpoint.Reading(exposition.parse(text, served), served, version)


def stream(w: Watched, texts: list[str]) -> list:
    return [take(w, reading(t), SERVED[1], K) for t in texts]


def good(n: int) -> str:
    """The n-th cumulative reading of a steady server: 1000 drafts a read, positions accepting 800 then 600."""
    return vllm_text(1000.0 * n, [800.0 * n, 600.0 * n])


@pytest.mark.parametrize(
    ("glitch", "said"),
    [
        (vllm_text(-1.0, [1600.0, 1200.0]), "a negative count"),  # num_drafts read as -1 once
        (vllm_text(2000.0 + 1e15, [1600.0, 1200.0], tokens=4000.0), "draft tokens outside"),  # a jump of 1e15
        (vllm_text(float("nan"), [1600.0, 1200.0]), "not a finite number"),  # NaN while learning the baseline
        (vllm_text(float("inf"), [1600.0, 1200.0]), "not a finite number"),  # +Inf once
        (vllm_text(2000.0, [1600.0, 1200.0], accepted=1e12, tokens=4000.0), "more accepted draft tokens"),
        (vllm_text(2000.0, [1200.0, 1600.0]), "a position accepting more"),  # positions must not increase
        (vllm_text(2000.0, [1600.0, 1200.0], tokens=2000.0 * 5), "draft tokens outside"),  # not drafts x k
    ],
)
def test_one_glitched_reading_is_a_finding_and_costs_at_most_two_intervals(glitch, said):
    """The glitch is left out and never becomes a base: the reading after it starts a new one, and the
    intervals after that count as the steady server's, each once the next reading confirms it (on main the
    glitch became the next interval's base)."""
    w = Watched("http://e")
    got = stream(w, [good(1), glitch, good(3), good(4), good(5), good(6)])
    assert got[1].counts is None and said in got[1].finding[1], got[1]
    assert got[2].counts is None and got[2].finding is None  # the base again
    assert got[3].counts is None  # the interval 3 -> 4, until reading 5 confirms it
    for g in got[4:]:
        assert g.counts is not None and g.counts.drafts == 1000 and g.counts.per_pos == (800, 600)


def test_a_possible_but_false_reading_counts_for_nothing():
    """num_drafts and num_draft_tokens raised together once, by more than an interval's worth: each count is
    possible, and so is the interval to it (it reads as acceptance falling by more than half), so the reading
    passes its checks; the next reading's counters went back from it, and neither interval around it counts
    (found by the attack round: without the confirming reading it alarmed at once)."""
    w = Watched("http://e")
    raised = vllm_text(4500.0, [2400.0, 1800.0], tokens=9000.0)  # reading 3, its drafts 1500 too many
    got = stream(w, [good(1), good(2), raised, good(4), good(5), good(6)])
    assert got[2].counts is not None and got[2].counts.drafts == 1000  # 1 -> 2, confirmed by the raised reading
    assert got[3].counts is None and "counters went back" in got[3].finding[1]  # 2 -> 3 never counts
    assert got[4].counts is None and got[5].counts.drafts == 1000  # 4 -> 5 counts once 6 confirms it


def test_an_interval_whose_differences_are_impossible_is_left_out():
    """Each reading alone is possible; what happened between them is not (a position gained more than the
    drafts did): left out, counting starts again."""
    w = Watched("http://e")
    got = stream(w, [vllm_text(1000.0, [100.0, 50.0]), vllm_text(1100.0, [900.0, 60.0]), good(2), good(3), good(4)])
    assert got[1].counts is None and "more drafts accepted at the first position" in got[1].finding[1]
    assert got[2].counts is None and got[3].counts is None and got[4].counts.per_pos == (800, 600)


def test_a_reading_without_positions_never_fixes_the_depth():
    """A start-up reading without the per-position family is a finding; the served depth, not one reading,
    says how many positions a reading must count (on main one such reading fixed the positions at 0)."""
    w = Watched("http://e")
    bare = "\n".join(line for line in good(1).splitlines() if "per_pos" not in line) + "\n"
    got = stream(w, [bare, good(2), good(3), good(4)])
    assert "for 2 positions (it counts 0)" in got[0].finding[1]
    assert got[3].counts.per_pos == (800, 600)
    deeper = vllm_text(5000.0, [4000.0, 3000.0, 2000.0], tokens=5000.0 * 3)  # restarted at depth 3
    assert "for 2 positions (it counts 3)" in take(w, reading(deeper), SERVED[1], K).finding[1]


def test_counts_labelled_for_a_model_the_server_does_not_serve_are_not_its_counts():
    """/v1/models lists production's digest, but the counters are labelled for another model: they are not
    counted (on main they were, and demoted on)."""
    w = Watched("http://e")
    got = stream(w, [vllm_text(1000.0, [800.0, 600.0], model="someone-else")] * 2)
    assert all(g.counts is None for g in got) and "reports no vllm:spec_decode_num_drafts" in got[0].finding[1]


@pytest.mark.parametrize(
    "text",
    [
        good(1).replace('position="0"', 'position="x"'),  # a label that is no number
        good(1)[:180],  # a body cut short
        "vllm:spec_decode_num_drafts_total{ 12\n",  # not the format at all
    ],
)
def test_malformed_metrics_are_a_finding_never_counted(text):
    """Refused as no exposition, or read as one that lacks what the watch needs: never counts, never raises."""
    w = Watched("http://e")
    take(w, reading(good(1)), SERVED[1], K)
    try:
        bad = reading(text)
    except exposition.NotExposition:
        return
    got = take(w, bad, SERVED[1], K)
    assert got.counts is None and got.finding is not None, got


@pytest.mark.parametrize("data", [["a", "b"], 7, {"id": SERVED[1]}, [None]])
def test_a_model_list_of_another_shape_is_malformed(data):
    with pytest.raises(endpoint.Malformed, match="not a list of models"):
        endpoint._names(data, "http://e/v1/models")


def test_an_engine_version_is_acted_on_only_once_it_holds():
    """A rolling upgrade behind one URL flaps between two versions: nothing settles, recertify never runs; a
    version that holds for three readings settles once."""
    w = Watched("http://e")
    flapping = [settled_version(w, v) for v in ["0.32.0", "0.33.0"] * 12 + ["0.32.0"]]
    assert not any(flapping) and w.version == "0.32.0"
    held = [settled_version(w, "0.33.0") for _ in range(5)]
    assert held == [None, None, "0.33.0", None, None]


def test_a_dripping_answer_is_cut_at_the_deadline():
    """One byte every 0.2 s: each socket read returns in time, the whole answer never does (on main the
    watch waited 60 s for one such /metrics)."""
    engine = EngineMetrics(Script(served=SERVED, faults={2: {"drip": 0.2}}))
    try:
        endpoint.read(engine.url)  # read 1: whole
        start = time.monotonic()
        with pytest.raises(endpoint.TooSlow, match="no whole reading within 1 s"):
            endpoint.read(engine.url, timeout=1.0)
        assert time.monotonic() - start < 10  # cut at 1 s; the bound only says it did not wait for the body
    finally:
        engine.close()


def test_a_dripping_webhook_is_cut_at_the_deadline(monkeypatch, capsys):
    import http.server
    import threading

    from pipeline import watching
    from registry.ledger.watch import Policy

    class Drip(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a) -> None:  # noqa: ANN002
            pass

        def do_POST(self) -> None:  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            for _ in range(100):
                try:
                    self.wfile.write(b"x")
                    self.wfile.flush()
                except OSError:
                    return
                time.sleep(0.2)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Drip)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(watching, "NOTIFY_DEADLINE_S", 1.0)
    state = watching.State(NAME, "production", "1", SERVED[1], K,
                           Policy(webhook=f"http://127.0.0.1:{server.server_address[1]}/hook"), None, [])  # fmt: skip
    try:
        start = time.monotonic()
        watching.notify(state, "demote", "a test")
        assert time.monotonic() - start < 10  # not the 20 s the drip would take
    finally:
        server.shutdown()
    assert "the policy's webhook failed: no whole answer within 1 s" in capsys.readouterr().out


# ---- signatures, keys and the trust file ----


def test_a_record_dated_in_the_future_is_refused():
    """A clock running ahead dates a record after a retirement made now: it must count for nothing, not
    outlive the retirement (on main it was accepted)."""
    from registry.ledger import signing
    from registry.ledger.trust import load_trust

    ahead = signing.sign({"kind": "sanction", "at": time.time() + 3600})
    assert "dated 3600 s after now" in signing.verify(ahead, "promoter", load_trust())
    now = signing.sign({"kind": "sanction", "at": time.time() + 60})  # within the skew clocks may differ by
    assert signing.verify(now, "promoter", load_trust()) is None


def _trust_file(tmp: Path, retired: str = "") -> Path:
    from registry.ledger import signing

    key = signing.load_key().public_text
    entry = f'{{key: "{key}", retired: "{retired}"}}' if retired else key
    path = tmp / "trust.yaml"
    path.write_text(f"trusted_evaluators:\n  me: {key}\ntrusted_promoters:\n  me: {entry}\n")
    return path


def test_keys_retire_refuses_a_time_in_the_future_and_a_trust_file_that_says_one(tmp_path):
    """`keys retire --at 2100-01-01` left the key signing for 74 years as if retired (on main it was
    accepted, and the 'retired' key's new sanction moved production)."""
    from tests.helpers.steps import run_module, step_env

    trust = _trust_file(tmp_path)
    before = trust.read_text()
    env = step_env(tmp_path, DRAFTEROPS_TRUST_FILE=str(trust))
    res = run_module("steps.keys", ["retire", "me", "--at", "2100-01-01"], tmp_path, env)
    one_line_exit_2(res, "--at 2100-01-01: in the future")
    assert trust.read_text() == before
    ahead = _trust_file(tmp_path, retired="2100-01-01")
    res = run_module("steps.keys", ["show"], tmp_path, step_env(tmp_path, DRAFTEROPS_TRUST_FILE=str(ahead)))
    assert res.returncode == 0  # showing a key reads no trust file
    os.environ["DRAFTEROPS_TRUST_FILE"] = str(ahead)
    try:
        from common.errors import BadInput
        from registry.ledger.trust import load_trust

        with pytest.raises(BadInput, match="retired: 2100-01-01 is in the future"):
            load_trust()
    finally:
        os.environ.pop("DRAFTEROPS_TRUST_FILE")


def test_keys_retire_writes_through_a_linked_trust_file(tmp_path):
    """The team's shared trust file, linked into place: retiring writes the shared file, and the link stays
    a link (on main it was replaced by a private copy the guard never reads)."""
    from tests.helpers.steps import run_module, step_env

    shared = tmp_path / "shared"
    shared.mkdir()
    target = _trust_file(shared)
    link = tmp_path / "trust.yaml"
    link.symlink_to(target)
    res = run_module("steps.keys", ["retire", "me"], tmp_path, step_env(tmp_path, DRAFTEROPS_TRUST_FILE=str(link)))
    assert res.returncode == 0, res.stderr
    assert link.is_symlink() and link.resolve() == target.resolve()
    assert "retired:" in target.read_text()


def test_the_docs_watch_example_is_a_policy():
    """docs/watch.md's `watch:` section, as written there (YAML reads 1e6 as a string), loads and checks."""
    import yaml

    from registry.ledger.watch import Policy

    text = (Path(__file__).resolve().parents[1] / "docs" / "watch.md").read_text()
    block = text.split("```yaml\n", 1)[1].split("```", 1)[0] if "```yaml\n" in text else ""
    raw = yaml.safe_load(block[block.index("watch:") :])["watch"]
    policy = Policy.read(raw, "docs/watch.md")
    assert policy.false_alarm_intervals == 1e6 and policy.action == "demote"


# ---- the chain: claims and clearings ----


def test_planted_unsigned_claims_block_no_alias_move(promoted, tmp_path):
    """Someone with store access alone creates empty experiments named for claim attempts 1, 3, 5, 7 after
    the chain's head: they count for nothing, and the watch still demotes (on main it tried 26 times and
    said, untruly, that another decision had moved the alias)."""
    from registry.ledger import sanction, succession

    tmp = copy_store(promoted, tmp_path, DEMOTE)
    c = client(tmp)
    rm, head = c.get_registered_model(NAME), sanction.holder(c, NAME, "production").head
    for attempt in (1, 3, 5, 7):
        c.create_experiment(succession.claim_name(rm, "production", head, attempt))
    res = watch_against(promoted, tmp, 60, drop_at=28, drop=0.3)
    assert res.returncode == 1 and "watch: demote:" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]
    assert "moved by another decision" not in res.stdout and production(tmp) is None


@pytest.fixture(scope="module")
def demoted(promoted, tmp_path_factory):
    """A real 30% drop, warned about and then demoted: the store, the watch's output."""
    tmp = copy_store(promoted, tmp_path_factory.mktemp("demoted"), DEMOTE)
    res = watch_against(promoted, tmp, 60, drop_at=28, drop=0.3)
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    return tmp, res


def test_a_warning_and_a_demotion_never_share_an_interval(demoted):
    """The demotion needs a detection from intervals after the warning: every monitor starts again then (on
    main two monitors crossing in one interval made the warning and the demotion at once)."""
    tmp, _ = demoted
    c = client(tmp)
    acted = {}
    for run in audit_lines(tmp):
        if run.data.tags["decision"] in ("watch:production:warn", "watch:production:demote"):
            record = json.loads(Path(c.download_artifacts(run.info.run_id, "watch_action.json", str(tmp))).read_text())
            acted[record["action"]] = record["detail"]["interval"]
    assert acted["warn"] < acted["demote"], acted


def test_an_overwritten_clearing_never_brings_the_demoted_drafter_back(demoted):
    """The clearing's sanction.json overwritten with {}: the link is read from the signed copy its run keeps
    as a param, and the alias stays cleared (on main reconcile put the demoted drafter back)."""
    from registry.ledger import sanction
    from registry.ledger.reconcile import reconcile_model

    tmp, _ = demoted
    c = client(tmp)
    runs = [r for r in audit_lines(tmp)]  # noqa: C416 (the watch's lines; the clearing is an alias line)
    exp = c.get_experiment_by_name("drafterops-audit").experiment_id
    clearing = c.search_runs([exp], filter_string="tags.decision = 'alias:production'",
                             order_by=["attributes.start_time DESC"])[0]  # fmt: skip
    assert runs and sanction.read(c, clearing.info.run_id)["version"] is None
    c.log_text(clearing.info.run_id, "{}", sanction.SANCTION_FILE)
    held = sanction.holder(c, NAME, "production")
    assert held.version is None and any("signed copy" in f for f in held.findings), held
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp}/mlflow.db"
    try:
        reconcile_model(c, NAME)
    finally:
        os.environ.pop("MLFLOW_TRACKING_URI")
    assert "production" not in c.get_registered_model(NAME).aliases


# ---- the watch's records: baselines bound like sanctions, the audit experiment ----


def test_a_renamed_audit_experiment_hides_no_baseline(promoted, tmp_path):
    """On main the baseline was looked up under the audit experiment's name only: renamed, the watch relearnt
    on traffic that may already have dropped."""
    tmp = copy_store(promoted, tmp_path)
    engine = metrics_endpoint(promoted)
    try:
        first = run_watch(tmp, engine.url, 24)
        c = client(tmp)
        c.rename_experiment(c.get_experiment_by_name("drafterops-audit").experiment_id, "audit-old")
        again = run_watch(tmp, engine.url, 3)
    finally:
        engine.close()
    assert "watch: baseline accept_len" in first.stdout, first.stdout + first.stderr
    assert again.returncode == 0, again.stdout + again.stderr
    c = client(tmp)
    runs = c.search_runs(
        [c.get_experiment_by_name("drafterops").experiment_id],
        filter_string="tags.`drafterops.step` = 'watch'",
        order_by=["attributes.start_time DESC"],
    )
    watched = c.get_metric_history(runs[0].info.run_id, "baseline_accept_len")  # the monitor ran from interval 1
    assert len(watched) == 3, watched  # fmt: skip


def test_an_overwritten_baseline_is_read_from_its_signed_copy(promoted, tmp_path):
    """A store-only attacker overwrites the signed watch_baseline.json with {} while production's traffic has
    really dropped, then the watch restarts: it reads the baseline from the signed copy its run keeps as a
    param and demotes (found by the attack round: it relearnt the dropped level as its baseline)."""
    tmp = copy_store(promoted, tmp_path, DEMOTE)
    steady = metrics_endpoint(promoted)
    try:
        first = run_watch(tmp, steady.url, 24)
    finally:
        steady.close()
    assert "watch: baseline accept_len" in first.stdout, first.stdout + first.stderr
    run = next(r for r in audit_lines(tmp) if r.data.tags["decision"] == "watch:production:baseline")
    client(tmp).log_text(run.info.run_id, "{}", "watch_baseline.json")
    dropped = metrics_endpoint(promoted, acceptance=(0.56, 0.42))  # 30% below what the baseline learnt
    try:
        again = run_watch(tmp, dropped.url, 40)
    finally:
        dropped.close()
    assert again.returncode == 1 and "watch: baseline accept_len" not in again.stdout, again.stdout + again.stderr
    assert "read from the signed copy" in again.stdout and production(tmp) is None


def test_a_deleted_audit_experiment_is_restored_and_the_watch_still_demotes(promoted, tmp_path):
    """On main the watch's first warning wrote into the deleted experiment and exited 3: it never demoted."""
    tmp = copy_store(promoted, tmp_path, DEMOTE)
    c = client(tmp)
    c.delete_experiment(c.get_experiment_by_name("drafterops-audit").experiment_id)
    res = watch_against(promoted, tmp, 60, drop_at=28, drop=0.3)
    assert res.returncode == 1 and "watch: demote:" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]
    assert "had been deleted; restored" in res.stderr and production(tmp) is None


def test_a_model_recreated_under_the_old_name_learns_its_own_baseline(promoted, tiny_targets, trained_tiny, tmp_path):
    """The model deleted and registered again under its name, the same drafter promoted: its baseline is its
    own (on main it inherited the old model's, keyed by name, alias and version alone, and was demoted at
    interval 1 on traffic of its own)."""
    from registry.ledger.sanction import holder

    _, wrapped = tiny_targets
    tmp = copy_store(promoted, tmp_path, DEMOTE)
    high = metrics_endpoint(promoted, acceptance=(0.9, 0.8))
    try:
        first = run_watch(tmp, high.url, 24)
    finally:
        high.close()
    assert "watch: baseline accept_len" in first.stdout, first.stdout + first.stderr
    c = client(tmp)
    c.delete_registered_model(NAME)
    register_gated(tmp, wrapped, trained_tiny, (1,))
    evaluate(tmp, f"models:/{NAME}/1", wrapped, tmp / "lenient.yaml")
    res = run_step("promote", ["--model", f"models:/{NAME}/1", "--profile", str(tmp / "lenient.yaml")], tmp)
    assert res.returncode == 0 and holder(c, NAME, "production").version == "1", res.stdout[-2000:] + res.stderr
    low = metrics_endpoint(promoted, acceptance=(0.6, 0.4))  # its own, steady traffic
    try:
        again = run_watch(tmp, low.url, 30)
    finally:
        low.close()
    assert again.returncode == 0 and "0 drop(s) detected" in again.stdout, again.stdout[-3000:] + again.stderr
    assert "watch: baseline accept_len" in again.stdout  # learnt anew


# ---- endpoints that lie, and the watch's own input ----


def test_an_endpoint_reporting_impossible_counts_does_not_mask_a_drop_on_another(promoted, tmp_path):
    """Two endpoints: the first drops 30%, the second reports more accepted drafts than drafts at every read.
    The second is left out with a finding; the first's drop is demoted (on main the pooled counts hid it)."""
    tmp = copy_store(promoted, tmp_path, DEMOTE)
    honest = metrics_endpoint(promoted, drop_at=28, drop=0.3)
    liar = metrics_endpoint(promoted, faults={n: {"value": {"vllm:spec_decode_num_accepted_tokens_per_pos": "1e9"}}
                                              for n in range(1, 200)})  # fmt: skip
    try:
        res = run_watch(tmp, f"{honest.url},{liar.url}", 60)
    finally:
        honest.close()
        liar.close()
    assert res.returncode == 1 and production(tmp) is None, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"{liar.url} reports more drafts accepted at the first position" in reasons(tmp)


def test_glitches_on_a_served_stream_demote_nothing_and_the_baseline_still_settles(promoted, tmp_path):
    """Through the step: -1 once and NaN once while the baseline is learnt, the per-position family missing
    once, a 1e15 jump and +Inf once after it, at the demote policy with no drop: no action (on main the NaN
    crashed the watch, the missing family kept the baseline from settling, and -1 or 1e15 demoted)."""
    tmp = copy_store(promoted, tmp_path, DEMOTE)
    drafts = "vllm:spec_decode_num_drafts"
    faults = {4: {"value": {drafts: "-1"}}, 7: {"value": {drafts: "NaN"}}, 10: {"leave_out": "per_pos"},
              30: {"jump": {drafts: 1e15}}, 34: {"value": {drafts: "+Inf"}}}  # fmt: skip
    res = watch_against(promoted, tmp, 40, faults=faults)
    assert res.returncode == 0 and "0 drop(s) detected" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]
    assert "watch: baseline accept_len" in res.stdout and production(tmp) == "1"
    said = reasons(tmp)
    for phrase in ("a negative count", "not a finite number", "draft tokens outside", "reports no"):
        assert phrase in said, (phrase, said)


def test_malformed_answers_are_findings_never_exit_3(promoted, tmp_path):
    """One answer of the wrong shape every other read: a position label that is no number, a body cut short, a
    model list of strings, a number, an object, [null] (on main each ended the watch, exit 3)."""
    faults = [{"position": "x"}, {"cut": 300}, {"models": ["a", "b"]}, {"models": 7}, {"models": {"id": "x"}},
              {"models": [None]}]  # fmt: skip
    tmp = copy_store(promoted, tmp_path, DEMOTE)
    res = watch_against(promoted, tmp, 18, faults={4 + 2 * i: fault for i, fault in enumerate(faults)})
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stdout[-3000:] + res.stderr[-3000:]
    assert "18 intervals" in res.stdout and "watch: finding:" in res.stdout and production(tmp) == "1"
    assert "not a list of models" in reasons(tmp) and "position 'x'" in reasons(tmp), reasons(tmp)


def test_a_flapping_engine_version_runs_no_recertify(promoted, tmp_path):
    """A rolling upgrade behind one URL answers two versions in turn: on main recertify ran, synchronously, at
    every interval (the watch blind meanwhile); now it runs for a version that holds, never for a flap."""
    tmp = copy_store(promoted, tmp_path)
    res = watch_against(
        promoted,
        tmp,
        12,
        "--recertify",
        "yes",
        env={"DRAFTEROPS_VLLM_PYTHON": str(tmp / "no-python")},
        flap_versions=("0.32.0", "0.33.0"),
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    c = client(tmp)
    runs = c.search_runs([e.experiment_id for e in c.search_experiments()],
                         filter_string="tags.`drafterops.step` = 'recertify'")  # fmt: skip
    assert not runs and "recertify runs" not in res.stdout


def test_a_key_retired_while_the_watch_runs_signs_nothing_more(promoted, tmp_path):
    """The operator's command retires the watch's own key at its first warning: the demotion that follows
    must not be signed with it (on main the watch kept signing, and the guard then restored the drafter its
    invalid clearing had demoted). The watch says so and stops, exit 2; production stays where promote put it."""
    trust = _trust_file(tmp_path)
    retire = f"{sys.executable} -m steps.keys retire me"
    tmp = copy_store(promoted, tmp_path, f"watch:\n  action: demote\n  command: {retire}\n")
    res = watch_against(promoted, tmp, 60, env={"DRAFTEROPS_TRUST_FILE": str(trust)}, drop_at=28, drop=0.3)
    one_line_exit_2(res, "is not a trusted promoter in service", "the watch stops signing")
    assert "watch: warn:" in res.stdout and "watch: demote:" not in res.stdout
    assert "retired:" in trust.read_text() and production(tmp) == "1"


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--endpoints", "http://127.0.0.1:abc"], "is not a URL"),
        (["--endpoints", "http://[::1"], "is not a URL"),
        (["--model", "no-such-model", "--endpoints", "http://127.0.0.1:9"], "no registered model of that name"),
    ],
)
def test_bad_startup_input_is_one_line_and_exit_2(promoted, tmp_path, args, said):
    tmp = copy_store(promoted, tmp_path)
    full = ["--model", NAME, "--profile", str(tmp / "watch.yaml"), "--max_intervals", "1", *args]
    one_line_exit_2(run_step("watch", full, tmp), said)
    assert not audit_lines(tmp)
