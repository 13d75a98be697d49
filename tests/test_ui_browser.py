"""A person's view: the MLflow UI (a real `mlflow server`) in headless Chromium at 1600x1000. After the
main job it tells the story at a glance (runs named for what they are, no red for the expected
refusal, each decision's verdict visible without scrolling on the main run, the model page, a version
page, the promote run and a scale run, the model page's numbers those main printed); after a passing
promotion, the version page shows production. Screenshots are the test run's artifacts: they go to
$DRAFTEROPS_SCREENSHOTS when set, else test-artifacts/screenshots/ in the checkout."""

import shutil
import time
from pathlib import Path

import pytest

from tests.helpers.browser import CHROMIUM, DRIVER, above_the_fold, browser_on, close_assistant, page_text, shots
from tests.helpers.prompts import PROMPTS, write_prompts
from tests.helpers.steps import run_step
from tests.helpers.stores import project_runs

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [
    pytest.mark.full,
    pytest.mark.skipif(
        not (CHROMIUM and DRIVER),
        reason="Debian's chromium and chromium-driver are not installed (.ci/run installs them)",
    ),
]


def test_after_main_the_ui_tells_which_drafter_is_where_and_why(main_job):
    import re

    import mlflow
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    tmp, _cmd, _env, first = main_job
    assert first.returncode == 0, first.stderr[-2000:]
    c = mlflow.MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    name, profile = "k2.5-mini-eagle3", "kimi-k2.5-8xrtxpro6000"
    exp = c.get_experiment_by_name("drafterops")
    assert exp.tags.get("mlflow.experimentKind") == "custom_model_development"
    main_run = project_runs(c, filter_string="tags.`drafterops.step` = 'main'", order_by=["start_time ASC"])[0]
    link = f"/#/experiments/{exp.experiment_id}/runs/{main_run.info.run_id}?workflowType=machine_learning"
    assert link in first.stdout and f"/#/models/{name}" in first.stdout  # main prints where to click
    (promote_run,) = project_runs(c, filter_string="tags.`drafterops.step` = 'promote'")
    candidate = c.get_model_version_by_alias(name, "candidate").version
    printed = re.findall(
        r"\| (?:imported|fine-tuned|scratch) \| v\d+ \| (\d\.\d{3} \[\d\.\d{3}, \d\.\d{3}\])", first.stdout
    )
    assert len(printed) == 3, first.stdout[-3000:]
    out = shots()
    runs_view = f"/#/experiments/{exp.experiment_id}/runs"
    with browser_on(tmp, f"sqlite:///{tmp}/mlflow.db") as (b, base):
        page_text(b, f"{base}{runs_view}?workflowType=machine_learning", "main")
        close_assistant(b)
        # unfold main's children (a rerun's main, which reused every step, has none)
        b.find_element(By.XPATH, "//div[@role='gridcell' and contains(@col-id, 'Run Name')]//button").click()
        runs = page_text(
            b,
            b.current_url,
            "finetune warm",
            "finetune scratch",
            f"evaluate v{candidate} @ {profile}",
            f"promote v{candidate} -> production: refused",
            "make_data k2.5-train",
            "shape_gate v1 vs k2.5-mini",
        )
        time.sleep(1)
        b.save_screenshot(str(out / "runs.png"))
        assert "Failed" not in runs
        # no run of the pipeline, the refusal included, shows MLflow's failed status
        statuses = {r.info.status for r in project_runs(c) if "drafterops.step" in r.data.tags}
        assert statuses == {"FINISHED"}
        scale = run_step(
            "scale",
            ["--init", str(ROOT / "miniworld" / "aq-mini-eagle3"), "--data", str(tmp / "work" / "data" / "k2.5-train"),
             "--val_data", str(tmp / "work" / "data" / "k2.5-val"), "--sizes", "4,8,12", "--seeds", "0",
             "--epochs", "2", "--no-progress"],
            tmp,
        )  # fmt: skip  # a short ladder: the answer is an extrapolation, and says so
        assert scale.returncode == 0, scale.stderr[-2000:]
        (scale_run,) = project_runs(c, filter_string="tags.`drafterops.step` = 'scale'")
        page_text(b, f"{base}{link}", "No drafter beats break-even", "fine-tuned", "Where each drafter is now")
        above_the_fold(b, "No drafter beats break-even")
        b.save_screenshot(str(out / "main_run.png"))
        model = page_text(b, f"{base}/#/models/{name}", "Where each alias points", "Every version", "refused")
        # each version's latest evaluation, rounded as main prints it (a bake-off that evaluated a version again
        # on the whole workload, after a main job at --limit, would show its own)
        for v in c.search_model_versions(f"name='{name}'"):
            t = c.get_model_version(name, v.version).tags
            figure = "{:.3f} [{:.3f}, {:.3f}]".format(*(float(t[f"eval.{profile}.{k}"]) for k in (
                "accept_len", "accept_len_ci_low", "accept_len_ci_high")))  # fmt: skip
            assert figure in model, (figure, model[:3000])
        assert main_run.data.tags["mlflow.note.content"].count(" [") >= len(printed)
        assert all(figure in main_run.data.tags["mlflow.note.content"] for figure in printed)
        assert all(f"v{v.version}" in model for v in c.search_model_versions(f"name='{name}'"))
        above_the_fold(b, "Last promotion decision")
        b.save_screenshot(str(out / "model.png"))
        version = page_text(
            b,
            f"{base}/#/models/{name}/versions/{candidate}",
            f"Fine-tuned from models:/{name}/1",
            f"Evaluation on {profile}",
            "Promotion to production on",
            "refused",
        )
        assert version.index("Promotion to production") < version.index("Tensors")  # the verdict reads first
        assert version.index("Promotion to production") < version.index("trained for")  # lineage below
        above_the_fold(b, "Promotion to production on")
        b.save_screenshot(str(out / "version.png"))
        run_page = f"{base}/#/experiments/{exp.experiment_id}/runs/{{}}?workflowType=machine_learning"
        page_text(b, run_page.format(promote_run.info.run_id), f"Refused v{candidate} for production")
        above_the_fold(b, f"Refused v{candidate} for production")
        b.save_screenshot(str(out / "promote_run.png"))
        page_text(b, run_page.format(scale_run.info.run_id), "Warm start", "ladder 4-12")
        above_the_fold(b, "Warm start")
        b.save_screenshot(str(out / "scale_run.png"))
        page_text(b, f"{base}/#/experiments/{exp.experiment_id}/runs/{main_run.info.run_id}/artifacts",
                  "drafters_vs_break_even.png")  # fmt: skip
        b.find_element(By.XPATH, "//*[text()='drafters_vs_break_even.png']").click()
        WebDriverWait(b, 60).until(
            lambda b: any(
                (i.get_attribute("src") or "").startswith("blob:") and int(i.get_attribute("naturalWidth") or 0) > 300
                for i in b.find_elements(By.TAG_NAME, "img")
            )
        )
        b.save_screenshot(str(out / "comparison_figure.png"))


