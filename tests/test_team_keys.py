"""Two people, two keys: an evaluator's key signs evidence, a promoter's key moves serving aliases, and
neither can do the other's part; a third key does nothing. Each refusal is exit 2, one line, and leaves
the store as it was."""

from __future__ import annotations

import mlflow

from registry.ledger import signing
from tests.helpers.promotion import register_gated, write_profiles
from tests.helpers.steps import run_module, step_env

NAME = "k25-tiny-eagle3"


def test_an_evaluator_signs_a_promoter_promotes_and_a_third_key_does_neither(tiny_targets, trained_tiny, tmp_path):
    from registry.ledger.sanction import holder
    from registry.ledger.trust import load_trust
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
    register_gated(tmp_path, wrapped, trained_tiny, (1,))
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


def test_rotation_end_to_end_never_clears_production_and_junk_is_refused_throughout(
    tiny_targets, trained_tiny, tmp_path
):
    """Alice promotes v1; her key is retired (kept, with the time) and Bob's added; the guard reconciles and
    production stays; Bob promotes v2, better than v1, and the guard reconciles again. Throughout: junk v3 is
    compared with the holder and refused, Alice's retired key and a third key sign nothing, an ambiguous trust
    file (a name twice, a key twice) or one others could have written is refused in one line and nothing moves;
    and Bob re-certifies the holder with ci's key for the evaluation it runs."""
    import os

    from registry.ledger.evidence.verify import records_for
    from registry.ledger.trust import load_trust
    from tests.helpers.checks import one_line_exit_2
    from tests.helpers.evidence import forge_record

    _, wrapped = tiny_targets
    keys = {n: tmp_path / "keys" / f"{n}.key" for n in ("ci", "alice", "bob", "mallory")}
    for path in keys.values():
        signing.write_private(path, signing.generate())
    key = {n: signing.Key(signing.read_private(p), str(p)) for n, p in keys.items()}
    trust = tmp_path / "team" / "trust.yaml"
    trust.parent.mkdir(mode=0o755)
    ci = f"trusted_evaluators:\n  ci: {key['ci'].public_text}\n"
    trust.write_text(ci + f"trusted_promoters:\n  alice: {key['alice'].public_text}\n")
    write_profiles(tmp_path, wrapped)
    register_gated(tmp_path, wrapped, trained_tiny, (1, 2, 3))
    c = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    profile = tmp_path / "lenient.yaml"
    for version, tokens in (("1", 2), ("2", 3), ("3", 1)):  # ci's records: v2 better than v1, v3 junk
        forge_record(c, NAME, version, profile, lambda _c, k, n=tokens: [(n, 1)] * len(k), key=key["ci"])

    def as_(who: str, step: str, *args: str):
        env = step_env(tmp_path, DRAFTEROPS_SIGNING_KEY=str(keys[who]), DRAFTEROPS_TRUST_FILE=str(trust))
        return run_module(f"steps.{step}", [*args], tmp_path, env)

    def promote(who: str, version: str):
        return as_(who, "promote", "--model", f"models:/{NAME}/{version}", "--profile", str(profile))

    def production() -> str | None:
        held = c.get_registered_model(NAME).aliases.get("production")
        return None if held is None else str(held)

    assert promote("alice", "1").returncode == 0 and production() == "1"
    retired = as_("bob", "keys", "retire", "alice")  # the rotation: her key kept, with the time, and Bob's added
    assert retired.returncode == 0 and "alice's key retired at" in retired.stdout, retired.stderr
    trust.write_text(trust.read_text() + f"  bob: {key['bob'].public_text}\n")
    reconciled = as_("bob", "guard", "--reconcile")
    assert reconciled.returncode == 0 and "(0 actions)" in reconciled.stdout, reconciled.stdout + reconciled.stderr
    assert production() == "1"
    junk = promote("bob", "3")  # compared with Alice's holder, not with nobody
    assert junk.returncode == 1 and "| not worse than production | NO | accept_len 1.000 vs production v1 2.000" \
        in junk.stdout, junk.stdout[-3000:]  # fmt: skip
    for who in ("alice", "mallory"):
        one_line_exit_2(promote(who, "2"), "is not a trusted promoter")
    better = promote("bob", "2")
    assert better.returncode == 0 and "accept_len 3.000 vs production v1 2.000" in better.stdout, better.stdout
    assert production() == "2" and "(0 actions)" in as_("bob", "guard", "--reconcile").stdout
    assert production() == "2" and promote("bob", "3").returncode == 1
    # trust files that are ambiguous, or that someone else could have written: refused, one line, nothing moves
    good = trust.read_text()
    bad = {  # the text, and what the refusal says
        good + f"  alice: {key['mallory'].public_text}\n": "'alice' is listed twice",
        good + f"  robert: {key['bob'].public_text}\n": "one key is listed as both bob and robert",
    }
    for text, said in bad.items():
        trust.write_text(text)
        c.set_registered_model_alias(NAME, "production", "3")
        one_line_exit_2(as_("bob", "guard", "--reconcile"), str(trust), said)
        assert production() == "3", said  # nothing moved, not even the hand move back
    trust.write_text(good)
    for change, undo in ((lambda: trust.chmod(0o664), lambda: trust.chmod(0o644)),
                         (lambda: trust.parent.chmod(0o777), lambda: trust.parent.chmod(0o755)),
                         (lambda: os.chown(trust, 65534, -1), lambda: os.chown(trust, os.geteuid(), -1))):  # fmt: skip
        change()
        try:
            one_line_exit_2(as_("bob", "guard", "--reconcile"), str(trust))
            assert production() == "3"
        finally:
            undo()
    assert "back from v3 to v2" in as_("bob", "guard", "--reconcile").stdout and production() == "2"
    # recertify in the two-person setup: ci's key signs the evaluation it runs, Bob's the decision
    one_line_exit_2(as_("bob", "recertify", "--model", NAME, "--profile", str(profile)), "not a trusted evaluator")
    res = as_("bob", "recertify", "--model", NAME, "--profile", str(profile), "--evaluator_key", str(keys["ci"]))
    assert res.returncode == 0 and "recertify: " in res.stdout, res.stdout[-3000:] + res.stderr[-2000:]
    os.environ["DRAFTEROPS_TRUST_FILE"] = str(trust)
    try:
        newest = max(records_for(c, NAME, "2", load_trust()).records, key=lambda r: r.created)
    finally:
        os.environ.pop("DRAFTEROPS_TRUST_FILE")
    assert newest.engine_version != "forged" and production() == "2"
