"""The local evidence key: made once, 0600, whole for every process that starts at the same moment, and
made on a filesystem without hard links too."""

import os
import stat
import subprocess
import sys

from registry import signing


def test_processes_starting_together_share_one_whole_key(tmp_path):
    read = "from registry import signing; print(signing.load_key().secret.decode())"
    env = {**os.environ, "DRAFTEROPS_HOME": str(tmp_path)}
    env.pop("DRAFTEROPS_EVIDENCE_KEY", None)
    procs = [subprocess.Popen([sys.executable, "-c", read], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(4)]  # fmt: skip
    outs = [p.communicate(timeout=120) for p in procs]
    secrets = {out.strip() for out, _ in outs}
    assert len(secrets) == 1 and len(secrets.pop()) == 64, outs
    assert sum("created a local evidence key" in err for _, err in outs) == 1  # said once, by its maker
    assert os.listdir(tmp_path) == ["evidence.key"]  # no staged file left behind
    assert stat.S_IMODE((tmp_path / "evidence.key").stat().st_mode) == 0o600


def test_a_filesystem_without_hard_links_still_gets_its_key(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTEROPS_HOME", str(tmp_path))
    monkeypatch.delenv("DRAFTEROPS_EVIDENCE_KEY", raising=False)
    monkeypatch.delenv("DRAFTEROPS_EVIDENCE_KEY_FILE", raising=False)

    def no_links(src, dst):
        raise OSError(95, "Operation not supported")

    monkeypatch.setattr(os, "link", no_links)
    key = signing.load_key()
    assert signing.load_key().secret == key.secret and len(key.secret) == 64
    assert os.listdir(tmp_path) == ["evidence.key"]
    assert stat.S_IMODE((tmp_path / "evidence.key").stat().st_mode) == 0o600


def test_a_weak_empty_or_exposed_key_is_refused_never_replaced(tmp_path, monkeypatch):
    """A key set but empty used to fall back to the local key; a short one or one in a file others can read
    used to sign anyway: each is now bad input naming where the key came from."""
    import pytest

    from common.errors import BadInput

    monkeypatch.setenv("DRAFTEROPS_HOME", str(tmp_path))
    monkeypatch.delenv("DRAFTEROPS_EVIDENCE_KEY_FILE", raising=False)
    monkeypatch.setenv("DRAFTEROPS_EVIDENCE_KEY", "")
    with pytest.raises(BadInput, match="DRAFTEROPS_EVIDENCE_KEY: the evidence key is set but empty"):
        signing.load_key()
    assert not (tmp_path / "evidence.key").exists()  # no local key made in its place
    monkeypatch.setenv("DRAFTEROPS_EVIDENCE_KEY", "hunter2-hunter2")
    with pytest.raises(BadInput, match="needs at least 32 bytes"):
        signing.load_key()
    monkeypatch.setenv("DRAFTEROPS_EVIDENCE_KEY", os.urandom(32).hex())
    assert len(signing.load_key().secret) == 64
    monkeypatch.delenv("DRAFTEROPS_EVIDENCE_KEY")
    exposed = tmp_path / "team.key"
    exposed.write_text(os.urandom(32).hex())
    exposed.chmod(0o644)
    monkeypatch.setenv("DRAFTEROPS_EVIDENCE_KEY_FILE", str(exposed))
    with pytest.raises(BadInput, match="readable by group or others is refused"):
        signing.load_key()
    exposed.chmod(0o600)
    assert signing.load_key().origin == str(exposed)
