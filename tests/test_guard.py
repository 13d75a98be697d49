"""The registry guards its gate: a live `mlflow server` with the guard's webhook installed reverts an
alias set by a plain MlflowClient call, keeps one set by `promote`, and refuses a forged delivery."""

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import mlflow
import pytest

from registry import guard
from tests.conftest import free_port, mlflow_server, step_env, tiny_drafter

SECRET = "a-shared-secret-for-tests-0123456789"


def test_signature_rules():
    body = b'{"entity": "model_version_alias"}'
    stamp = str(int(time.time()))
    import base64
    import hashlib
    import hmac

    sig = base64.b64encode(hmac.new(SECRET.encode(), f"d1.{stamp}.".encode() + body, hashlib.sha256).digest())
    headers = {guard.SIGNATURE_HEADER: "v1," + sig.decode(), guard.TIMESTAMP_HEADER: stamp, guard.DELIVERY_HEADER: "d1"}
    assert guard.signature_ok(SECRET, headers, body)
    assert not guard.signature_ok(SECRET, headers, body + b" ")  # tampered body
    assert not guard.signature_ok("another-secret-0123456789", headers, body)
    assert not guard.signature_ok(SECRET, {**headers, guard.TIMESTAMP_HEADER: str(int(stamp) - 3600)}, body)  # replay
    assert not guard.signature_ok(SECRET, {}, body)


def wait_for(predicate, seconds=30.0):
    end = time.time() + seconds
    while time.time() < end:
        if predicate():
            return True
        time.sleep(0.25)
    return False


def test_unsanctioned_alias_moves_are_reverted(tiny_targets, tmp_path, monkeypatch):
    from drafter.checkpoint import save_drafter

    _, wrapped = tiny_targets
    vocab = json.loads((wrapped / "config.json").read_text())["text_config"]["vocab_size"]
    for seed in (1, 2):
        save_drafter(
            tiny_drafter(seed=seed, vocab_size=vocab, draft_vocab_size=128, aux_layer_ids=[0, 1, 2]),
            tmp_path / f"d{seed}",
            include_embedding=False,
        )
    # the server delivers webhooks to loopback over http only when told to (README: guard)
    monkeypatch.setenv("MLFLOW_WEBHOOK_ALLOWED_SCHEMES", "http,https")
    monkeypatch.setenv("MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS", "true")
    monkeypatch.setenv("MLFLOW_WEBHOOK_CACHE_TTL", "1")
    port = free_port()
    with mlflow_server(
        tmp_path, f"sqlite:///{tmp_path}/server.db", "--default-artifact-root", str(tmp_path / "art")
    ) as url:
        env = step_env(tmp_path, MLFLOW_TRACKING_URI=url, DRAFTEROPS_WEBHOOK_SECRET=SECRET)

        def run_step(name, args, cwd):  # every step against the tracking server
            cmd = [sys.executable, "-m", f"steps.{name}", *args]
            return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)

        installed = subprocess.run(
            [sys.executable, "-m", "steps.guard", "--install", "--port", str(port)],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert installed.returncode == 0, installed.stderr
        service = subprocess.Popen(
            [sys.executable, "-m", "steps.guard", "--port", str(port)],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            for seed in (1, 2):
                res = run_step(
                    "import_drafter", ["--source", str(tmp_path / f"d{seed}"), "--target", str(wrapped)], tmp_path
                )
                assert res.returncode == 0, res.stderr[-2000:]
            c = mlflow.MlflowClient(url)
            name = "k25-tiny-eagle3"

            def holder():
                return c.get_registered_model(name).aliases.get("production")

            # 1. the UI's pencil (any API client): reverted, and audited
            t0 = time.time()
            c.set_registered_model_alias(name, "production", "1")
            assert wait_for(lambda: holder() is None), "unsanctioned production alias was not removed"
            revert_s = time.time() - t0
            audit = c.get_experiment_by_name("drafterops-audit").experiment_id
            reverts = c.search_runs([audit], filter_string="tags.decision = 'guard:revert:production'")
            assert reverts and reverts[0].data.tags["attempted"] == "1"
            # 2. promote's move stays
            from drafter.prompts import file_digest

            (tmp_path / "p.jsonl").write_text('{"text": "The quick brown fox"}\n')
            (tmp_path / "lenient.yaml").write_text(
                "name: lenient\nbaseline_tps: 10\nverify_ms: 30\ndraft_step_ms: 0\ndraft_steps: 2\nmin_prompts: 1\n"
                f"eval_prompts: p.jsonl\neval_prompts_sha256: {file_digest(tmp_path / 'p.jsonl')}\n"
                "eval_max_new_tokens: 6\n"
            )
            uri = f"models:/{name}/2"
            assert run_step("shape_gate", ["--model", uri, "--target", str(wrapped)], tmp_path).returncode == 0
            ev = ["--model", uri, "--target", str(wrapped)]
            ev += ["--profile", str(tmp_path / "lenient.yaml"), "--no-progress"]
            assert run_step("evaluate", ev, tmp_path).returncode == 0
            pr = run_step("promote", ["--model", uri, "--profile", str(tmp_path / "lenient.yaml")], tmp_path)
            assert pr.returncode == 0, pr.stdout + pr.stderr
            time.sleep(3)  # give the webhook time to arrive and be judged
            assert holder() == "2"
            # 3. moving it away by hand brings it back to where promote put it
            c.set_registered_model_alias(name, "production", "1")
            assert wait_for(lambda: holder() == "2"), "production was not restored to the promoted version"
            # 4. a forged delivery is refused, a malformed one too, and the service lives on
            forged = urllib.request.Request(
                f"http://127.0.0.1:{port}/",
                data=json.dumps({"entity": "model_version_alias", "action": "deleted", "data": {}}).encode(),
                headers={guard.SIGNATURE_HEADER: "v1,AAAA", guard.TIMESTAMP_HEADER: str(int(time.time())),
                         guard.DELIVERY_HEADER: "x", "Content-Type": "application/json"},
            )  # fmt: skip
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(forged, timeout=10)
            assert refused.value.code == 401
            assert service.poll() is None
            print(f"guard revert took {revert_s:.2f} s")
        finally:
            service.terminate()
            service.wait(timeout=30)
