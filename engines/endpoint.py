"""A serving engine's endpoint as the production watch reads it: its counters, the names it serves under
and its version, read over HTTP as one reading with one deadline for the whole of it.

vLLM lists its served names at /v1/models (`export`'s serve.sh adds the drafter's digest as a second
name, `drafterops-<sha256[:16]>` of the files the engine loads: so the watch can tell which drafter a
server runs) and its version at /version; SGLang its model at /get_model_info and its version at
/get_server_info.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import time
import urllib.error
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from common.deadline import Late, fetch
from common.errors import BadInput
from engines.exposition import Scrape, engine_of, families, parse

TAG = "drafterops-"
NOT_LOADED = {"serve.sh", "EXPORT.md", "speculation_profile.json"}  # written beside the drafter, never read by it


DEADLINE_S = 10.0  # a whole reading (three answers) within this, or the endpoint counts as down


class Unreachable(OSError):
    """The endpoint did not answer, or not whole within the deadline (down, refused, dripping)."""


class TooSlow(Unreachable):
    """The endpoint answered, but not whole within the deadline."""


class Malformed(ValueError):
    """An answer that is not what the engine's API returns (a model list that is no list of models)."""


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


def get(url: str, timeout: float = DEADLINE_S) -> bytes:
    """One answer, whole within `timeout` seconds (a server that drips its answer is as good as down)."""
    try:
        return fetch(url, timeout)
    except urllib.error.HTTPError as exc:
        raise Unreachable(f"{url}: HTTP {exc.code}") from None
    except Late as exc:
        raise TooSlow(f"{url}: {exc}") from None
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as exc:
        # ValueError: a URL http.client cannot use, or an answer over the size limit; HTTPException: a reply
        # that is no HTTP (a bad status line, too many or too long headers, a chunk cut short)
        raise Unreachable(f"{url}: {getattr(exc, 'reason', exc) or type(exc).__name__}") from None


def read(base: str, timeout: float = DEADLINE_S) -> Reading:
    """One reading, whole within `timeout` seconds: /metrics (NotExposition when it is not an engine's, only
    the samples for the names the server answers to), the served names, the version. Malformed when an
    answer is not what the engine's API returns."""
    end = time.monotonic() + timeout

    def left() -> float:
        remaining = end - time.monotonic()
        if remaining <= 0:
            raise TooSlow(f"{base}: no whole reading within {timeout:g} s")
        return remaining

    try:
        parsed = families(get(f"{base}/metrics", left()).decode(errors="replace"))
        engine = engine_of(parsed)
        left()  # parsing counts against the same deadline
        if engine == "vllm":
            served = _names(_json(base, "/v1/models", left()).get("data", []), f"{base}/v1/models")
            version = _json(base, "/version", left()).get("version", "")
        else:
            info = _json(base, "/get_model_info", left())
            served = tuple(str(v) for v in (info.get("served_model_name"), info.get("model_path")) if v)
            version = _json(base, "/get_server_info", left()).get("version", "")
    except TooSlow:
        raise TooSlow(f"{base}: no whole reading within {timeout:g} s") from None
    scrape = parse(parsed, served)
    left()
    return Reading(scrape, served, str(version) if isinstance(version, (str, int, float)) else "")


def _names(data: object, where: str) -> tuple[str, ...]:
    """The ids of an OpenAI-style model list: a list of objects, each with a string id."""
    if not isinstance(data, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in data):
        raise Malformed(f"{where}: `data` is not a list of models with string ids")
    return tuple(m["id"] for m in data)


def _json(base: str, path: str, timeout: float) -> dict:
    """An answer's JSON object; {} where the endpoint has none (an older engine), Unreachable past the deadline."""
    try:
        value = json.loads(get(f"{base}{path}", timeout))
    except TooSlow:
        raise
    except (Unreachable, ValueError, RecursionError):  # RecursionError: JSON nested past the parser's depth
        return {}
    return value if isinstance(value, dict) else {}


def base_urls(given: str) -> list[str]:
    """Comma-separated base URLs, each http(s) with a host and a port that reads as one; BadInput, naming the
    one that is not, before anything is read."""
    urls = [u.strip().rstrip("/") for u in (given or "").split(",") if u.strip()]
    if not urls:
        raise BadInput(f"--endpoints: comma-separated http(s) base URLs, not {given!r}")
    for url in urls:
        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018 (raises ValueError for a port that is not a number)
        except ValueError as exc:
            raise BadInput(f"--endpoints: {url!r} is not a URL ({exc})") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise BadInput(f"--endpoints: comma-separated http(s) base URLs, not {url!r}")
    return urls