def step(name, args, cwd):
    res = run_step(name, args, cwd)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]


def test_registered_model_page_shows_versions_alias_and_gate(tiny_targets, trained_tiny, tmp_path):
    from tests.helpers.trained import drafter_folder

    _, wrapped = tiny_targets
    shutil.copytree(drafter_folder(trained_tiny, 1), tmp_path / "d")  # it accepts enough to be promoted
    from common.prompt_files import file_digest

    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS[:1])
    (tmp_path / "slow.yaml").write_text(
        "name: slow\nbaseline_tps: 33.4\nverify_ms: 30\ndraft_step_ms: 0\ndraft_steps: 2\nmin_prompts: 1\n"
        f"eval_prompts: p.jsonl\neval_prompts_sha256: {file_digest(prompts)}\neval_max_new_tokens: 6\n"
        f"target: {wrapped}\n"
    )
    uri = "models:/k25-tiny-eagle3/1"
    step("import_drafter", ["--source", str(tmp_path / "d"), "--target", str(wrapped)], tmp_path)
    step("shape_gate", ["--model", uri, "--target", str(wrapped)], tmp_path)
    step(
        "evaluate",
        [
            "--model",
            uri,
            "--target",
            str(wrapped),
            "--profile",
            str(tmp_path / "slow.yaml"),
            "--no-progress",
        ],
        tmp_path,
    )
    step("promote", ["--model", uri, "--profile", str(tmp_path / "slow.yaml")], tmp_path)
    out = shots()
    with browser_on(tmp_path, f"sqlite:///{tmp_path}/mlflow.db") as (browser, base):
        page_text(browser, f"{base}/#/models/k25-tiny-eagle3", "Version 1", "production", "Where each alias points")
        browser.save_screenshot(str(out / "promoted_model.png"))
        text = page_text(
            browser,
            f"{base}/#/models/k25-tiny-eagle3/versions/1",
            "Shape gate vs",
            "fc.weight",
            "Promotion to production on",
            "promoted",
        )
        assert "imported" in text
        browser.save_screenshot(str(out / "promoted_version.png"))
