"""Who may sign what: the public keys of a team's evaluators and promoters, each with a name.

The trust file (`DRAFTEROPS_TRUST_FILE`, else `$DRAFTEROPS_HOME/trust.yaml`) lists them:

    trusted_evaluators:            # may sign evaluation records and calibrated profiles
      ci: ed25519:...              # `python -m steps.keys show` prints this line
    trusted_promoters:             # may sign sanctions (alias moves by `promote` and `recertify`)
      bob: ed25519:...
      alice: {key: "ed25519:...", retired: 2026-12-05}   # rotated out: what she signed before stays valid

A key is **retired** (a rotation: its holder left, or was given a new key) by writing the date beside it:
records it signed before that date (a sanction's `at`, an evaluation's `created`, a calibration's date)
still count, so production is never cleared by a rotation and "not worse than production" still has its
holder; nothing it signs from that date counts, and no step signs with it. A key **removed** from the file
is revoked: nothing it ever signed counts (what to do with a key that leaked).

A profile may name its own `trusted_evaluators`, which narrow the file's for evidence measured under it
(only keys both name count: a profile can never add a key). With no trust file at all, the one key this
process signs with is trusted for both roles (one person on one machine, as the mini world runs; a
process with neither a trust file nor a key verifies nothing, and says so).

The file is refused, in one line, when it is ambiguous (a name twice in one list, one key under two names
of one role) or when someone other than this user could have written it: the file and its folder must be
owned by this user or root and writable by nobody else (the rule `ssh` holds `authorized_keys` to).
"""

from __future__ import annotations

import datetime as dt
import os
import stat
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from common.errors import BadInput
from registry.ledger import signing

TRUST_ENV = "DRAFTEROPS_TRUST_FILE"
EVALUATOR, PROMOTER = "evaluator", "promoter"
ROLES = {EVALUATOR: "trusted_evaluators", PROMOTER: "trusted_promoters"}


@dataclass(frozen=True)
class TrustedKey:
    public: bytes  # an Ed25519 public key
    retired: float | None = None  # epoch seconds from which nothing it signs counts (None: in service)


@dataclass(frozen=True)
class Trust:
    evaluators: dict[str, TrustedKey] = field(default_factory=dict)  # name -> key
    promoters: dict[str, TrustedKey] = field(default_factory=dict)
    origin: str = ""

    def keys(self, role: str) -> dict[str, TrustedKey]:
        return self.evaluators if role == EVALUATOR else self.promoters

    def entry(self, role: str, kid: object) -> tuple[str, TrustedKey] | None:
        """The name and key this role lists under key id `kid`, retired or not."""
        return next(((n, k) for n, k in self.keys(role).items() if signing.key_id(k.public) == kid), None)

    def name(self, role: str, kid: object) -> str | None:
        """The name of a key in service for `role` (a retired key signs nothing new)."""
        found = self.entry(role, kid)
        return found[0] if found is not None and found[1].retired is None else None

    def refusal(self, role: str, kid: object) -> str:
        other = PROMOTER if role == EVALUATOR else EVALUATOR
        found = self.entry(other, kid)
        if found is not None:
            return f"signed by {found[0]}, a trusted {other} but not a trusted {role} ({self.origin})"
        return f"signed with a key no trust list names as {role} (key id {str(kid)[:16]}; {self.origin}); a " \
               "key rotated out is kept in the trust file with the date it was retired"  # fmt: skip

    def narrowed(self, evaluators: dict[str, TrustedKey | bytes], origin: str) -> Trust:
        """Only the evaluators both lists name: a profile can narrow whom it trusts, never add a key."""
        theirs = {k.public if isinstance(k, TrustedKey) else k for k in evaluators.values()}
        kept = {name: key for name, key in self.evaluators.items() if key.public in theirs}
        return replace(self, evaluators=kept, origin=f"{self.origin}, narrowed by {origin}")


def trust_path() -> Path | None:
    named = os.environ.get(TRUST_ENV)
    if named is not None:
        if not Path(named).is_file():
            raise BadInput(f"{named}: {TRUST_ENV} names no file")
        return Path(named)
    default = signing.home() / "trust.yaml"
    return default if default.is_file() else None


