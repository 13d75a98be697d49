"""The ways around the promotion gate found by trying it as an attacker, replayed: each row is an
attack with the refusal it must meet, and each version's honest evaluation on the profile's pinned
prompts is the positive control. `python -m tests.test_evidence_attacks` replays the table on a fresh
store and prints it (the script the maintainers keep); pytest runs the same rows.

Rows against tiny targets: chosen prompts (20 copies of one), forged runs (unsigned, another key),
impossible counts, a record edited on disk, config.json replaced through the API after evaluation,
deleted and FAILED runs, a pinned file with repeats. Rows against the main job's store (the real
fine-tuned candidate): its own training prompts, the validation set, 20 copies of its easiest prompt,
a pinned set it was trained on.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import mlflow
import pytest

from tests.helpers.promotion import MANY, register_gated, write_profiles
from tests.helpers.steps import run_step
from tests.helpers.stores import project_runs

NAME = "k25-tiny-eagle3"


def _client(tmp: Path) -> mlflow.MlflowClient:
    return mlflow.MlflowClient(f"sqlite:///{tmp}/mlflow.db")


def _evaluate(tmp: Path, version: str, profile: str, *extra: str, target: Path, code: int = 0, here: bool = True):
    res = run_step(
        "evaluate",
        ["--model", f"models:/{NAME}/{version}", "--target", str(target), "--profile", str(tmp / profile)]
        + ["--no-progress", *extra],
        tmp,
        here=here,
    )
    assert res.returncode == code, res.stdout[-2000:] + res.stderr[-2000:]
    return res


def _promote(tmp: Path, version: str, profile: str = "lenient.yaml", stage: str = "staging"):
    return run_step(
        "promote",
        ["--model", f"models:/{NAME}/{version}", "--profile", str(tmp / profile), "--stage", stage],
        tmp,
        here=True,
    )


def _refused(res, why: str) -> None:
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    assert why in res.stdout, res.stdout[-3000:]


def _forge(tmp: Path, version: str, target: Path, sign_with=None, per_prompt=None, sign: bool = True) -> str:
    """A run made by hand with the genuine tags and a record written offline (tests/helpers/evidence.py)."""
    from tests.helpers.evidence import forge_record

    return forge_record(_client(tmp), NAME, version, tmp / "lenient.yaml", (lambda _c, _k: per_prompt) if per_prompt
                        else None, sign=sign, key=sign_with)  # fmt: skip


@pytest.fixture(scope="module")
def store(tiny_targets, trained_tiny, tmp_path_factory):
    """Two registered, gated tiny drafters and profiles that pin many.jsonl (lenient: break-even 1.002,
    so an honest evaluation is the positive control; sampled: the same at temperature 0.8)."""
    tmp = tmp_path_factory.mktemp("attacks")
    _, wrapped = tiny_targets
    write_profiles(tmp, wrapped)
    lenient = (tmp / "lenient.yaml").read_text()
    (tmp / "sampled.yaml").write_text(lenient.replace("lenient", "sampled") + "eval_temperature: 0.8\n")
    register_gated(tmp, wrapped, trained_tiny, (1, 2))
    return tmp, wrapped


def test_chosen_forged_and_impossible_records_are_refused_then_the_honest_one_promotes(store):
    """v2: every attack leaves it refused with its reason; its honest evaluation promotes it."""
    from registry.ledger import signing
    from registry.ledger.signing import Key

    tmp, target = store
    # chosen prompts: 20 copies of one prompt, measured under the real profile
    (tmp / "copies.jsonl").write_text((json.dumps(MANY[0]) + "\n") * 20)
    _evaluate(tmp, "2", "lenient.yaml", "--prompts", str(tmp / "copies.jsonl"), target=target)
    _refused(_promote(tmp, "2"), "measured on prompts copies.jsonl only, not on the profile's whole workload")
    # the same copies pinned by a profile: refused as bad input, naming the file
    from common.prompt_files import file_digest

    (tmp / "dup.yaml").write_text(
        (tmp / "lenient.yaml").read_text().replace("many.jsonl", "copies.jsonl").replace(
            file_digest(tmp / "many.jsonl"), file_digest(tmp / "copies.jsonl"))
    )  # fmt: skip
    res = _evaluate(tmp, "2", "dup.yaml", target=target, code=2, here=False)  # as a user sees it: no traceback
    assert "copies.jsonl: 19 prompts repeat" in res.stderr and "Traceback" not in res.stderr
    # a run made by hand with the genuine tags and an unsigned record: not evidence, ignored and said (the
    # copies record above still decides)
    forged = _forge(tmp, "2", target, sign=False)
    _refused(_promote(tmp, "2"), f"finding: evaluation run {forged} is not evidence (unsigned): ignored")
    # the same, signed with a key of the forger's own
    forged = _forge(tmp, "2", target, sign_with=Key(signing.generate(), "the forger's own"))
    _refused(_promote(tmp, "2"), f"finding: evaluation run {forged} is not evidence (signed with a key no trust list")
    # a validly signed record with physically impossible counts (35 tokens in 12 cycles at 8 new tokens)
    _forge(tmp, "2", target, per_prompt=[(35, 12)] * 20)
    _refused(_promote(tmp, "2"), "impossible counts: class all prompt 0: 35 tokens in 12 cycles at max_new_tokens 8")
    # positive control: the honest evaluation on the pinned prompts, newer than every forgery
    _evaluate(tmp, "2", "lenient.yaml", target=target)
    ok = _promote(tmp, "2")
    assert ok.returncode == 0, ok.stdout + ok.stderr


def test_stale_and_edited_records_are_refused_until_a_newer_evaluation(store):
    """v1: promoted on its honest record; config.json replaced through the API after that evaluation
    (refused, naming the file and the run); re-evaluated (the new files measured, not a cached copy: it accepts
    less and the rule refuses it); the original config put back and re-evaluated (promoted); its record then
    edited on disk (refused: bad signature); re-evaluated again (promoted)."""
    from registry.ledger.evidence.record import EVIDENCE_FILE

    tmp, target = store
    c = _client(tmp)
    first = _evaluate(tmp, "1", "lenient.yaml", target=target)
    assert _promote(tmp, "1").returncode == 0
    run_id = c.get_model_version(NAME, "1").tags["eval.lenient.run"]
    mv = c.get_model_version(NAME, "1")
    folder = Path(c.get_model_version_download_uri(NAME, "1").removeprefix("file://"))
    config = json.loads((folder / "config.json").read_text())
    (tmp / "swap").mkdir()
    (tmp / "swap" / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 10.0}))
    model_id = mv.model_id or mv.source.removeprefix("models:/")
    c.log_model_artifact(model_id, str(tmp / "swap" / "config.json"))
    _refused(_promote(tmp, "1"), f"config.json changed after evaluation run {run_id}")
    second = _evaluate(tmp, "1", "lenient.yaml", target=target)
    assert first.stdout != second.stdout  # the changed config was measured, not a stale copy
    _refused(_promote(tmp, "1"), "| beats break-even | NO |")
    (tmp / "swap" / "config.json").write_text(json.dumps(config))
    c.log_model_artifact(model_id, str(tmp / "swap" / "config.json"))
    _evaluate(tmp, "1", "lenient.yaml", target=target)
    assert _promote(tmp, "1").returncode == 0
    latest = c.get_model_version(NAME, "1").tags["eval.lenient.run"]
    record = Path(c.get_run(latest).info.artifact_uri.removeprefix("file://")) / EVIDENCE_FILE
    raw = json.loads(record.read_text())
    raw["classes"][0]["per_prompt"] = [[3, 1]] * len(raw["classes"][0]["per_prompt"])
    record.write_text(json.dumps(raw))
    _refused(_promote(tmp, "1"), f"evaluation run {latest} is not usable evidence (its evidence.json was overwritten")
    _evaluate(tmp, "1", "lenient.yaml", target=target)
    assert _promote(tmp, "1").returncode == 0


def test_deleting_failing_or_overwriting_the_unfavourable_record_withdraws_nothing(store):
    """At temperature 0.8 two seeds give two records; the least favourable decides, and still decides
    after its run is deleted, and after it is marked FAILED; overwritten with the favourable one, it
    blocks the version until a newer evaluation."""
    from registry.ledger.evidence.record import EVIDENCE_FILE

    tmp, target = store
    c = _client(tmp)
    for seed in ("0", "7"):
        _evaluate(tmp, "1", "sampled.yaml", "--seed", seed, target=target)
    runs = project_runs(c, filter_string="tags.`evidence.profile` = 'sampled'")
    worst = min(runs, key=lambda r: r.data.metrics["accept_len_ci_low"]).info.run_id
    assert len({r.data.metrics["accept_len_ci_low"] for r in runs}) == 2

    def deciding_run() -> str:
        res = _promote(tmp, "1", "sampled.yaml")
        assert res.returncode in (0, 1), res.stderr
        return res.stdout

    assert f"evaluation run {worst}" in deciding_run()
    c.delete_tag(worst, "drafterops.evidence")  # the tag is for the UI; records are found by an immutable param
    assert f"evaluation run {worst}" in deciding_run()
    c.delete_run(worst)
    assert f"evaluation run {worst}" in deciding_run()
    c.restore_run(worst)
    c.set_terminated(worst, "FAILED")
    assert f"evaluation run {worst}" in deciding_run()
    # overwritten through the API with the favourable record (validly signed, a copy): the version is blocked
    # until an evaluation made after the overwrite, which then replaces the lost record
    best = next(r.info.run_id for r in runs if r.info.run_id != worst)
    favourable = Path(c.download_artifacts(best, EVIDENCE_FILE, str(tmp / "dl"))).read_text()
    original = Path(c.download_artifacts(worst, EVIDENCE_FILE, str(tmp / "dl-worst"))).read_text()
    c.log_text(worst, favourable, EVIDENCE_FILE)
    _refused(_promote(tmp, "1", "sampled.yaml"), f"evaluation run {worst} is not usable evidence (its evidence.json "
             "was overwritten after the run logged it)")  # fmt: skip
    _evaluate(tmp, "1", "sampled.yaml", "--seed", "3", target=target)
    assert f"evaluation run {worst}" not in deciding_run()
    c.log_text(worst, original, EVIDENCE_FILE)  # put back as logged: it stands again (the other tests share v1)
    assert f"evaluation run {worst}" in deciding_run()


SHORT_SHARES = {"code": 0.6, "docs": 0.25, "repl": 0.15}


def short_workload(kimi) -> str:
    """The kimi profile's pinned classes without its long-context one (what these attacks are about is
    evidence, not length; its 16 prompts of 512-896 tokens are the slowest to decode)."""
    return "".join(
        f"  - {{name: {c.name}, prompts: {c.prompts}, sha256: {c.sha256}, share: {SHORT_SHARES[c.name]}}}\n"
        for c in kimi.workload
        if c.name in SHORT_SHARES
    )


@pytest.fixture(scope="module")
def candidate_store(small_main_job, tmp_path_factory):
    """A copy of the fast tier's main job's store (its fine-tuned candidate, trained on k2.5-train), with profiles
    whose break-even (1.002) it beats: one pinned to the workload, one pinned to its own training prompts."""
    from common.prompt_files import file_digest
    from serving.profile import load_profile

    src, ran = small_main_job
    assert ran.returncode == 0, ran.stderr[-3000:]  # the main job itself worked: what follows is about evidence
    tmp = tmp_path_factory.mktemp("cherry")
    shutil.copy(src / "mlflow.db", tmp / "mlflow.db")  # artifact locations in it are absolute: shared, read-only here
    kimi = load_profile("kimi-k2.5-8xrtxpro6000")
    classes = short_workload(kimi)
    head = "baseline_tps: 33.4\nverify_ms: 30\ndraft_step_ms: 0\ndraft_steps: 2\neval_max_new_tokens: 16\n"
    head += f"target: {kimi.target}\n"
    (tmp / "mix.yaml").write_text("name: mix\n" + head + "workload:\n" + classes)
    train = Path(kimi.workload[0].prompts).parent / "k2.5-train.jsonl"
    (tmp / "trained.yaml").write_text(
        "name: trained\n" + head + f"eval_prompts: {train}\neval_prompts_sha256: {file_digest(train)}\n"
    )
    return tmp, train


def test_the_candidate_cannot_choose_its_evaluation(candidate_store):
    """The real fine-tuned candidate evaluated on its own training prompts, on 20 copies of its easiest
    prompt and on the validation set: each refused with the reason; pinned to a set it was trained on:
    refused as contaminated, and so are its weights re-saved and imported under another name; on the
    profile's pinned workload: promoted (the positive control)."""
    tmp, train = candidate_store
    c = _client(tmp)
    name = "k2.5-mini-eagle3"
    version = c.get_model_version_by_alias(name, "candidate").version
    uri = f"models:/{name}/{version}"
    target = Path(train).parents[1] / "k2.5-mini"

    def evaluate(profile: str, *extra: str):
        res = run_step(
            "evaluate", ["--model", uri, "--target", str(target), "--profile", str(tmp / profile), "--no-progress",
                         *extra], tmp, here=True,
        )  # fmt: skip
        assert res.returncode == 0, res.stderr[-2000:]
        return res

    def promote(profile: str = "mix.yaml"):
        return run_step("promote", ["--model", uri, "--profile", str(tmp / profile)], tmp, here=True)

    first = [json.loads(line) for line in train.open()][:1]
    (tmp / "easiest.jsonl").write_text((json.dumps(first[0]) + "\n") * 20)
    rows = [
        (("--prompts", str(train), "--limit", "20"), "measured on prompts k2.5-train.jsonl only"),
        (
            ("--prompts", str(train.with_name("k2.5-val.jsonl")), "--limit", "20"),
            "measured on prompts k2.5-val.jsonl only",
        ),
        (("--prompts", str(tmp / "easiest.jsonl")), "measured on prompts easiest.jsonl only"),
    ]
    for extra, why in rows:
        evaluate("mix.yaml", *extra)
        _refused(promote(), why)
    warned = evaluate("trained.yaml")
    assert "was trained on 80 of these prompts" in warned.stdout
    _refused(promote("trained.yaml"), "evaluated on 80 prompts it was trained on (class all)")
    # laundered: its tensors re-saved with other metadata and imported as a model with no parent and no
    # finetune run: the same weights by value, so the same lineage
    from safetensors.torch import load_file, save_file

    laundered = tmp / "laundered"
    shutil.copytree(Path(c.get_model_version_download_uri(name, version).removeprefix("file://")), laundered)
    for path in laundered.glob("*.safetensors"):
        save_file(load_file(path), path, metadata={"format": "pt", "note": "nothing to see here"})
    other = "laundered-eagle3"
    for step, args in (("import_drafter", ["--source", str(laundered), "--name", other, "--target", str(target)]),
                       ("shape_gate", ["--model", f"models:/{other}/1", "--target", str(target)]),
                       ("evaluate", ["--model", f"models:/{other}/1", "--target", str(target), "--profile",
                                     str(tmp / "trained.yaml"), "--no-progress"])):  # fmt: skip
        res = run_step(step, args, tmp, here=True)
        assert res.returncode == 0, res.stderr[-2000:]
    res = run_step("promote", ["--model", f"models:/{other}/1", "--profile", str(tmp / "trained.yaml")], tmp, here=True)
    _refused(res, "evaluated on 80 prompts it was trained on (class all)")
    evaluate("mix.yaml")
    ok = promote()
    assert ok.returncode == 0, ok.stdout[-3000:]
    for cls in ("code", "docs", "repl"):
        assert f"class {cls} (" in ok.stdout


