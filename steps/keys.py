"""`keys`: make and show Ed25519 signing keys (evaluators sign evidence and calibrations, promoters sign
alias moves). A private key is generated here, never typed, written 0600 and never sent to the store;
its public line goes into the team's trust file (docs/promotion.md#keys-and-trust).

    python -m steps.keys new ci                 # ~/.drafterops/keys/ci.key, prints its public line
    python -m steps.keys new alice --out /secure/alice.key
    python -m steps.keys show                   # the key this process signs with (DRAFTEROPS_SIGNING_KEY)
    python -m steps.keys show /secure/alice.key
    python -m steps.keys retire alice           # in the trust file: alice's key retired now (what it signed stays)
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import tempfile
import time
from pathlib import Path

from cli.step import parser, run_step
from common.errors import BadInput
from registry.ledger import signing
from registry.ledger.trust import load_trust, parse_moment, trust_path

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def build() -> argparse.ArgumentParser:
    p = parser("keys", __doc__)
    sub = p.add_subparsers(dest="command", required=True)
    new = sub.add_parser("new", help="generate a private key file (0600) and print its public line")
    new.add_argument("name", help="who holds it (letters, digits, . _ -), the name trust files list it under")
    new.add_argument("--out", default="", help="where to write it (default: $DRAFTEROPS_HOME/keys/NAME.key)")
    show = sub.add_parser("show", help="print a key's id and public line")
    show.add_argument("path", nargs="?", default="", help="a private key file (default: the signing key)")
    retire = sub.add_parser("retire", help="retire a key in the trust file: what it signed before stays valid")
    retire.add_argument("name", help="the name the trust file lists the key under (in every role that lists it)")
    retire.add_argument("--at", default="", help="when (ISO 8601; default: now)")
    return p


def run(args: argparse.Namespace) -> int:
    if args.command == "new":
        if not NAME.match(args.name):
            raise BadInput(f"name {args.name!r}: use 1-64 letters, digits, '.', '_' or '-'")
        path = Path(args.out) if args.out else signing.home() / "keys" / f"{args.name}.key"
        if path.exists():
            raise BadInput(f"{path}: exists; a key is never overwritten (choose another --out)")
        if not signing.write_private(path, signing.generate()):
            raise BadInput(f"{path}: another process wrote a key there first")
        key = signing.Key(signing.read_private(path), str(path))
        print(f"wrote {path} (0600); sign with it: export {signing.KEY_ENV}={path}")
        print(f"its public line, for the trust file's trusted_evaluators or trusted_promoters:\n  {args.name}: "
              f"{key.public_text}")  # fmt: skip
        return 0
    if args.command == "retire":
        return retire(args.name, args.at)
    key = signing.Key(signing.read_private(Path(args.path)), args.path) if args.path else signing.load_key()
    print(f"{key.origin}: key id {key.id}\n  {key.public_text}")
    return 0


def retire(name: str, at: str) -> int:
    """Rewrite `name: ed25519:...` as `name: {key: ..., retired: ...}` in the trust file, comments and all other
    lines as they were; the result is read back as a trust file before it replaces the old one."""
    path = trust_path()
    if path is None:
        raise BadInput(
            f"no trust file ({'DRAFTEROPS_TRUST_FILE'} or {signing.home() / 'trust.yaml'}) to retire a key in"
        )
    when = at or dt.datetime.now(dt.timezone.utc).isoformat()
    moment = parse_moment(when, "--at")
    if moment > time.time() + signing.CLOCK_SKEW_S:
        raise BadInput(f"--at {at}: in the future; a key is retired when it is (until then it signs as any key in "
                       "service), so retire it then")  # fmt: skip
    path = path.resolve()  # a link (the team's shared file) is written through to its target, never replaced
    line = re.compile(rf"^(\s+){re.escape(name)}:\s*(ed25519:[A-Za-z0-9+/=]+)\s*(#.*)?$")
    text = path.read_text().splitlines(keepends=True)
    changed = [i for i, row in enumerate(text) if line.match(row.rstrip("\n"))]
    if not changed:
        raise BadInput(f"{path}: no key in service is listed as {name!r} (a retired one already carries its date)")
    for i in changed:
        m = line.match(text[i].rstrip("\n"))
        text[i] = f'{m[1]}{name}: {{key: "{m[2]}", retired: "{when}"}}' + (f"  {m[3]}" if m[3] else "") + "\n"
    fd, staged = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as fh:
        fh.write("".join(text))
    os.chmod(staged, path.stat().st_mode & 0o777)
    saved = path.read_text()
    os.replace(staged, path)
    try:
        load_trust()  # what was written reads as a trust file, or the old one goes back
    except BadInput:
        path.write_text(saved)
        raise
    print(f"{path}: {name}'s key retired at {when} in {len(changed)} list(s); what it signed before stays valid")
    return 0


def main(argv: list[str] | None = None) -> None:
    run_step("keys", build, run, argv)


if __name__ == "__main__":
    main()
