from pathlib import Path

import mlflow
import pytest

from registry.ledger.policy import Evidence, decide
from tests.helpers.promotion import evaluate, register_gated, write_profiles
from tests.helpers.steps import run_step
from tests.helpers.trained import drafter_folder

ROOT = Path(__file__).resolve().parents[1]


def ev(version="2", gate="passed", target="t", L=3.0, lo=2.8, be=2.46):
    return Evidence(version, gate, target, L, lo, be)


@pytest.mark.parametrize(
    "candidate, incumbent, allowed, failing",
    [
        (ev(), None, True, []),
        (ev(gate="failed"), None, False, ["shape_gate"]),
        (ev(gate=None), None, False, ["shape_gate"]),
        (ev(target="other"), None, False, ["shape_gate"]),
        (Evidence("2", "passed", "t"), None, False, ["evaluated"]),
        (ev(lo=2.46), None, False, ["ci_low beats break-even"]),  # a tie with break-even is not beating it
        (ev(L=2.5, lo=2.3), None, False, ["ci_low beats break-even"]),
        (ev(L=3.0), ev(version="1", L=3.0), True, []),  # a tie with production is "not worse"
        (ev(L=2.9), ev(version="1", L=3.0), False, ["not worse than production"]),
        (ev(L=2.9), Evidence("1", "passed", "t"), True, []),  # incumbent never evaluated here
        (ev(version="1"), ev(version="1"), True, []),
        (ev(gate="passed-config-only"), None, False, ["shape_gate"]),  # production needs the weights checked
    ],
)
def test_production_rules(candidate, incumbent, allowed, failing):
    d = decide(candidate, "production", "t", incumbent)
    assert d.allowed is allowed
    assert [r.rule for r in d.reasons if not r.ok] == failing


def test_production_is_compared_by_speed_up_where_the_two_cycles_cost_apart():
    """A faster one-pass holder is not replaced by a chain drafter that accepts a little more but pays more a cycle
    (and the reverse): "not worse than production" reads accept_len over each one's own break-even then."""
    holder = ev(version="1", L=2.30, lo=2.2, be=1.61)  # a P-EAGLE holder: one pass a cycle, 1.43x
    chain = ev(L=2.32, lo=2.25, be=1.73)  # an EAGLE-3 candidate: four passes a cycle, 1.34x
    d = decide(chain, "production", "t", holder)
    assert not d.allowed and [r.rule for r in d.reasons if not r.ok] == ["not worse than production"]
    assert "projected speed-up 1.341x" in d.reasons[-1].detail and "1.429x" in d.reasons[-1].detail
    assert decide(ev(L=2.32, lo=2.25, be=1.55), "production", "t", holder).allowed  # faster than the holder
    assert decide(ev(L=2.30, lo=2.2, be=1.61), "production", "t", holder).allowed  # one break-even: accept_len


def test_margin_and_staging_rules():
    assert decide(ev(L=2.9), "production", "t", ev(version="1", L=3.0), margin=0.2).allowed
    assert decide(ev(L=2.5, lo=2.0), "staging", "t").allowed  # staging needs the mean above break-even only
    assert not decide(ev(L=2.46, lo=2.0), "staging", "t").allowed
    assert not decide(ev(gate="failed"), "staging", "t").allowed
    assert decide(ev(gate="passed-config-only"), "staging", "t").allowed
    with pytest.raises(ValueError):
        decide(ev(), "archived", "t")


@pytest.fixture(scope="module")
def evaluated(tiny_targets, trained_tiny, tmp_path_factory):
    """Two registered tiny drafters, gated; v1 really evaluated on 20 prompts under the seed profile and
    under a lenient one whose break-even any drafter beats (the positive control)."""
    tmp = tmp_path_factory.mktemp("promote")
    _, wrapped = tiny_targets
    write_profiles(tmp, wrapped)
    register_gated(tmp, wrapped, trained_tiny, (1, 2))
    for profile in ("strict.yaml", "lenient.yaml"):
        evaluate(tmp, "models:/k25-tiny-eagle3/1", wrapped, tmp / profile)
    return tmp


