"""Who may sign what: the public keys of a team's evaluators and promoters, each with a name.

The trust file (`DRAFTEROPS_TRUST_FILE`, else `$DRAFTEROPS_HOME/trust.yaml`) lists them:

    trusted_evaluators:            # may sign evaluation records and calibrated profiles
      ci: ed25519:...              # `python -m steps.keys show` prints this line
    trusted_promoters:             # may sign sanctions (alias moves by `promote` and `recertify`)
      alice: ed25519:...

A profile may name its own `trusted_evaluators`, which narrow the file's for evidence measured under it
(only keys both name count: a profile can never add a key). With no trust file at all, the one key this
process signs with is trusted for both roles (one person on one machine, as the mini world runs; a
process with neither a trust file nor a key verifies nothing, and says so). A team writes the file
(refused when others can write it), and one role's key never counts for the other.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from common.errors import BadInput
from registry import signing

TRUST_ENV = "DRAFTEROPS_TRUST_FILE"
EVALUATOR, PROMOTER = "evaluator", "promoter"
ROLES = {EVALUATOR: "trusted_evaluators", PROMOTER: "trusted_promoters"}


@dataclass(frozen=True)
class Trust:
    evaluators: dict[str, bytes] = field(default_factory=dict)  # name -> Ed25519 public key
    promoters: dict[str, bytes] = field(default_factory=dict)
    origin: str = ""

    def keys(self, role: str) -> dict[str, bytes]:
        return self.evaluators if role == EVALUATOR else self.promoters

    def name(self, role: str, kid: object) -> str | None:
        return next((n for n, pub in self.keys(role).items() if signing.key_id(pub) == kid), None)

    def public(self, role: str, kid: object) -> bytes | None:
        name = self.name(role, kid)
        return None if name is None else self.keys(role)[name]

    def refusal(self, role: str, kid: object) -> str:
        other = PROMOTER if role == EVALUATOR else EVALUATOR
        name = self.name(other, kid)
        if name is not None:
            return f"signed by {name}, a trusted {other} but not a trusted {role} ({self.origin})"
        return f"signed with a key no trust list names as {role} (key id {str(kid)[:16]}; {self.origin})"

    def narrowed(self, evaluators: dict[str, bytes], origin: str) -> Trust:
        """Only the evaluators both lists name: a profile can narrow whom it trusts, never add a key."""
        kept = {name: pub for name, pub in self.evaluators.items() if pub in evaluators.values()}
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
        mine = {"this machine": key.public}
        return Trust(mine, dict(mine), f"no trust file: only this machine's key {key.id} is trusted")
    if path.stat().st_mode & 0o022:
        raise BadInput(f"{path}: a trust file others can write is refused; chmod go-w it")
    try:
        raw = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError):
        raise BadInput(f"{path}: not valid YAML") from None
    if not isinstance(raw, dict):
        raise BadInput(f"{path}: expected a mapping with {' and '.join(ROLES.values())}")
    unknown = sorted(set(raw) - set(ROLES.values()))
    if unknown:
        raise BadInput(f"{path}: unknown field(s) {', '.join(unknown)}")
    lists = {role: parse_keys(raw.get(section) or {}, f"{path}: {section}") for role, section in ROLES.items()}
    return Trust(lists[EVALUATOR], lists[PROMOTER], f"trust file {path}")


def parse_keys(raw: object, where: str) -> dict[str, bytes]:
    """name -> public key, from a mapping of names to `ed25519:...` lines."""
    if not isinstance(raw, dict):
        raise BadInput(f"{where}: expected a mapping of names to public keys")
    out = {}
    for name, text in raw.items():
        if not isinstance(name, str) or not name.strip():
            raise BadInput(f"{where}: a key needs a name")
        out[name] = signing.parse_public(text, f"{where}.{name}")
    return out
