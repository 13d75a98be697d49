"""A version's description as the place a person reads its story: marked sections that the steps
replace in place (one per shape gate target, per evaluated profile, and the promotion verdict), so
the latest word of each stays on the version page without burying the rest."""

from __future__ import annotations

import re
from typing import Any


def upsert_section(text: str, key: str, body: str) -> str:
    """`text` with the section `key` replaced by `body`, or `body` appended as that section."""
    block = f"<!-- {key} -->\n{body.strip()}\n<!-- /{key} -->"
    pattern = re.compile(rf"<!-- {re.escape(key)} -->.*?<!-- /{re.escape(key)} -->", re.S)
    return pattern.sub(lambda _: block, text) if pattern.search(text) else f"{text}\n\n{block}".strip()


def set_section(c: Any, name: str, version: str, key: str, body: str) -> None:
    mv = c.get_model_version(name, version)
    c.update_model_version(name, version, description=upsert_section(mv.description or "", key, body))
