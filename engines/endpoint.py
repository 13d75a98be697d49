"""A serving engine's endpoint as the production watch reads it: its counters, the names it serves under
and its version, each read over HTTP with a short timeout.

vLLM lists its served names at /v1/models (`export`'s serve.sh adds the drafter's digest as a second
name, `drafterops-<sha256[:16]>` of the files the engine loads: so the watch can tell which drafter a
server runs) and its version at /version; SGLang its model at /get_model_info and its version at
/get_server_info.
"""

from __future__ import annotations

import hashlib
import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from engines.exposition import Scrape, parse

TAG = "drafterops-"
NOT_LOADED = {"serve.sh", "EXPORT.md"}  # written beside the drafter, never read by the engine


class Unreachable(OSError):
    """The endpoint did not answer (down, refused, timed out)."""


@dataclass(frozen=True)
class Reading:
    scrape: Scrape
    served: tuple[str, ...]  # the names the server answers to
    version: str  # the engine's own version string ("" when it does not say)


def export_digest(folder: Path) -> str:
    """sha256 over the files an engine loads from an exported drafter folder, by name."""
    h = hashlib.sha256()
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file() and p.name not in NOT_LOADED):
        h.update(str(path.relative_to(folder)).encode() + b"\0")
        h.update(hashlib.sha256(path.read_bytes()).hexdigest().encode() + b"\n")
    return h.hexdigest()


def drafter_name(digest: str) -> str:
    """The extra served name that says which drafter a server runs."""
    return TAG + digest[:16]


def get(url: str, timeout: float = 10.0) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read()
    except urllib.error.HTTPError as exc:
        raise Unreachable(f"{url}: HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        raise Unreachable(f"{url}: {getattr(exc, 'reason', exc)}") from None


def read(base: str, timeout: float = 10.0) -> Reading:
    """One reading: /metrics (NotExposition when it is not an engine's), the served names, the version."""
    scrape = parse(get(f"{base}/metrics", timeout).decode(errors="replace"))
    served: tuple[str, ...] = ()
    version = ""
    if scrape.engine == "vllm":
        served = tuple(str(m.get("id")) for m in _json(base, "/v1/models", timeout).get("data", []) or [])
        version = str(_json(base, "/version", timeout).get("version", ""))
    else:
        info = _json(base, "/get_model_info", timeout)
        served = tuple(str(v) for v in (info.get("served_model_name"), info.get("model_path")) if v)
        version = str(_json(base, "/get_server_info", timeout).get("version", ""))
    return Reading(scrape, served, version)


def _json(base: str, path: str, timeout: float) -> dict:
    try:
        value = json.loads(get(f"{base}{path}", timeout))
    except (Unreachable, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