def test_refused_below_break_even_and_promoted_above(evaluated):
    tmp = evaluated
    c = mlflow.MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    refused = run_step("promote", ["--model", "models:/k25-tiny-eagle3/1", "--profile", str(tmp / "strict.yaml")], tmp)
    assert refused.returncode == 1, refused.stderr
    assert "| ci_low beats break-even | NO |" in refused.stdout
    assert "production" not in c.get_registered_model("k25-tiny-eagle3").aliases
    assert c.get_model_version("k25-tiny-eagle3", "1").tags["promotion"].startswith("refused to production")
    assert "## Promotion to production on `strict`: refused" in (
        c.get_model_version("k25-tiny-eagle3", "1").description
    )
    ok = run_step("promote", ["--model", "models:/k25-tiny-eagle3/1", "--profile", str(tmp / "lenient.yaml")], tmp)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    mv = c.get_model_version_by_alias("k25-tiny-eagle3", "production")
    assert str(mv.version) == "1" and mv.current_stage == "Production"
    # the decision names the evaluation it used, and that run is a finished evaluate run of v1
    used = c.search_runs(
        [c.get_experiment_by_name("drafterops-audit").experiment_id],
        filter_string="tags.decision = 'promote:production:yes'",
    )[0].data.tags["evidence_run"]
    assert c.get_run(used).data.tags["drafterops.evidence"] == "k25-tiny-eagle3/1"
    assert used in ok.stdout
    never = run_step("promote", ["--model", "models:/k25-tiny-eagle3/1", "--profile", "nope"], tmp)
    assert never.returncode == 2 and "unknown profile" in never.stderr


def test_every_way_around_the_gate_is_refused(evaluated, tiny_targets):
    """The ways found by trying, each on v2 (which would pass the lenient profile if evaluated right),
    then the real evaluation as the positive control."""
    tmp = evaluated
    flat, wrapped = tiny_targets
    name, uri = "k25-tiny-eagle3", "models:/k25-tiny-eagle3/2"
    c = mlflow.MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    lenient = str(tmp / "lenient.yaml")

    def promote(profile=lenient, stage="production"):
        return run_step("promote", ["--model", uri, "--profile", profile, "--stage", stage], tmp, here=True)

    def holders():
        aliases = c.get_registered_model(name).aliases
        return {a: aliases.get(a) for a in ("staging", "production")}

    before = holders()
    # 1. a step other than promote asked for a serving alias
    res = run_step("finetune", ["--init", uri, "--data", str(tmp / "nowhere"), "--alias", "production"], tmp)
    assert res.returncode == 2 and "move only through `promote`" in res.stderr
    # 2. a profile file that borrows the real profile's name with other figures (break-even 0.03)
    (tmp / "fake.yaml").write_text((tmp / "lenient.yaml").read_text().replace("lenient", "strict").replace("10", "1"))
    evaluate(tmp, uri, wrapped, tmp / "fake.yaml")
    res = promote(str(tmp / "strict.yaml"))
    assert res.returncode == 1 and "other profile values" in res.stdout, res.stdout
    # 3. a deeper draft than the profile's raises accept_len at the same break-even
    evaluate(tmp, uri, wrapped, lenient, "--draft_steps", "4")
    res = promote()
    assert res.returncode == 1 and "4 draft steps, the profile uses 2" in res.stdout, res.stdout
    # 4. evaluated against another target (the K2-style one)
    evaluate(tmp, uri, flat, lenient)
    res = promote()
    assert res.returncode == 1 and "another target" in res.stdout, res.stdout
    # 5. one prompt of the pinned set: an interval of one point
    evaluate(tmp, uri, wrapped, lenient, "--limit", "1")
    res = promote()
    assert res.returncode == 1 and "class all measured on other prompts than the pinned many.jsonl" in res.stdout
    assert "1 prompts, the profile needs 20" in res.stdout, res.stdout
    # 6. tags written by hand are not evidence
    for key, value in {"accept_len": "9.9", "accept_len_ci_low": "9.0", "break_even": "0.1"}.items():
        c.set_model_version_tag(name, "2", f"eval.lenient.{key}", value)
    c.set_model_version_tag(name, "2", "shape_gate", "passed")
    res = promote(stage="staging")
    assert res.returncode == 1 and "| evaluated | NO |" in res.stdout, res.stdout
    assert holders() == before
    # positive control: the same version, really evaluated under the profile's conditions
    evaluate(tmp, uri, wrapped, lenient)
    res = promote(stage="staging")
    assert res.returncode == 0, res.stdout + res.stderr
    assert str(c.get_model_version_by_alias(name, "staging").version) == "2"


