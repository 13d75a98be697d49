"""HTTP calls bounded by a wall-clock deadline for the whole answer.

urllib's `timeout` bounds each socket operation, not the call: a server that drips one byte every two
seconds keeps a 10-second timeout waiting for as long as it likes. A service that reads other services on a
schedule (the watch's engines, its webhook) needs the whole call bounded, so each call runs in a daemon
thread that reads its body piece by piece against the same deadline and gives up at it.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from typing import Any


class Late(TimeoutError):
    """No whole answer within the deadline."""


MAX_BYTES = 8 * 2**20  # an answer larger than this is refused: no engine's metrics come near it


class TooLarge(ValueError):
    """An answer longer than MAX_BYTES."""


def fetch(request: str | urllib.request.Request, deadline_s: float, data: bytes | None = None,
          max_bytes: int = MAX_BYTES) -> bytes:  # fmt: skip
    """The body of one HTTP call, whole within `deadline_s` seconds (Late) and `max_bytes` (TooLarge); urllib's
    and http.client's own errors as raised."""
    end = time.monotonic() + deadline_s
    box: dict[str, Any] = {}

    def call() -> None:
        try:
            with urllib.request.urlopen(request, data=data, timeout=deadline_s) as r:
                parts, size = [], 0
                while chunk := r.read1(65536):
                    parts.append(chunk)
                    size += len(chunk)
                    if size > max_bytes:
                        raise TooLarge(f"an answer of more than {max_bytes} bytes")
                    if time.monotonic() > end:  # the caller has given up: stop reading the drip
                        return
                box["body"] = b"".join(parts)
        except BaseException as exc:  # noqa: BLE001 (handed to the caller's thread as raised)
            box["error"] = exc

    worker = threading.Thread(target=call, name="deadline-fetch", daemon=True)
    worker.start()
    worker.join(max(0.0, end - time.monotonic()))
    if "error" in box:
        raise box["error"]
    if "body" not in box:
        raise Late(f"no whole answer within {deadline_s:g} s")
    return box["body"]
