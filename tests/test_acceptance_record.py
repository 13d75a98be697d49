"""The verify-step histogram as the record (serving/acceptance.py): both means from it, the worked flip of
docs/metrics.md exactly, the marginal identity, depth extrapolation only for chains; speculation_profile.json
written, read back and checked; outside files that fail their own checks refused in one line (exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.errors import BadInput
from serving import speculation_profile as sp
from serving.acceptance import (
    BLOCK,
    Histograms,
    RequestHistogram,
    from_trace,
    mix_per_request,
    per_request_mean,
    ranking_flip,
)

ROOT = Path(__file__).resolve().parents[1]

# docs/metrics.md's worked flip: A scores 3.0 on two requests; B 2.0 (21 steps) and 4.2 (10 steps)
A = Histograms(4, (RequestHistogram((0, 0, 10, 0, 0), "code"), RequestHistogram((0, 0, 10, 0, 0), "chat")))
B = Histograms(4, (RequestHistogram((0, 21, 0, 0, 0), "code"), RequestHistogram((0, 0, 1, 6, 3), "chat")))


def test_the_worked_flip_gives_each_mean_exactly():
    assert A.accept_len == pytest.approx(3.0) and A.accept_len_per_request == pytest.approx(3.0)
    assert [r.accept_len for r in B.requests] == pytest.approx([2.0, 4.2])
    assert B.accept_len_per_request == pytest.approx(3.10)
    assert B.accept_len == pytest.approx(84 / 31) and round(B.accept_len, 2) == 2.71
    said = ranking_flip("A", (A.accept_len, A.accept_len_per_request), "B", (B.accept_len, B.accept_len_per_request))
    assert said.startswith("A leads on the pooled accept_len (3.000 against 2.710)") and "so A ranks first" in said
    assert ranking_flip("A", (3.0, 3.0), "B", (2.0, 2.5)) is None  # they agree: nothing to say


def test_per_prompt_counts_give_the_same_means_as_the_histograms():
    assert per_request_mean(B.per_prompt) == pytest.approx(B.accept_len_per_request)
    assert mix_per_request([(0.5, A.per_prompt[:1]), (0.5, A.per_prompt[1:])]) == pytest.approx(3.0)
    assert per_request_mean([(5, 0)]) == 1.0  # a request with no verify step says nothing


def test_rates_follow_from_the_histogram_and_the_marginals_sum_to_the_pooled_mean():
    h = Histograms(3, (from_trace([0, 1, 3, 3, 2, 0], 3), from_trace([1, 1], 3)))
    assert h.total == (2, 3, 1, 2) and h.verify_steps == 8 and h.accepted == 11
    assert h.marginal == pytest.approx([6 / 8, 3 / 8, 2 / 8])
    assert h.conditional == pytest.approx([6 / 8, 3 / 6, 2 / 3])
    assert 1 + sum(h.marginal) == pytest.approx(h.accept_len) == pytest.approx(1 + 11 / 8)
    assert h.acceptance_rate == pytest.approx(11 / 24)
    assert h.per_prompt == [(6 + 9, 6), (2 + 2, 2)]
    by_k = h.accept_len_by_k()
    assert by_k[3] == (pytest.approx(h.accept_len), "measured")
    assert by_k[1] == (pytest.approx(1.75), "extrapolated")
    block = Histograms(3, h.requests, BLOCK)
    assert list(block.accept_len_by_k()) == [3]  # a block drafter re-plans its block: never extrapolated
    with pytest.raises(ValueError, match="accepted 4 drafts at depth 3"):
        from_trace([4], 3)


def test_the_histogram_round_trips_and_refuses_a_damaged_one():
    assert Histograms.from_dict(json.loads(json.dumps(B.to_dict()))) == B
    for bad, field in [({"k": 0, "requests": []}, "'k'"), ({"k": 2, "requests": [{"steps": [1]}]}, "k \\+ 1"),
                       ({"k": 2, "requests": [{"steps": [1, "x", 0]}]}, "requests\\[0\\]"),
                       ({"k": 2, "shape": "tree", "requests": []}, "'shape'")]:  # fmt: skip
        with pytest.raises(ValueError, match=field):
            Histograms.from_dict(bad)


def test_the_profile_round_trips_and_passes_its_own_checks(tmp_path):
    profile = sp.build(B, "eagle3", {"id": "k2.5-mini-eagle3/v2"}, {"id": "k2.5-mini"}, {"engine": "in-process"})
    checks = profile["validation"]
    assert checks["mean_consistency"]["passed"] and checks["marginal_monotonicity"]["passed"]
    assert profile["mean_accept_length"] == pytest.approx(B.accept_len, abs=1e-6)
    assert profile["mean_accept_length_per_request"] == pytest.approx(3.10, abs=1e-6)
    assert profile["acceptance_length_histogram"] == {"1": 0, "2": 21, "3": 1, "4": 6, "5": 3}
    assert set(profile["per_category"]) == {"code", "chat"}
    assert profile["accept_length_by_k"]["4"] == pytest.approx(B.accept_len, abs=1e-6)
    back = sp.read_external(sp.write(profile, tmp_path))
    assert back.accept_len == pytest.approx(B.accept_len, abs=1e-6) and back.k == 4
    assert back.accept_len_per_request == pytest.approx(3.10, abs=1e-6) and back.method == "eagle3"
    assert back.marginal == pytest.approx(B.marginal, abs=1e-6)


def test_a_speculators_acceptance_csv_is_read_as_pooled_marginals(tmp_path):
    path = tmp_path / "acceptance.csv"
    path.write_text("subset,num_drafts,num_draft_tokens,num_accepted_tokens,acceptance_length,acceptance_at_pos_0,"
                    "acceptance_at_pos_1,acceptance_at_pos_2\nHumanEval,100,300,150,2.5,0.8,0.5,0.2\n"
                    "math,50,150,50,2.0,0.6,0.3,0.1\n")  # fmt: skip
    ext = sp.read_external(path)
    assert ext.accept_len == pytest.approx(1 + 200 / 150) and ext.accept_len_per_request is None
    assert ext.marginal == pytest.approx([(80 + 30) / 150, (50 + 15) / 150, (20 + 5) / 150])
    assert ext.per_category == {"HumanEval": 2.5, "math": 2.0} and ext.k == 3


def _good_profile() -> dict:
    return sp.build(B, "eagle3", {"id": "d"}, {"id": "t"}, {})


def _with(**changes) -> str:
    p = _good_profile()
    for key, value in changes.items():
        p[key] = value
    return json.dumps(p)


CSV_HEAD = (
    "subset,num_drafts,num_draft_tokens,num_accepted_tokens,acceptance_length,acceptance_at_pos_0,acceptance_at_pos_1\n"
)
MALFORMED = [
    ("p1.json", "{not json", "not JSON"),
    ("p2.json", "[1, 2]", "not a speculation profile"),
    ("p3.json", _with(schema_version="2.0"), "'schema_version'"),
    ("p4.json", _with(measured=False), "'measured'"),
    ("p5.json", _with(num_speculative_tokens=0), "'num_speculative_tokens'"),
    ("p6.json", _with(marginal_accept_rates=[0.9, 0.5, 0.7, 0.1]), "rises at position 2"),
    ("p7.json", _with(mean_accept_length=3.5), "own consistency check"),
    ("p8.json", _with(marginal_accept_rates=[0.9, "x", 0.1, 0.0]), "marginal_accept_rates\\[1\\]"),
    ("p9.json", _with(acceptance_length_histogram={"1": 5, "9": 1}), "length '9'"),
    ("p10.json", _with(mean_accept_length=float("nan")), "'mean_accept_length'"),
    ("a1.csv", "a,b\n1,2\n", "no column 'num_drafts'"),
    ("a2.csv", CSV_HEAD + "x,10,20,5,1.8,0.4,0.1\n", "line 2: 'acceptance_length' 1.8 is not"),
    ("a3.csv", CSV_HEAD + "x,10,20,10,2.0,0.4,0.6\n", "rises at position 1"),
    ("a4.csv", CSV_HEAD + "x,10,20,30,4.0,1.0,1.0\n", "not possible"),
    ("a5.csv", CSV_HEAD + "x,0,0,0,1.0,0,0\n", "no verify steps"),
    ("a6.csv", CSV_HEAD + "x,10,20,abc,2.0,0.6,0.4\n", "'num_accepted_tokens' is 'abc'"),
    ("a7.csv", "", "no rows"),
]


@pytest.mark.parametrize(("name", "text", "said"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_each_malformed_outside_file_is_refused_naming_file_and_field(tmp_path, name, text, said):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(BadInput, match=said) as exc:
        sp.read_external(path)
    line = str(exc.value)
    assert line.startswith(str(path)) and "\n" not in line


def test_compare_refuses_a_bad_external_file_with_one_line_and_exit_2(tmp_path):
    path = tmp_path / "speculation_profile.json"
    path.write_text(_with(mean_accept_length=3.5))
    env_home = tmp_path / "home"
    done = subprocess.run([sys.executable, "-m", "steps.compare", "--external", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(env_home),
                               "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"})  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and "consistency" in lines[0], done.stderr
    assert not (tmp_path / "mlflow.db").exists()  # refused before anything was written


def _record(histograms: list[list[int]], per_prompt: list[tuple[int, int]], acc_pos: list[float]):
    from registry.ledger.evidence.record import ClassCounts, EvidenceRecord

    values = {"baseline_tps": 20.0, "verify_ms": 30.0, "draft_step_ms": 2.0}
    cls = ClassCounts("all", 1.0, "0" * 64, [f"p{i}" for i in range(len(per_prompt))], per_prompt, [], histograms)
    return EvidenceRecord("m", "1", {}, "w", "prof", "d", values, 2, "t", "td", 0.0, 16, "in-process", "x", [cls],
                          acc_pos=acc_pos)  # fmt: skip


def test_a_record_whose_figures_are_not_its_histograms_own_is_impossible():
    from registry.ledger.evidence.verify import sanity

    h = Histograms(2, (from_trace([2, 1, 0, 2], 2, "all"), from_trace([1, 1], 2, "all")))
    steps = [list(r.steps) for r in h.requests]
    rec = _record(steps, h.per_prompt, h.conditional)
    assert sanity(rec) == [] and rec.histograms() == h
    assert rec.payload()["figures"]["accept_len_per_request"] == pytest.approx(h.accept_len_per_request)
    inflated = _record(steps, [(h.per_prompt[0][0] + 2, h.per_prompt[0][1]), h.per_prompt[1]], h.conditional)
    assert sanity(inflated) == ["class all prompt 0: histogram [1, 1, 2] does not give its counts (11, 4)"]
    assert "not the histograms' own" in sanity(_record(steps, h.per_prompt, [0.9, 0.9]))[0]
    assert "2 histograms for 1 prompts" in sanity(_record(steps, h.per_prompt[:1], h.conditional))[0]
    assert sanity(_record([], h.per_prompt, [0.9, 0.9])) == []  # a record from before histograms: nothing to check


def test_a_servers_histograms_are_held_to_its_counters_over_the_same_requests():
    from engines.vllm import _histogram, histogram_mismatch

    hs = [(1, 2, 1), (0, 1, 3)]  # k = 2: request 0 has 4 steps, 4 accepted; request 1 has 4 steps, 7 accepted
    per_prompt = [(8, 4), (11, 4)]
    at = [sum(n for h in hs for j, n in enumerate(h) if j > p) for p in range(2)]
    assert histogram_mismatch(hs, per_prompt, at, 2) == ""
    assert "request 1: 4 steps and 7 accepted" in histogram_mismatch(hs, [(8, 4), (10, 4)], at, 2)
    assert "position 1" in histogram_mismatch(hs, per_prompt, [at[0], at[1] + 1], 2)
    assert "request 0: histogram None" in histogram_mismatch([None, hs[1]], per_prompt, at, 2)
    chunk = {"choices": [], "metrics": {"speculative_decoding": {"acceptance_histogram": [3, 1, 0]}}}
    assert _histogram(chunk) == (3, 1, 0)
    for bad in ({"metrics": None}, {"metrics": {"speculative_decoding": {"acceptance_histogram": [1, -1]}}},
                {"metrics": {"speculative_decoding": {"acceptance_histogram": "x"}}}, []):  # fmt: skip
        assert _histogram(bad) is None