def test_a_planted_or_lost_record_of_the_holder_never_freezes_production(store):
    """v2 holds production on its honest record. A run planted on it (an empty evidence.json, as anyone with store
    access can log) is a finding: a candidate is still compared with v2's honest figure, neither frozen out nor
    waved through. v2's honest record then overwritten: the figure its sanction signed stands in for it."""
    import re

    from registry.ledger.evidence.record import EVIDENCE_FILE, TAG

    tmp, target = store
    c = _client(tmp)
    _evaluate(tmp, "2", "lenient.yaml", target=target)
    assert _promote(tmp, "2", stage="production").returncode == 0
    run = c.create_run(c.get_experiment_by_name("Default").experiment_id, tags={TAG: f"{NAME}/2"})
    c.log_param(run.info.run_id, TAG, f"{NAME}/2")
    c.log_text(run.info.run_id, "{}", EVIDENCE_FILE)
    c.set_terminated(run.info.run_id)
    _evaluate(tmp, "1", "lenient.yaml", target=target)
    res = _promote(tmp, "1", stage="production")
    assert res.returncode in (0, 1) and f"finding: evaluation run {run.info.run_id} is not evidence" in res.stdout
    compared = re.search(r"\| not worse than production \| (ok|NO) \| accept_len [\d.]+ vs production v2 ([\d.]+)",
                         res.stdout)  # fmt: skip
    assert compared, res.stdout[-3000:]
    # the holder's honest record overwritten through the API: the figure its sanction signed holds the line
    from registry.ledger.sanction import holder

    held = holder(c, NAME, "production")
    other = "1" if held.version == "2" else "2"
    from registry.access.runs import runs_with_param

    records = [
        r.info.run_id
        for r in runs_with_param(c, [e.experiment_id for e in c.search_experiments()], TAG, f"{NAME}/{held.version}")
        if r.info.run_id != run.info.run_id
    ]
    originals = {r: Path(c.download_artifacts(r, EVIDENCE_FILE, str(tmp / f"keep-{r}"))).read_text() for r in records}
    for record in records:  # every honest record of the holder, overwritten
        c.log_text(record, "{}", EVIDENCE_FILE)
    try:
        again = _promote(tmp, other, stage="production")
        signed = held.record["figure"]["accept_len"]
        assert f"vs production v{held.version} {signed:.3f}" in again.stdout, again.stdout[-3000:]
        assert f"evaluation run {records[-1]} is not usable evidence (its evidence.json was overwritten" in again.stdout
    finally:
        for record, text in originals.items():  # as logged: the other tests share these versions
            c.log_text(record, text, EVIDENCE_FILE)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))


