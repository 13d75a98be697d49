"""Ed25519 signing keys and the trust file: a local key made once, 0600, whole for every process that
starts at the same moment (and on a filesystem without hard links); named key files checked; records
verified against the keys a trust file lists for each role."""

import os
import stat
import subprocess
import sys

import pytest

from common.errors import BadInput
from registry.ledger import signing, trust


def test_processes_starting_together_share_one_whole_key(tmp_path):
    read = "from registry.ledger import signing; print(signing.load_key().id)"
    env = {**os.environ, "DRAFTEROPS_HOME": str(tmp_path)}
    env.pop(signing.KEY_ENV, None)
    procs = [subprocess.Popen([sys.executable, "-c", read], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(4)]  # fmt: skip
    outs = [p.communicate(timeout=120) for p in procs]
    ids = {out.strip() for out, _ in outs}
    assert len(ids) == 1 and len(ids.pop()) == 16, outs
    assert sum("created a local signing key" in err for _, err in outs) == 1  # said once, by its maker
    assert os.listdir(tmp_path / "keys") == ["local.key"]  # no staged file left behind
    assert stat.S_IMODE((tmp_path / "keys" / "local.key").stat().st_mode) == 0o600


def test_a_filesystem_without_hard_links_still_gets_its_key(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTEROPS_HOME", str(tmp_path))
    monkeypatch.delenv(signing.KEY_ENV, raising=False)

    def no_links(src, dst):
        raise OSError(95, "Operation not supported")

    monkeypatch.setattr(os, "link", no_links)
    key = signing.load_key()
    assert signing.load_key().id == key.id
    assert os.listdir(tmp_path / "keys") == ["local.key"]
    assert stat.S_IMODE((tmp_path / "keys" / "local.key").stat().st_mode) == 0o600


def test_an_empty_missing_exposed_or_typed_key_is_refused_never_replaced(tmp_path, monkeypatch):
    """A key set but empty, a file that is not there, not a key, or readable by others: each is bad input
    naming where the key came from, and no local key is made in its place."""
    monkeypatch.setenv("DRAFTEROPS_HOME", str(tmp_path))
    monkeypatch.setenv(signing.KEY_ENV, "")
    with pytest.raises(BadInput, match="DRAFTEROPS_SIGNING_KEY is set but empty"):
        signing.load_key()
    monkeypatch.setenv(signing.KEY_ENV, str(tmp_path / "nope.key"))
    with pytest.raises(BadInput, match="names no file"):
        signing.load_key()
    typed = tmp_path / "typed.key"
    typed.write_text("hunter2-hunter2-hunter2-hunter2-hunter2\n")  # a typed string is not a key
    typed.chmod(0o600)
    monkeypatch.setenv(signing.KEY_ENV, str(typed))
    with pytest.raises(BadInput, match="not an unencrypted PEM private key"):
        signing.load_key()
    assert not (tmp_path / "keys").exists()
    exposed = tmp_path / "team.key"
    assert signing.write_private(exposed, signing.generate())
    exposed.chmod(0o644)
    monkeypatch.setenv(signing.KEY_ENV, str(exposed))
    with pytest.raises(BadInput, match="readable by group or others is refused"):
        signing.load_key()
    exposed.chmod(0o600)
    assert signing.load_key().origin == str(exposed)


def _key(tmp_path, name):
    path = tmp_path / f"{name}.key"
    signing.write_private(path, signing.generate())
    return signing.Key(signing.read_private(path), str(path))


def test_roles_are_kept_apart_and_key_ids_come_from_public_keys(tmp_path, monkeypatch):
    """An evaluator's record verifies as evidence and not as a sanction; a promoter's the other way round;
    a third key neither; an edit breaks the signature; an HMAC-signed record of before is refused by name."""
    ci, alice, mallory = (_key(tmp_path, n) for n in ("ci", "alice", "mallory"))
    (tmp_path / "trust.yaml").write_text(
        f"trusted_evaluators:\n  ci: {ci.public_text}\ntrusted_promoters:\n  alice: {alice.public_text}\n"
    )
    monkeypatch.setenv(trust.TRUST_ENV, str(tmp_path / "trust.yaml"))
    t = trust.load_trust()
    assert ci.id == signing.key_id(ci.public) and ci.id != alice.id
    record = signing.sign({"kind": "evidence", "accept_len": 2.5}, ci)
    assert signing.verify(record, trust.EVALUATOR, t) is None
    assert "not a trusted promoter" in signing.verify(record, trust.PROMOTER, t)
    by_alice = signing.sign({"kind": "evidence"}, alice)
    assert "signed by alice, a trusted promoter but not a trusted evaluator" in signing.verify(by_alice, "evaluator", t)
    assert "no trust list names" in signing.verify(signing.sign({"kind": "evidence"}, mallory), "evaluator", t)
    assert "bad signature" in signing.verify({**record, "accept_len": 3.5}, trust.EVALUATOR, t)
    narrowed = t.narrowed({"ci": ci.public, "mallory": mallory.public}, "a profile")  # adds nobody
    assert set(narrowed.evaluators) == {"ci"} and "no trust list names" in signing.verify(
        signing.sign({"kind": "evidence"}, mallory), trust.EVALUATOR, narrowed
    )
    hmac_era = {"kind": "evidence", "key_id": ci.id, "signature": "ab" * 32}
    assert "shared HMAC key" in signing.verify(hmac_era, trust.EVALUATOR, t)
    (tmp_path / "trust.yaml").chmod(0o666)
    with pytest.raises(BadInput, match="a trust file others can write is refused"):
        trust.load_trust()
    (tmp_path / "trust.yaml").chmod(0o644)
    (tmp_path / "trust.yaml").write_text("trusted_evaluators:\n  ci: ed25519:AAAA\n")
    with pytest.raises(BadInput, match=r"trusted_evaluators.ci: an Ed25519 public key is 32 bytes"):
        trust.load_trust()


def test_keys_are_made_by_a_command_never_overwritten(tmp_path):
    env = {**os.environ, "DRAFTEROPS_HOME": str(tmp_path)}
    made = subprocess.run([sys.executable, "-m", "steps.keys", "new", "ci"], env=env, capture_output=True, text=True)
    assert made.returncode == 0 and "ci: ed25519:" in made.stdout, made.stderr
    assert stat.S_IMODE((tmp_path / "keys" / "ci.key").stat().st_mode) == 0o600
    again = subprocess.run([sys.executable, "-m", "steps.keys", "new", "ci"], env=env, capture_output=True, text=True)
    assert again.returncode == 2 and "never overwritten" in again.stderr
    bad = subprocess.run([sys.executable, "-m", "steps.keys", "new", "../x"], env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "name '../x'" in bad.stderr
