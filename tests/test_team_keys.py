"""Two people, two keys: an evaluator's key signs evidence, a promoter's key moves serving aliases, and
neither can do the other's part; a third key does nothing. Each refusal is exit 2, one line, and leaves
the store as it was."""

from __future__ import annotations

import mlflow

from registry import signing
from tests.helpers.promotion import register_gated, write_profiles
from tests.helpers.steps import run_module, step_env

NAME = "k25-tiny-eagle3"


def test_an_evaluator_signs_a_promoter_promotes_and_a_third_key_does_neither(tiny_targets, tmp_path):
    from registry.sanction import holder
    from registry.trust import load_trust
    from tests.helpers.stores import project_runs

    _, wrapped = tiny_targets
    keys = {}
    for name in ("ci", "alice", "mallory"):
        keys[name] = tmp_path / "keys" / f"{name}.key"
        signing.write_private(keys[name], signing.generate())
    public = {n: signing.Key(signing.read_private(p), str(p)).public_text for n, p in keys.items()}
    trust = tmp_path / "trust.yaml"
    trust.write_text(f"trusted_evaluators:\n  ci: {public['ci']}\ntrusted_promoters:\n  alice: {public['alice']}\n")
    write_profiles(tmp_path, wrapped)
    register_gated(tmp_path, wrapped, (1,))
    c = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    profile = str(tmp_path / "lenient.yaml")

    def as_(who: str, step: str, *args: str):
        env = step_env(tmp_path, DRAFTEROPS_SIGNING_KEY=str(keys[who]), DRAFTEROPS_TRUST_FILE=str(trust))
        return run_module(f"steps.{step}", [*args], tmp_path, env)

    evaluate = ("evaluate", "--model", f"models:/{NAME}/1", "--target", str(wrapped), "--profile", profile,
                "--no-progress")  # fmt: skip
    promote = ("promote", "--model", f"models:/{NAME}/1", "--profile", profile, "--stage", "production")
    before = len(project_runs(c))
    for who, role in (("mallory", "evaluator"), ("alice", "evaluator")):
        res = as_(who, *evaluate)
        assert res.returncode == 2 and f"is not a trusted {role}" in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
    assert len(project_runs(c)) == before  # nothing written
    res = as_("ci", *evaluate)
    assert res.returncode == 0, res.stderr[-2000:]
    for who in ("mallory", "ci"):
        res = as_(who, *promote)
        assert res.returncode == 2 and "is not a trusted promoter" in res.stderr, res.stderr
        assert "production" not in c.get_registered_model(NAME).aliases
    res = as_("alice", *promote)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert str(c.get_model_version_by_alias(NAME, "production").version) == "1"
    import os

    os.environ["DRAFTEROPS_TRUST_FILE"] = str(trust)
    try:
        held = holder(c, NAME, "production", load_trust())
    finally:
        os.environ.pop("DRAFTEROPS_TRUST_FILE")
    assert held.version == "1" and not held.findings