def test_evidence_counts_on_the_profiles_target_whatever_the_models_tag_says(store, trained_tiny):
    """K2.5 and its successor share every shape, so only the weights tell them apart: a record measured on a
    same-shapes target with other weights does not count for a profile on the original, and retagging the
    registered model's `target` changes nothing; a profile that names the other target takes that record."""
    from drafter.analysis.fingerprint import target_digest
    from tests.helpers.targets import same_shapes_other_weights

    tmp, target = store
    c = _client(tmp)
    other = same_shapes_other_weights(target, tmp / "k25-tiny-next")
    assert target_digest(other) != target_digest(target)
    register_gated(tmp, target, trained_tiny, (3,))  # v3: evaluated on nothing else: only the record below decides
    res = _evaluate(tmp, "3", "lenient.yaml", target=other)
    assert "is not lenient's deployment target" in res.stdout
    _refused(_promote(tmp, "3"), "measured on another target")
    c.set_registered_model_tag(NAME, "target", str(other))  # informative only
    _refused(_promote(tmp, "3"), "measured on another target")
    c.set_registered_model_tag(NAME, "target", str(target))
    (tmp / "next.yaml").write_text((tmp / "lenient.yaml").read_text().replace(f"target: {target}", f"target: {other}"))
    res = _promote(tmp, "3", "next.yaml")
    assert res.returncode == 0, res.stdout[-2000:]


