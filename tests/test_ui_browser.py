"""A person's view: the MLflow UI (a real `mlflow server`) in headless Chromium. After the main job
it tells the story at a glance (runs named for what they are, no red for the expected refusal, the
verdict in the main run's description with the comparison figure, each version page with its
evaluation and promotion verdict); after a passing promotion, the version page shows production.
Screenshots go to $DRAFTEROPS_SCREENSHOTS when set (else the test's temporary folder)."""

import contextlib
import json
import os
import shutil
import time
from pathlib import Path

import pytest

from tests.conftest import mlflow_server, run_step
from tests.test_data import PROMPTS, write_prompts

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    not (CHROMIUM and DRIVER), reason="Debian's chromium and chromium-driver are not installed (.ci/run installs them)"
)


@contextlib.contextmanager
def browser_on(folder: Path, backend_uri: str):
    """(browser, base URL): headless Chromium on a live `mlflow server` for the store."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1600,1100"):
        opts.add_argument(arg)
    with mlflow_server(folder, backend_uri) as base:
        browser = webdriver.Chrome(service=Service(DRIVER), options=opts)
        try:
            yield browser, base
        finally:
            browser.quit()


def shots(fallback: Path) -> Path:
    folder = Path(os.environ.get("DRAFTEROPS_SCREENSHOTS", fallback))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def page_text(browser, url: str, *expected: str, timeout: float = 60) -> str:
    """The page's visible text once every expected string shows (the UI renders after load)."""
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(url)
    text = ""

    def ready(b):
        nonlocal text
        text = b.execute_script("return document.body.innerText")
        return all(e in text for e in expected)

    try:
        WebDriverWait(browser, timeout).until(ready)
    except Exception:
        raise AssertionError(f"{url}: missing {[e for e in expected if e not in text]}; page:\n{text[:3000]}") from None
    return text


def test_after_main_the_ui_tells_which_drafter_is_where_and_why(main_job):
    import mlflow
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    tmp, _cmd, _env, first = main_job
    assert first.returncode == 0, first.stderr[-2000:]
    c = mlflow.MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    name, profile = "k2.5-mini-eagle3", "kimi-k2.5-8xrtxpro6000"
    main_run = c.search_runs(["0"], filter_string="tags.`drafterops.step` = 'main'", order_by=["start_time ASC"])[0]
    candidate = c.get_model_version_by_alias(name, "candidate").version
    out = shots(tmp / "screenshots")
    with browser_on(tmp, f"sqlite:///{tmp}/mlflow.db") as (b, base):
        page_text(b, f"{base}/#/experiments/0/runs", "main")
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
        statuses = {r.info.status for r in c.search_runs(["0"]) if "drafterops.step" in r.data.tags}
        assert statuses == {"FINISHED"}
        page_text(b, f"{base}/#/experiments/0/runs/{main_run.info.run_id}", "No drafter beats break-even", "fine-tuned")
        b.save_screenshot(str(out / "main_run.png"))
        page_text(b, f"{base}/#/experiments/0/runs/{main_run.info.run_id}/artifacts", "drafters_vs_break_even.png")
        b.find_element(By.XPATH, "//*[text()='drafters_vs_break_even.png']").click()
        WebDriverWait(b, 60).until(
            lambda b: any(
                (i.get_attribute("src") or "").startswith("blob:") and int(i.get_attribute("naturalWidth") or 0) > 300
                for i in b.find_elements(By.TAG_NAME, "img")
            )
        )
        b.save_screenshot(str(out / "comparison_figure.png"))
        page_text(b, f"{base}/#/models/{name}", "Where each alias points", "Last promotion decision", "refused")
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
        b.save_screenshot(str(out / "version.png"))


def step(name, args, cwd):
    res = run_step(name, args, cwd)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]


def test_registered_model_page_shows_versions_alias_and_gate(tiny_targets, drafter_factory, tmp_path):
    from drafter.checkpoint import save_drafter

    _, wrapped = tiny_targets
    vocab = json.loads((wrapped / "config.json").read_text())["text_config"]["vocab_size"]
    save_drafter(
        drafter_factory(vocab_size=vocab, draft_vocab_size=64, aux_layer_ids=[0, 1, 2]),
        tmp_path / "d",
        include_embedding=False,
    )
    from drafter.prompts import file_digest

    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS[:1])
    (tmp_path / "slow.yaml").write_text(
        "name: slow\nbaseline_tps: 5\nverify_ms: 30\ndraft_step_ms: 0\ndraft_steps: 2\nmin_prompts: 1\n"
        f"eval_prompts: p.jsonl\neval_prompts_sha256: {file_digest(prompts)}\neval_max_new_tokens: 6\n"
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
    out = shots(tmp_path)
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
