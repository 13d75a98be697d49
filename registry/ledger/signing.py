"""Signed records that a person with registry access can read but cannot mint, and that a team checks
against the public keys of the people allowed to make them.

A record is signed with an Ed25519 private key over its canonical JSON (sorted keys, no spaces, no NaN).
Private keys live in files only (`python -m steps.keys new NAME` makes one, mode 0600; a key file readable
by group or others is refused), never in the store: `DRAFTEROPS_SIGNING_KEY` names the file a process
signs with, else the local key `$DRAFTEROPS_HOME/keys/local.key` (default `~/.drafterops`) is made on
first use. A record carries its key id (a hash of the public key) and is checked against a trust file
(registry.ledger.trust) that lists `trusted_evaluators` (who may sign evidence and calibrations) and
`trusted_promoters` (who may sign sanctions), each with a name. Records signed with the shared HMAC key
of drafterops before Ed25519 are refused with a line that says so.
"""

from __future__ import annotations

import base64
import calendar
import contextlib
import hashlib
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.errors import BadInput

SIGNATURE = "signature"
KEY_ID = "key_id"
ALGORITHM = "alg"
ED25519 = "ed25519"
PUBLIC_PREFIX = "ed25519:"
KEY_ENV = "DRAFTEROPS_SIGNING_KEY"
CLOCK_SKEW_S = 300.0  # how far ahead of this host's clock a signer's clock may run before its records are refused
_ANNOUNCED: set[str] = set()
_USING: list[Key] = []  # keys `signing_with` holds, innermost last


def forget_process_state() -> None:
    """Forget which keys this process announced and which it was told to sign with, as a new process would."""
    _ANNOUNCED.clear()
    _USING.clear()


def home() -> Path:
    return Path(os.environ.get("DRAFTEROPS_HOME", Path.home() / ".drafterops"))


def key_id(public: bytes) -> str:
    """A public key's id: a hash of the public key, so anyone can derive it and nobody can choose it."""
    return hashlib.sha256(b"drafterops-ed25519:" + public).hexdigest()[:16]


def public_text(public: bytes) -> str:
    return PUBLIC_PREFIX + base64.b64encode(public).decode()


def parse_public(text: object, where: str) -> bytes:
    """`ed25519:<base64 of 32 bytes>`, as `steps.keys` prints it."""
    if not isinstance(text, str) or not text.startswith(PUBLIC_PREFIX):
        raise BadInput(f"{where}: a public key is written '{PUBLIC_PREFIX}<base64>' (python -m steps.keys show)")
    try:
        raw = base64.b64decode(text.removeprefix(PUBLIC_PREFIX), validate=True)
    except ValueError:
        raise BadInput(f"{where}: the public key is not base64") from None
    if len(raw) != 32:
        raise BadInput(f"{where}: an Ed25519 public key is 32 bytes, got {len(raw)}")
    return raw


@dataclass(frozen=True)
class Key:
    """A private signing key and where it came from (for messages); its public half is what others trust."""

    private: Any  # cryptography's Ed25519PrivateKey
    origin: str

    @property
    def public(self) -> bytes:
        from cryptography.hazmat.primitives import serialization

        return self.private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    @property
    def id(self) -> str:
        return key_id(self.public)

    @property
    def public_text(self) -> str:
        return public_text(self.public)


def generate() -> Any:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return Ed25519PrivateKey.generate()