def test_a_hand_written_profile_at_break_even_at_or_below_one_is_no_evidence(store):
    """A hand-written profile at 20 tok/s and a 30 ms cycle (break-even 0.600) would pass a drafter that accepts
    nothing once production is empty: promote refuses it with the reason, to staging and production alike; the
    same profile at 33.4 tok/s (break-even 1.002) is the positive control."""
    tmp, target = store
    low = (tmp / "lenient.yaml").read_text().replace("name: lenient", "name: low").replace("33.4", "20")
    (tmp / "low.yaml").write_text(low)
    _evaluate(tmp, "1", "low.yaml", target=target)
    for stage in ("staging", "production"):
        res = _promote(tmp, "1", "low.yaml", stage)
        _refused(res, "profile low: a speculative cycle written as no dearer than plain decoding (break-even 0.600")
        assert "fix baseline_tps or the cycle's timings" in res.stdout
    assert _client(tmp).get_registered_model(NAME).aliases.get("production") != "1"


def test_a_block_drafter_priced_below_one_on_a_profile_above_it_is_no_evidence(tmp_path):
    """20 tok/s, a 30 ms verify and three 10 ms draft steps: a chain's break-even is 1.200, but a DFlash
    drafter's cycle is one pass (0.800), so a block drafter that accepts nothing would pass on it: the evidence
    recompute prices the drafter's own cycle and refuses it, to staging and production alike; at 26 tok/s (1.040)
    the same drafter is promoted to staging (promote gates a DFlash version by its own method's rules)."""
    from common.prompt_files import file_digest

    mini = Path(__file__).resolve().parents[1] / "miniworld"
    lines = (mini / "prompts" / "workload-code.jsonl").read_text().splitlines()[:8]
    (tmp_path / "w.jsonl").write_text("".join(line + "\n" for line in lines))
    (tmp_path / "cheap.yaml").write_text(
        "name: cheap\nbaseline_tps: 20\nverify_ms: 30\ndraft_step_ms: 10\ndraft_steps: 3\nmin_prompts: 8\n"
        f"eval_prompts: w.jsonl\neval_prompts_sha256: {file_digest(tmp_path / 'w.jsonl')}\neval_max_new_tokens: 8\n"
        f"target: {mini / 'k2.5-mini'}\n"
    )
    uri = "models:/zl-mini-dflash/1"
    for step, args in (
        ("import_drafter", ["--source", str(mini / "zl-mini-dflash"), "--target", str(mini / "k2.5-mini"), "--name",
                            "zl-mini-dflash"]),
        ("shape_gate", ["--model", uri, "--target", str(mini / "k2.5-mini")]),
        ("evaluate", ["--model", uri, "--target", str(mini / "k2.5-mini"), "--profile", str(tmp_path / "cheap.yaml"),
                      "--no-progress"]),
    ):  # fmt: skip
        res = run_step(step, args, tmp_path, here=True)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    for stage in ("staging", "production"):
        res = run_step("promote", ["--model", uri, "--profile", str(tmp_path / "cheap.yaml"), "--stage", stage],
                       tmp_path, here=True)  # fmt: skip
        _refused(res, "profile cheap, priced for this drafter (a block cycle): its cycle costs no more than plain")
        assert "break-even 0.800 <= 1" in res.stdout, res.stdout[-2000:]
    # the method is read from the version's files, never its tag: labelled a chain, it is still priced as a block
    from mlflow import MlflowClient

    MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").set_model_version_tag("zl-mini-dflash", "1", "method", "eagle3")
    res = run_step("promote", ["--model", uri, "--profile", str(tmp_path / "cheap.yaml"), "--stage", "staging"],
                   tmp_path, here=True)  # fmt: skip
    _refused(res, "priced for this drafter (a block cycle)")
    # positive control: the same evidence on the profile at 26 tok/s (a block's break-even 1.040) promotes it to staging
    fair = (tmp_path / "cheap.yaml").read_text().replace("baseline_tps: 20", "baseline_tps: 26")
    (tmp_path / "fair.yaml").write_text(fair.replace("name: cheap", "name: fair"))
    run_step("evaluate", ["--model", uri, "--target", str(mini / "k2.5-mini"), "--profile", str(tmp_path / "fair.yaml"),
                          "--no-progress"], tmp_path, here=True)  # fmt: skip
    res = run_step("promote", ["--model", uri, "--profile", str(tmp_path / "fair.yaml"), "--stage", "staging"],
                   tmp_path, here=True)  # fmt: skip
    assert res.returncode == 0 and "break-even 1.040" in res.stdout, res.stdout[-2000:]
    serve_at = next(line for line in res.stdout.splitlines() if line.startswith("serve at:"))
    assert "k=3" in serve_at.split("(")[0] and "k=1" not in serve_at, serve_at  # a block: its measured width only


