"""A person's view: the MLflow UI (a real `mlflow server`) in headless Chromium shows the registered
model's versions, the production alias and the shape-gate table."""

import json
import shutil
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


def step(name, args, cwd):
    res = run_step(name, args, cwd)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]


def test_registered_model_page_shows_versions_alias_and_gate(tiny_targets, drafter_factory, tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait

    from drafter.checkpoint import save_drafter

    _, wrapped = tiny_targets
    vocab = json.loads((wrapped / "config.json").read_text())["text_config"]["vocab_size"]
    save_drafter(
        drafter_factory(vocab_size=vocab, draft_vocab_size=64, aux_layer_ids=[0, 1, 2]),
        tmp_path / "d",
        include_embedding=False,
    )
    (tmp_path / "slow.yaml").write_text(
        "name: slow\nbaseline_tps: 5\nverify_ms: 30\ndraft_step_ms: 0\ndraft_steps: 2\nmin_prompts: 1\n"
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
            "--prompts",
            str(write_prompts(tmp_path / "p.jsonl", PROMPTS[:1])),
            "--max_new_tokens",
            "6",
            "--no-progress",
        ],
        tmp_path,
    )
    step("promote", ["--model", uri, "--profile", str(tmp_path / "slow.yaml")], tmp_path)
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        opts.add_argument(arg)
    browser = None
    with mlflow_server(tmp_path, f"sqlite:///{tmp_path}/mlflow.db") as base:
        try:
            browser = webdriver.Chrome(service=Service(DRIVER), options=opts)
            browser.get(f"{base}/#/models/k25-tiny-eagle3")
            WebDriverWait(browser, 60).until(lambda b: "Version 1" in b.page_source and "production" in b.page_source)
            browser.save_screenshot(str(tmp_path / "model.png"))
            browser.get(f"{base}/#/models/k25-tiny-eagle3/versions/1")
            WebDriverWait(browser, 60).until(
                lambda b: "Shape gate vs" in b.page_source and "fc.weight" in b.page_source
            )
            assert "imported" in browser.page_source
            browser.save_screenshot(str(tmp_path / "version.png"))
        finally:
            if browser is not None:
                browser.quit()