def private_pem(private: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def local_key_path() -> Path:
    return home() / "keys" / "local.key"


@contextlib.contextmanager
def signing_with(key: Key) -> Iterator[Key]:
    """Within the block, this process signs with `key` (recertify: the evaluator's key for the evaluation it
    runs, the promoter's, its own signing key, for the sanction)."""
    _USING.append(key)
    try:
        yield key
    finally:
        _USING.pop()


def load_key(create: bool = True) -> Key:
    """The key this process signs with: the one `signing_with` holds, else the file `DRAFTEROPS_SIGNING_KEY`
    names, else the local key (made once, and said so once). A named file that is missing, unreadable as a
    key, or readable by group or others is refused, never replaced."""
    if _USING:
        return _USING[-1]
    named = os.environ.get(KEY_ENV)
    if named is not None:
        if not named.strip():
            raise BadInput(f"{KEY_ENV} is set but empty: name a key file made by `python -m steps.keys new`")
        path = Path(named)
        if not path.is_file():
            raise BadInput(f"{path}: {KEY_ENV} names no file")
        return Key(read_private(path), str(path))
    path = local_key_path()
    if path.is_file():
        return Key(read_private(path), str(path))
    if not create:
        raise BadInput(f"no signing key: set {KEY_ENV} or run `python -m steps.keys new local`")
    if write_private(path, generate()) and str(path) not in _ANNOUNCED:  # said by its maker only
        _ANNOUNCED.add(str(path))
        print(
            f"drafterops: created a local signing key at {path} (0600). With no trust file, only records signed "
            "with it count here; a team lists its evaluators' and promoters' public keys in a trust file "
            "(docs/promotion.md#keys-and-trust).",
            file=sys.stderr,
        )
    return Key(read_private(path), str(path))


def write_private(path: Path, private: Any) -> bool:
    """Write a new private key to `path` (0600), whole or not at all; False when one was there first.
    Staged under another name and linked into place: a process starting at the same moment sees no key
    or the whole key, and the first link wins."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    pem = private_pem(private)
    fd, staged = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        _write_synced(fd, pem)  # mkstemp's file is 0600
        try:
            os.link(staged, path)
        except FileExistsError:
            return False
        except OSError:  # a filesystem without hard links: create it in place, the first O_EXCL wins
            try:
                out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                return False
            _write_synced(out, pem)
    finally:
        os.unlink(staged)
    return True


def _write_synced(fd: int, data: bytes) -> None:
    """The key on disk before anyone can read it under its name (a crash leaves no empty key)."""
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def read_private(path: Path) -> Any:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    if not path.is_file():
        raise BadInput(f"{path}: no such key file")
    if path.stat().st_mode & 0o077:
        raise BadInput(f"{path}: a signing key readable by group or others is refused; chmod 600 it")
    data = path.read_bytes()
    if not data.strip():
        raise BadInput(f"{path}: the signing key file is empty")
    try:
        private = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        raise BadInput(
            f"{path}: not an unencrypted PEM private key (make one with `python -m steps.keys new NAME`)"
        ) from None
    if not isinstance(private, Ed25519PrivateKey):
        raise BadInput(f"{path}: not an Ed25519 key")
    return private


def canonical(payload: dict[str, Any]) -> bytes:
    """The bytes that are signed: everything but the signature, in one spelling."""
    return _spelled({k: v for k, v in payload.items() if k != SIGNATURE})


def _spelled(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def digest(payload: dict[str, Any]) -> str:
    """sha256 of a signed record as signed (signature included): what a later record names it by."""
    return hashlib.sha256(_spelled(payload)).hexdigest()


def sign(payload: dict[str, Any], key: Key | None = None) -> dict[str, Any]:
    """The payload with its algorithm, key id and signature added."""
    key = key or load_key()
    out = {**payload, ALGORITHM: ED25519, KEY_ID: key.id}
    out[SIGNATURE] = base64.b64encode(key.private.sign(canonical(out))).decode()
    return out


def verify(payload: dict[str, Any], role: str, trust: Any) -> str | None:
    """None when the signature holds under a key `trust` (registry.ledger.trust) lists for `role` ("evaluator"
    or "promoter"); else why not, in a few words."""
    sig = payload.get(SIGNATURE)
    if not isinstance(sig, str) or not sig:
        return "unsigned"
    if payload.get(ALGORITHM) != ED25519:
        return "signed with the shared HMAC key of drafterops before Ed25519 keys, which no longer counts " \
               "(re-evaluate, or re-promote, under an Ed25519 key)"  # fmt: skip
    ahead = dated_ahead(payload)
    if ahead:
        return f"dated {ahead:.0f} s after now (more than the {CLOCK_SKEW_S:.0f} s clocks may differ by)"
    kid = payload.get(KEY_ID)
    found = trust.entry(role, kid)
    if found is None:
        return trust.refusal(role, kid)
    name, trusted = found
    if trusted.retired is not None:
        when = signed_time(payload)
        if when is None or when >= trusted.retired:
            retired = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(trusted.retired))
            return f"signed by {name} with a key retired on {retired}, " + (
                "and it carries no time it was signed" if when is None else "after it was retired"
            )
    public = trusted.public
    try:
        body = canonical(payload)
        raw = base64.b64decode(sig, validate=True)
    except (TypeError, ValueError):
        return "not canonical JSON"
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        Ed25519PublicKey.from_public_bytes(public).verify(raw, body)
    except InvalidSignature:
        return "bad signature (the record was changed after signing)"
    return None


def dated_ahead(payload: dict[str, Any], now: float | None = None) -> float:
    """How far after now a record is dated, when that is more than the clock skew allowed; 0 when it is not.
    A record from the future would outlive a retirement made before its date: it counts for nothing."""
    now = time.time() if now is None else now
    when = signed_time(payload)
    if when is None:
        return 0.0
    if "at" not in payload and "created" not in payload:
        when -= 86399.0  # a calibration's day counts from its start here
    return when - now if when - now > CLOCK_SKEW_S else 0.0


PARAM_LIMIT = 6000  # MLflow's longest param value


def as_param(record: dict[str, Any], name: str) -> dict[str, str]:
    """A signed record as a run param named `name`, where it fits: a file can be overwritten or deleted, a param
    cannot, so the record survives damage to its file ({} when it is too long for a param)."""
    text = json.dumps(record, sort_keys=True, separators=(",", ":"))
    return {name: text} if len(text) <= PARAM_LIMIT else {}


def signed_time(payload: dict[str, Any]) -> float | None:
    """When a record says it was signed (a sanction's `at`, an evaluation's `created`, a calibration's
    date), in epoch seconds; None when it says nothing that reads as a time."""
    for key in ("at", "created"):
        value = payload.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    date = (payload.get("measured") or {}).get("date") if isinstance(payload.get("measured"), dict) else None
    try:  # a calibration is dated to the day (UTC): it counts as signed at that day's end
        return calendar.timegm(time.strptime(str(date), "%Y-%m-%d")) + 86399.0 if date else None
    except ValueError:
        return None