def test_recertify_rechecks_production_when_the_target_moves_and_demotes_by_the_rule(small_main_job, tmp_path):
    """The main job's candidate holds production on k2.5-mini. Nothing moved: re-certification says so. The
    deployment moves to a target with k2.5-mini's shapes and other weights (the shape gate cannot tell them
    apart): the holder is measured again and compared paired per prompt, kept while the rule holds, and
    demoted (exit 1, the alias cleared by a signed sanction, every step audited) once it no longer does."""
    from registry.ledger.sanction import holder
    from serving.profile import load_profile
    from tests.helpers.targets import same_shapes_other_weights

    src, ran = small_main_job
    assert ran.returncode == 0, ran.stderr[-3000:]
    shutil.copy(src / "mlflow.db", tmp_path / "mlflow.db")
    c = _client(tmp_path)
    name = "k2.5-mini-eagle3"
    version = str(c.get_model_version_by_alias(name, "candidate").version)
    kimi = load_profile("kimi-k2.5-8xrtxpro6000")
    classes = short_workload(kimi)
    mini = Path(kimi.target)
    other = same_shapes_other_weights(mini, tmp_path / "k2.5-mini-next", scale=0.15)  # its fine-tune, say

    def profile(file: str, target: Path, baseline_tps: float = 33.4) -> str:
        head = f"name: mix\nbaseline_tps: {baseline_tps}\nverify_ms: 30\ndraft_step_ms: 0\ndraft_steps: 2\n"
        (tmp_path / file).write_text(head + f"eval_max_new_tokens: 16\ntarget: {target}\nworkload:\n{classes}")
        return str(tmp_path / file)

    def step(name_: str, *args: str, code: int = 0):
        res = run_step(name_, list(args), tmp_path, here=True)
        assert res.returncode == code, res.stdout[-3000:] + res.stderr[-3000:]
        return res

    step("evaluate", "--model", f"models:/{name}/{version}", "--target", str(mini), "--profile",
         profile("mix.yaml", mini), "--no-progress")  # fmt: skip
    step("promote", "--model", f"models:/{name}/{version}", "--profile", str(tmp_path / "mix.yaml"))
    from tests.helpers.checks import one_line_exit_2

    one_line_exit_2(step("recertify", "--model", "no-such-model", "--profile", str(tmp_path / "mix.yaml"), code=2),
                    "--model no-such-model: no such registered model")  # fmt: skip
    # a profile that would pass what accepts nothing decides nothing: refused before anything is measured
    one_line_exit_2(step("recertify", "--model", name, "--profile", profile("low.yaml", mini, 20), code=2),
                    "break-even 0.600 <= 1")  # fmt: skip
    same = step("recertify", "--model", name, "--profile", str(tmp_path / "mix.yaml"))
    assert "its evidence still matches today's conditions" in same.stdout and "recertify: unchanged" in same.stdout
    # a junk lineage run planted on the holder's weights (anyone can log one): a finding, never a demotion
    from drafter.analysis.fingerprint import tensor_digest
    from registry.ledger.lineage import SHA_PARAM, WEIGHTS_PARAM

    junk = c.create_run(c.get_experiment_by_name("Default").experiment_id)
    folder = Path(c.get_model_version_download_uri(name, version).removeprefix("file://"))
    c.log_param(junk.info.run_id, WEIGHTS_PARAM, tensor_digest(folder))
    c.log_param(junk.info.run_id, SHA_PARAM, "0" * 64)
    moved = step("recertify", "--model", name, "--profile", profile("next.yaml", other))
    assert "measured on another target" in moved.stdout and "paired prompts" in moved.stdout, moved.stdout
    assert "kept: the rule cannot be applied on what was measured" in moved.stdout and "lineage record" in moved.stdout
    assert "recertify: warn" in moved.stdout and "production" in c.get_registered_model(name).aliases
    after = float(re.search(r"accept_len [\d.]+ -> ([\d.]+)", moved.stdout)[1])
    # a run planted on the holder claiming an evaluation (an empty evidence.json): a finding, never a reason to keep
    from registry.ledger.evidence.record import EVIDENCE_FILE, TAG

    planted = c.create_run(c.get_experiment_by_name("Default").experiment_id)
    c.log_param(planted.info.run_id, TAG, f"{name}/{version}")
    c.log_text(planted.info.run_id, "{}", EVIDENCE_FILE)
    # the same move on a deployment whose break-even sits above what the holder now measures
    demoted = step("recertify", "--model", name, "--profile", profile("strict.yaml", other, (after + 0.2) * 1000 / 30),
                   code=1)  # fmt: skip
    assert "the promotion rule no longer holds" in demoted.stdout and "recertify: demote" in demoted.stdout
    assert f"finding: evaluation run {planted.info.run_id} is not evidence" in demoted.stdout
    assert "production" not in c.get_registered_model(name).aliases
    assert holder(c, name, "production").version is None  # the chain says cleared: the guard keeps it so
    audit = c.get_experiment_by_name("drafterops-audit").experiment_id
    decisions = {r.data.tags["decision"] for r in c.search_runs([audit], filter_string="tags.decision LIKE 'recert%'")}
    assert decisions >= {"recertify:production:unchanged", "recertify:production:demote"}, decisions