def load_trust() -> Trust:
    """The trust file's keys; with none, this process's own signing key for both roles."""
    path = trust_path()
    if path is None:
        try:  # checking a signature never makes a key: a guard under another user would trust nothing
            key = signing.load_key(create=False)
        except BadInput:
            raise BadInput(
                f"no trust file ({TRUST_ENV} or {signing.home() / 'trust.yaml'}) and no signing key here: nothing "
                "can be verified; write the team's trust file (docs/promotion.md#keys-and-trust)"
            ) from None
        mine = {"this machine": TrustedKey(key.public)}
        return Trust(mine, dict(mine), f"no trust file: only this machine's key {key.id} is trusted")
    check_ownership(path)
    try:
        raw = yaml.load(path.read_text(), Loader=_UniqueKeys)  # noqa: S506 (a SafeLoader that refuses repeats)
    except _Repeated as exc:
        raise BadInput(f"{path}: {exc}; the trust file is ambiguous, nothing was read from it") from None
    except (yaml.YAMLError, UnicodeDecodeError):
        raise BadInput(f"{path}: not valid YAML") from None
    if not isinstance(raw, dict):
        raise BadInput(f"{path}: expected a mapping with {' and '.join(ROLES.values())}")
    unknown = sorted(set(raw) - set(ROLES.values()))
    if unknown:
        raise BadInput(f"{path}: unknown field(s) {', '.join(unknown)}")
    lists = {role: parse_keys(raw.get(section) or {}, f"{path}: {section}") for role, section in ROLES.items()}
    return Trust(lists[EVALUATOR], lists[PROMOTER], f"trust file {path}")


def require_in_service(role: str, then: str = "") -> None:
    """This process's signing key is listed for `role` and not retired, by the trust file as it reads now (a
    long-running service asks before every signature); BadInput saying so, and `then` (what follows), if not."""
    key, trust = signing.load_key(), load_trust()
    if trust.name(role, key.id) is None:
        raise BadInput(f"{key.origin}: signing key {key.id} is not a trusted {role} in service ({trust.origin})"
                       + (f"; {then}" if then else ""))  # fmt: skip


def check_ownership(path: Path) -> None:
    """The trust file and its folder (and, for a link, where it points) owned by this user or root and
    writable by no one else: anyone else who can write either can make themselves a promoter."""
    me = os.geteuid()
    places = [path, path.parent, path.resolve(), path.resolve().parent]
    for place in dict.fromkeys(places):
        st = place.stat()
        what = "folder" if stat.S_ISDIR(st.st_mode) else "file"
        where = f"{path}: the trust file" + (f"'s folder {place}" if what == "folder" else "")
        if st.st_uid not in (me, 0):
            raise BadInput(f"{where} is owned by uid {st.st_uid}, not by this user ({me}) or root; refused")
        if st.st_mode & 0o022:
            raise BadInput(
                f"{where} can be written by group or others (mode {st.st_mode & 0o777:o}): a trust file "
                "others can write is refused; chmod go-w it"
            )


def parse_keys(raw: object, where: str) -> dict[str, TrustedKey]:
    """name -> key, from a mapping of names to `ed25519:...` lines or `{key: ..., retired: DATE}`; one key
    under two names is refused (which name signed what would be ambiguous)."""
    if not isinstance(raw, dict):
        raise BadInput(f"{where}: expected a mapping of names to public keys")
    out: dict[str, TrustedKey] = {}
    for name, entry in raw.items():
        if not isinstance(name, str) or not name.strip():
            raise BadInput(f"{where}: a key needs a name")
        out[name] = _entry(entry, f"{where}.{name}")
        twice = [other for other, key in out.items() if other != name and key.public == out[name].public]
        if twice:
            raise BadInput(f"{where}: one key is listed as both {twice[0]} and {name}; list each key once")
    return out


def _entry(entry: object, where: str) -> TrustedKey:
    if not isinstance(entry, dict):
        return TrustedKey(signing.parse_public(entry, where))
    unknown = sorted(set(entry) - {"key", "retired"})
    if unknown or "key" not in entry:
        raise BadInput(f"{where}: a key is written 'ed25519:...' or {{key: 'ed25519:...', retired: YYYY-MM-DD}}")
    retired = entry.get("retired")
    moment = None if retired is None else parse_moment(retired, f"{where}.retired")
    if moment is not None and moment > time.time() + signing.CLOCK_SKEW_S:
        raise BadInput(f"{where}.retired: {retired} is in the future; a key retired ahead of time still signs until "
                       "then: write the date it is retired on, when it is")  # fmt: skip
    return TrustedKey(signing.parse_public(entry["key"], f"{where}.key"), moment)


def parse_moment(value: object, where: str) -> float:
    """A retirement date (00:00 UTC that day) or time, as epoch seconds."""
    if isinstance(value, str):
        try:
            value = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            raise BadInput(f"{where}: {value!r} is not a date (YYYY-MM-DD)") from None
    if isinstance(value, dt.datetime):
        return (value if value.tzinfo else value.replace(tzinfo=dt.timezone.utc)).timestamp()
    if isinstance(value, dt.date):
        return dt.datetime(value.year, value.month, value.day, tzinfo=dt.timezone.utc).timestamp()
    raise BadInput(f"{where}: expected a date (YYYY-MM-DD), got {value!r}")


class _Repeated(Exception):
    pass


class _UniqueKeys(yaml.SafeLoader):
    """YAML's safe loader, except that a name given twice in one mapping is an error, not the last one."""

    def construct_mapping(self, node, deep=False):  # type: ignore[no-untyped-def]
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise _Repeated(f"{key!r} is listed twice (line {key_node.start_mark.line + 1})")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)