def test_the_gate_is_recomputed_not_read_from_a_tag(tiny_targets, tmp_path):
    """A drafter whose vocabulary does not fit the target, with a forged `shape_gate=passed` tag."""
    from drafter.formats.checkpoint import save_drafter
    from tests.helpers.drafters import tiny_drafter

    _, wrapped = tiny_targets
    write_profiles(tmp_path, wrapped)
    save_drafter(tiny_drafter(seed=3, vocab_size=64, draft_vocab_size=32), tmp_path / "d", include_embedding=False)
    assert (
        run_step("import_drafter", ["--source", str(tmp_path / "d"), "--target", str(wrapped)], tmp_path).returncode
        == 0
    )
    c = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    c.set_model_version_tag("k25-tiny-eagle3", "1", "shape_gate", "passed")
    res = run_step(
        "promote",
        ["--model", "models:/k25-tiny-eagle3/1", "--profile", str(tmp_path / "lenient.yaml"), "--stage", "staging"],
        tmp_path,
    )
    assert res.returncode == 1 and "| shape_gate | NO | shape gate failed |" in res.stdout, res.stdout


def test_two_promotions_racing_end_consistent(evaluated, tiny_targets):
    tmp = evaluated
    evaluate(tmp, "models:/k25-tiny-eagle3/2", tiny_targets[1], tmp / "lenient.yaml")
    c = mlflow.MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    procs = [
        run_step(
            "promote",
            ["--model", f"models:/k25-tiny-eagle3/{v}", "--profile", str(tmp / "lenient.yaml"), "--margin", "1"],
            tmp,
            wait=False,
        )
        for v in (1, 2)
    ]
    codes = [p.wait(timeout=300) for p in procs]
    assert codes == [0, 0], [p.stderr.read() for p in procs]
    prod = c.get_model_version_by_alias("k25-tiny-eagle3", "production")
    stages = {str(v.version): v.current_stage for v in c.search_model_versions("name='k25-tiny-eagle3'")}
    assert stages[str(prod.version)] == "Production"
    assert list(stages.values()).count("Production") == 1
    audit = c.search_runs(
        [c.get_experiment_by_name("drafterops-audit").experiment_id],
        filter_string="tags.decision LIKE 'promote:production%'",
    )
    assert {r.data.tags["version"] for r in audit} >= {"1", "2"}


