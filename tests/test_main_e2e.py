"""The main job end to end on the mini world, in a temporary folder: at the smallest settings that still
train, evaluate and decide (fast tier, `python -m steps.main`), and as a user starts it (full tier,
`mlflow run . --env-manager local`)."""

import subprocess
from pathlib import Path

import mlflow
import pytest

from tests.helpers.stores import project_runs


def test_main_at_its_smallest_settings_trains_evaluates_and_promotes(small_main_job):
    """One trial of 8 steps, evidence on 8 pinned prompts at break-even 1.002: every step runs, three
    drafters are registered and evaluated on the pinned set, and the candidate, above break-even on
    that evidence, is promoted to production (exit 0: the rule said yes); the bake-off imports the family
    drafters and the other methods' under their own names and ranks all eight."""
    tmp, res = small_main_job
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    c = mlflow.MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    name = "k2.5-mini-eagle3"
    assert len(c.search_model_versions(f"name='{name}'")) == 3
    candidate = c.get_model_version_by_alias(name, "candidate")
    production = c.get_model_version_by_alias(name, "production")
    assert production.version == candidate.version
    tags = c.get_model_version(name, candidate.version).tags
    assert tags["promotion"].startswith("promoted"), tags["promotion"]
    assert float(tags["eval.small.accept_len_ci_low"]) > float(tags["eval.small.break_even"]) == pytest.approx(1.002)
    steps = [r.data.tags["drafterops.step"] for r in project_runs(c) if "drafterops.step" in r.data.tags]
    # the chain's own steps, then the bake-off: three family drafters and a DFlash and a P-EAGLE one imported,
    # gated and evaluated (the chain's three evaluations reused), each gate run once more by compare
    expected = {"import_drafter": 1 + 5, "make_data": 2, "finetune": 2, "evaluate": 3 + 5, "compare": 1}
    for step, count in expected.items():
        assert steps.count(step) == count, (step, steps)
    assert steps.count("shape_gate") >= 3 + 5, steps
    bake = next(r for r in project_runs(c) if r.data.tags.get("drafterops.step") == "compare")
    assert bake.data.tags["compare.winner"] and "compare-runs" in bake.data.tags["compare.compare_runs"]
    public = {"ls-mini-eagle3-mla", "nv-mini-eagle3", "rh-mini-eagle3", "zl-mini-dflash", "pe-mini-peagle"}
    assert {m.name for m in c.search_registered_models()} >= public
    main_run = next(r for r in project_runs(c) if r.data.tags.get("drafterops.step") == "main")
    assert "### Bake-off" in main_run.data.tags["mlflow.note.content"]
    # the description opens with the bake-off's answer over all eight, then this run's own drafters
    opening = main_run.data.tags["mlflow.note.content"].split("\n\n")[1]
    assert opening.startswith("**") and ("ranks first" in opening or "flagged" in opening), opening
    assert not [r.info.run_name for r in project_runs(c) if r.info.status == "RUNNING"]


