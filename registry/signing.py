"""Signed records: evidence that a person with registry access can read but cannot mint.

A record is signed with HMAC-SHA256 over its canonical JSON (sorted keys, no spaces, no NaN) with a key
that only the processes allowed to produce evidence hold: `DRAFTEROPS_EVIDENCE_KEY` (the key itself),
else `DRAFTEROPS_EVIDENCE_KEY_FILE` (a file holding it), else a local key created on first use under
`$DRAFTEROPS_HOME` (default `~/.drafterops`) with mode 0600. A team keeps the key where evaluations run
(CI) and nowhere else. The key's id (a hash of it, never the key) travels in the record, so a refusal can
say "signed with another key" rather than only "bad signature".
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.errors import BadInput

SIGNATURE = "signature"
KEY_ID = "key_id"
_ANNOUNCED: set[str] = set()


def forget_process_state() -> None:
    """Forget which keys this process announced, as a new process would."""
    _ANNOUNCED.clear()


def home() -> Path:
    return Path(os.environ.get("DRAFTEROPS_HOME", Path.home() / ".drafterops"))


@dataclass(frozen=True)
class Key:
    secret: bytes
    origin: str  # where it came from, for messages

    @property
    def id(self) -> str:
        return hashlib.sha256(b"drafterops-key-id:" + self.secret).hexdigest()[:16]


MIN_KEY_BYTES = 32  # a key shorter than this could be guessed from the key id every record carries


def load_key(create: bool = True) -> Key:
    """The configured key; a local one is created (once, and said so once) where none is configured. A key
    set but empty, shorter than MIN_KEY_BYTES, or in a file others can read is refused, never replaced."""
    if "DRAFTEROPS_EVIDENCE_KEY" in os.environ:
        return Key(_checked(os.environ["DRAFTEROPS_EVIDENCE_KEY"].strip().encode(), "DRAFTEROPS_EVIDENCE_KEY"),
                   "$DRAFTEROPS_EVIDENCE_KEY")  # fmt: skip
    named = os.environ.get("DRAFTEROPS_EVIDENCE_KEY_FILE")
    path = Path(named) if named else home() / "evidence.key"
    if path.is_file():
        return Key(_read_key(path), str(path))
    if named:
        raise BadInput(f"{path}: DRAFTEROPS_EVIDENCE_KEY_FILE names no file")
    if not create:
        raise BadInput(f"no evidence key: set DRAFTEROPS_EVIDENCE_KEY or create {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    # written whole (and synced) under another name, then linked into place: a process starting at the same
    # moment sees no key or the whole key, never an empty file, and the first link wins
    secret = os.urandom(32).hex() + "\n"
    fd, staged = tempfile.mkstemp(dir=path.parent, prefix=".evidence.key.")
    try:
        _write_synced(fd, secret)  # mkstemp's file is 0600
        try:
            os.link(staged, path)
        except FileExistsError:  # another process created it first: use theirs
            return Key(_read_key(path), str(path))
        except OSError:  # a filesystem without hard links: create it in place, first O_EXCL wins
            if not _create_exclusively(path, secret):
                return Key(_read_key(path), str(path))
    finally:
        os.unlink(staged)
    if str(path) not in _ANNOUNCED:
        _ANNOUNCED.add(str(path))
        print(
            f"drafterops: created a local evidence key at {path} (0600); evidence signed with it is trusted only "
            "where this key is. A team sets DRAFTEROPS_EVIDENCE_KEY where evaluations run, and nowhere else.",
            file=sys.stderr,
        )
    return Key(_read_key(path), str(path))


def _create_exclusively(path: Path, secret: str) -> bool:
    """Write the key to `path` unless it exists (False: another process made it)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    _write_synced(fd, secret)
    return True


def _write_synced(fd: int, secret: str) -> None:
    """The key on disk before anyone can read it under its name (a crash leaves no empty key)."""
    with os.fdopen(fd, "w") as fh:
        fh.write(secret)
        fh.flush()
        os.fsync(fh.fileno())


def _read_key(path: Path) -> bytes:
    if path.stat().st_mode & 0o077:
        raise BadInput(f"{path}: an evidence key readable by group or others is refused; chmod 600 it")
    return _checked(path.read_bytes().strip(), str(path))


def _checked(secret: bytes, where: str) -> bytes:
    if not secret:
        raise BadInput(f"{where}: the evidence key is set but empty")
    if len(secret) < MIN_KEY_BYTES:
        raise BadInput(
            f"{where}: an evidence key needs at least {MIN_KEY_BYTES} bytes (got {len(secret)}); "
            "`python -c 'import os; print(os.urandom(32).hex())'` makes one"
        )
    return secret


def canonical(payload: dict[str, Any]) -> bytes:
    """The bytes that are signed: everything but the signature, in one spelling."""
    body = {k: v for k, v in payload.items() if k != SIGNATURE}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def sign(payload: dict[str, Any], key: Key | None = None) -> dict[str, Any]:
    """The payload with its key id and signature added."""
    key = key or load_key()
    out = {**payload, KEY_ID: key.id}
    out[SIGNATURE] = hmac.new(key.secret, canonical(out), hashlib.sha256).hexdigest()
    return out


def verify(payload: dict[str, Any], key: Key | None = None) -> str | None:
    """None when the signature holds under the configured key; else why not, in a few words."""
    sig = payload.get(SIGNATURE)
    if not isinstance(sig, str) or not sig:
        return "unsigned"
    key = key or load_key()
    if payload.get(KEY_ID) != key.id:
        return f"signed with another key (id {str(payload.get(KEY_ID))[:16]}, this key is {key.id})"
    try:
        body = canonical(payload)
    except (TypeError, ValueError):
        return "not canonical JSON"
    expected = hmac.new(key.secret, body, hashlib.sha256).hexdigest()
    return None if hmac.compare_digest(expected, sig) else "bad signature (the record was changed after signing)"