def test_production_alias_on_a_deleted_version_is_handled(evaluated):
    tmp = evaluated
    c = mlflow.MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    c.set_registered_model_alias("k25-tiny-eagle3", "staging", "2")
    c.delete_model_version("k25-tiny-eagle3", "2")
    res = run_step(
        "promote",
        ["--model", "models:/k25-tiny-eagle3/1", "--profile", str(tmp / "lenient.yaml"), "--stage", "staging"],
        tmp,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert str(c.get_model_version_by_alias("k25-tiny-eagle3", "staging").version) == "1"


def test_evidence_matching_is_by_values_not_names(tmp_path):
    from dataclasses import replace

    from registry.ledger.evidence.record import ClassCounts, EvidenceRecord
    from registry.ledger.evidence.verify import mismatches, pinned_keys
    from serving.profile import load_profile

    write_profiles(tmp_path, tmp_path)
    real = load_profile(str(tmp_path / "strict.yaml"))
    fake = replace(real, baseline_tps=1.0)  # the same name, other figures
    keys = pinned_keys(real)["all"]
    files = {"config.json": "C", "model.safetensors": "W"}

    def record(profile=real, **kw):
        base = dict(draft_steps=2, target_digest="T", weights_sha256="W", engine="in-process", drafter_files=files)
        base.update(kw)
        return EvidenceRecord(
            "m", "1", profile=profile.name, profile_digest=profile.digest, profile_values=profile.values(),
            target="t", temperature=0.0, max_new_tokens=8, engine_version="x",
            classes=[ClassCounts("all", 1.0, "S", keys, [(3, 2)] * 20)], **base,
        )  # fmt: skip

    assert mismatches(record(), real, "T", files) == []
    assert fake.name == real.name and fake.digest != real.digest
    assert "other profile values" in mismatches(record(fake), real, "T", files)[0]
    assert "draft steps" in mismatches(record(draft_steps=3), real, "T", files)[0]
    assert "another target" in mismatches(record(target_digest="K2"), real, "T", files)[0]
    changed = record(drafter_files={**files, "config.json": "X"}, run_id="r1")
    assert "config.json changed after evaluation run r1" in mismatches(changed, real, "T", files)[0]
    assert "cannot prove" in mismatches(record(engine="endpoint:http://x"), real, "T", files)[0]
    assert mismatches(record(engine="vllm", aux_layers={"matches_training": True}), real, "T", files) == []
    theirs = record(engine="vllm", endpoint="http://gpu:8000", drafter_attested=False)
    assert "did not launch (http://gpu:8000)" in mismatches(theirs, real, "T", files)[0]
    wrong_layers = record(engine="vllm", aux_layers={"matches_training": False})
    assert "other target layers" in mismatches(wrong_layers, real, "T", files)[0]
    few = record()
    few.classes[0].per_prompt, few.classes[0].prompt_keys = [(3, 2)] * 5, keys[:5]
    assert any("5 prompts, the profile needs 20" in w for w in mismatches(few, real, "T", files))
    # the target's precision: a record from before it was recorded was measured at float32
    assert mismatches(record(target_precision="bfloat16"), real, "T", files, precision="bfloat16") == []
    assert mismatches(record(), real, "T", files, precision="bfloat16") == [
        "measured with the target at float32; it is served at bfloat16"
    ]


def test_a_drafter_whose_steps_cost_more_than_the_timed_ones_is_held_to_its_own_break_even(
    evaluated, tiny_targets, trained_tiny
):
    """A profile whose draft steps were timed with a drafter reading a hundredth of this one's parameters a
    step: evaluate projects, and promote decides, at this drafter's own price (break-even 1.67 as written,
    about 68 priced), read from the version's weights, not from anything the evaluation wrote."""
    from drafter.analysis.step_cost import folder_step_cost

    tmp, (_, wrapped) = evaluated, tiny_targets
    step = folder_step_cost(drafter_folder(trained_tiny, 1)).per_step  # the files v1 was imported from
    text = (tmp / "lenient.yaml").read_text().replace("name: lenient", "name: priced")
    text = text.replace("draft_step_ms: 0\n", f"draft_step_ms: 10\ndraft_step_params: {max(1, step // 100)}\n")
    (tmp / "priced.yaml").write_text(text)
    said = evaluate(tmp, "models:/k25-tiny-eagle3/1", wrapped, tmp / "priced.yaml")
    assert "draft steps priced at" in said.stdout
    refused = run_step("promote", ["--model", "models:/k25-tiny-eagle3/1", "--profile", str(tmp / "priced.yaml")], tmp)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "| ci_low beats break-even | NO |" in refused.stdout and "draft steps priced at" in refused.stdout


def test_a_promote_killed_holding_the_chains_claim_stalls_nothing(evaluated):
    """A promote killed (kill -9) after claiming the chain's next link and before writing: nothing moved, and the
    next promote on the same store takes the claim over at once (on SQLite the registry's lock says the claimer is
    gone) instead of waiting for it to go stale."""
    from tests.helpers.steps import run_module, step_env

    tmp = evaluated
    c = mlflow.MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    args = ["--model", "models:/k25-tiny-eagle3/1", "--profile", str(tmp / "lenient.yaml"), "--stage", "staging"]
    before = c.get_registered_model("k25-tiny-eagle3").aliases.get("staging")
    killed = run_module("steps.promote", args, tmp, step_env(tmp, DRAFTEROPS_FAILPOINT="promote:claimed:kill"))
    assert killed.returncode == 137 and c.get_registered_model("k25-tiny-eagle3").aliases.get("staging") == before
    done = run_module("steps.promote", args, tmp, step_env(tmp), timeout=90)  # a claim goes stale after 120 s
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert str(c.get_registered_model("k25-tiny-eagle3").aliases["staging"]) == "1"