@pytest.mark.full
def test_main_pipeline_registers_three_drafters_and_gates_production(main_job):
    tmp_path, cmd, env, first = main_job
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "ERROR" not in first.stderr  # the expected refusal is not reported as a failure
    assert "| imported |" in first.stdout and "| fine-tuned |" in first.stdout and "| scratch |" in first.stdout
    c = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    name = "k2.5-mini-eagle3"
    versions = {str(v.version): v for v in c.search_model_versions(f"name='{name}'")}
    assert len(versions) == 3
    imported = c.get_model_version_by_alias(name, "imported")
    candidate = c.get_model_version_by_alias(name, "candidate")
    scratch = next(v for v in versions.values() if v.version not in (imported.version, candidate.version))
    assert imported.tags["source"].startswith("file://") and imported.tags["card.license"] == "mit"
    assert candidate.tags["parent"] == f"models:/{name}/{imported.version}"
    assert "parent" not in scratch.tags and scratch.tags["dataset_digest"] == candidate.tags["dataset_digest"]
    profile = "kimi-k2.5-8xrtxpro6000"
    for v in (imported, candidate, scratch):
        tags = c.get_model_version(name, v.version).tags
        assert tags["shape_gate"] == "passed"
        assert f"eval.{profile}.accept_len" in tags and "promotion" in c.get_model_version(name, candidate.version).tags
    # the mini world's figures: the fine-tuned candidate drafts well short of the seed deployment's
    # break-even (2.46), so production is refused and stays empty
    tags = c.get_model_version(name, candidate.version).tags
    assert float(tags[f"eval.{profile}.accept_len"]) < float(tags[f"eval.{profile}.break_even"]) == pytest.approx(2.46)
    assert tags["promotion"].startswith("refused"), tags["promotion"]
    assert "production" not in c.get_registered_model(name).aliases
    # the story at a glance: each version page says how it did and what was decided; main's
    # description is its summary, with all drafters against break-even in one figure
    # main wrote each version's page (the sections' wording is checked in test_evaluate and test_promote)
    for v in (imported, candidate, scratch):
        assert f"## Evaluation on `{profile}`" in c.get_model_version(name, v.version).description
    assert "## Promotion to production" in c.get_model_version(name, candidate.version).description
    # the candidate's evaluation carries the portable speculation_profile.json, which passes its own checks and
    # says what its evidence says (serving/speculation_profile.py; docs/metrics.md)
    from serving.profile import load_profile
    from serving.speculation_profile import read_external

    ev_run = tags[f"eval.{profile}.run"]
    saved = c.download_artifacts(ev_run, "speculation_profile.json", str(tmp_path / "portable"))
    portable = read_external(Path(saved))
    assert portable.k == int(tags[f"eval.{profile}.draft_steps"]) and portable.accept_len_per_request is not None
    assert set(portable.per_category) == {cls.name for cls in load_profile(profile).workload}
    (main_run,) = project_runs(c, filter_string="tags.`drafterops.step` = 'main'")
    assert "| fine-tuned |" in main_run.data.tags["mlflow.note.content"]
    assert "drafters_vs_break_even.png" in [a.path for a in c.list_artifacts(main_run.info.run_id)]
    # one vocabulary: every parameter has a value (asked, and resolved where the step worked it out)
    runs = project_runs(c)
    assert all(v not in ("", "''") for r in runs for v in r.data.params.values())
    evaluations = [r for r in runs if r.data.tags.get("drafterops.step") == "evaluate"]
    assert {r.data.params["draft_steps"] for r in evaluations} == {"auto"}
    assert {r.data.params["resolved.draft_steps"] for r in evaluations} == {"2"}
    steps = [r for r in runs if "drafterops.step" in r.data.tags]
    assert len({r.data.tags["mlflow.runName"] for r in steps}) == len(steps)  # every step's run named apart
    assert {c.get_model_version(name, v.version).tags["trained_for"] for v in (candidate, scratch)} == {"k2.5-mini"}
    assert "Trained from scratch" in c.get_model_version(name, scratch.version).description
    for v in (candidate, scratch):
        assert "### Tensors" in c.get_model_version(name, v.version).description
    audit = c.search_runs([c.get_experiment_by_name("drafterops-audit").experiment_id])
    assert audit and all(r.data.tags.get("reason") for r in audit)
    refusals = project_runs(c, filter_string="tags.`drafterops.outcome` = 'refused'")
    assert all(r.info.status == "FINISHED" for r in refusals)
    # every decision run opens with its verdict and carries its gap to break-even as metrics
    (promote_run,) = project_runs(c, filter_string="tags.`drafterops.step` = 'promote'")
    note = promote_run.data.tags["mlflow.note.content"]
    assert note.startswith(("**Refused v", "**Promoted v"))
    if "evaluation(s) counts" not in note:  # a decision on evidence logs its gap (none: nothing to measure it by)
        assert {"shortfall_vs_break_even", "ci_low_shortfall"} <= set(promote_run.data.metrics)
    assert {"shortfall_vs_break_even", "ci_low_shortfall"} <= set(main_run.data.metrics)
    assert "Where each drafter is now" in main_run.data.tags["mlflow.note.content"]
    finetunes = project_runs(c, filter_string="tags.`drafterops.step` = 'finetune'")
    assert len(finetunes) == 2
    for ft in finetunes:
        note = ft.data.tags["mlflow.note.content"]
        assert note.startswith("**") and "trials pruned" in note and f"registered as `models:/{name}/" in note
        trials = project_runs(c, filter_string=f"tags.mlflow.parentRunId = '{ft.info.run_id}'")
        kind = "scratch" if ft.data.params["init"] == "scratch" else "warm"
        assert trials and all(f" {kind}" in t.info.run_name for t in trials)
        assert sum(t.info.run_name.endswith(" best") for t in trials) == 1
    trial_names = [r.info.run_name for r in runs if r.info.run_name.startswith("trial ")]
    assert len(set(trial_names)) == len(trial_names)  # warm and scratch trials are told apart
    assert not [r.info.run_name for r in runs if r.info.status == "RUNNING"]
    # a rerun continues from the finished steps instead of redoing them
    again = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("already done with these inputs") >= 10
    assert len(c.search_model_versions(f"name='{name}'")) == 3