def test_a_lossless_resave_or_a_little_noise_keeps_the_lineage(candidate_store):
    """The fine-tuned candidate's weights re-saved in float32 (lossless from bf16), and with 1e-6 of noise on one
    tensor, each imported as a model of its own from a folder: both still carry the candidate's training prompts
    (the first by its canonical digest, the second as a near-copy by its sketch), so an evaluation on them is
    refused as contaminated; the candidate itself is no near-copy of the flagship it was fine-tuned from."""
    import torch
    from safetensors.torch import load_file, save_file

    from registry.ledger.lineage import lineage

    tmp, train = candidate_store
    c = _client(tmp)
    name = "k2.5-mini-eagle3"
    mv = c.get_model_version_by_alias(name, "candidate")
    source = Path(c.get_model_version_download_uri(name, mv.version).removeprefix("file://"))
    trained = lineage(c, mv).keys
    assert trained  # the positive control: the candidate's own lineage holds its training prompts
    target = Path(train).parents[1] / "k2.5-mini"

    def copy(label: str, change, dtype: str = "") -> set[str]:
        folder = tmp / label
        shutil.copytree(source, folder)
        for path in folder.glob("*.safetensors"):
            save_file(change(load_file(path)), path)
        if dtype:  # the config says what the weights now are, as an operator re-saving them writes it
            config = json.loads((folder / "config.json").read_text())
            (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": dtype}, indent=2))
        res = run_step("import_drafter", ["--source", str(folder), "--name", label, "--target", str(target)], tmp,
                       here=True)  # fmt: skip
        assert res.returncode == 0, res.stderr[-2000:]
        return lineage(c, c.get_model_version(label, "1")).keys

    def noisy(tensors: dict) -> dict:
        key = "midlayer.mlp.down_proj.weight"
        bumped = tensors[key].float() + 1e-6 * torch.randn(
            tensors[key].shape, generator=torch.Generator().manual_seed(0)
        )
        assert not torch.equal(bumped.to(tensors[key].dtype), tensors[key])  # some values really changed
        return {**tensors, key: bumped.to(tensors[key].dtype)}

    as_float32 = copy("float32-copy", lambda t: {k: v.float() if v.is_floating_point() else v for k, v in t.items()},
                      "float32")  # fmt: skip
    assert as_float32 >= trained
    assert copy("noisy-copy", noisy) >= trained
    from drafter.analysis.sketch import NEAR, relative_distance, weights_sketch

    flagship = Path(train).parents[1] / "aq-mini-eagle3"
    assert relative_distance(weights_sketch(flagship), weights_sketch(source)) > NEAR


def test_a_planted_sketch_with_nan_inf_or_the_wrong_shape_is_no_sketch():
    """Lineage records are written by anyone with store access: a sketch in one with NaN or inf, the wrong number
    of buckets, a negative norm or no shapes is read as no sketch (never a near-copy, never an error), and two
    sketches of different tensors are infinitely far apart."""
    import math

    from drafter.analysis.sketch import BUCKETS, Sketch, relative_distance

    def raw(**change):
        return {"shapes": "s", "buckets": {"w": [0.5] * BUCKETS}, "norm2": {"w": 1.0}, **change}

    assert Sketch.from_json(raw()) is not None
    for bad in (raw(buckets={"w": [math.nan] * BUCKETS}), raw(buckets={"w": [math.inf] * BUCKETS}),
                raw(buckets={"w": [0.5] * (BUCKETS - 1)}), raw(norm2={"w": -1.0}), raw(norm2={"w": math.nan}),
                raw(norm2={"v": 1.0}), {"buckets": {}}, None, "junk"):  # fmt: skip
        assert Sketch.from_json(bad) is None, bad
    assert relative_distance(Sketch.from_json(raw()), Sketch.from_json(raw(shapes="other"))) == math.inf
