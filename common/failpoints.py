"""Named points where a test can make a process die or crash for real, to prove recovery.

`DRAFTEROPS_FAILPOINT=<name>:kill` ends the process at that point as `kill -9` would (exit 137, no
cleanup, no `finally`); `<name>:raise` raises an unforeseen error there (an internal error, exit 3);
`<name>:meet` waits there until `DRAFTEROPS_FAILPOINT_MEET` (`<folder>:<n>`) holds n processes' marks, so
n processes reach the point together (a race made certain, not hoped for).
Unset, a failpoint costs one dictionary lookup. Names: `<step>` (the start of an entry point),
`capture:after_partial`, `capture:after_head`, `capture:sample_<n>`, `capture:shard_<n>`,
`capture:before_index`, `promote:judged`, `promote:claimed`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

KILLED = 137
MEET_TIMEOUT_S = 120.0


def hit(name: str) -> None:
    spec = os.environ.get("DRAFTEROPS_FAILPOINT")
    if not spec:
        return
    where, _, action = spec.rpartition(":")
    if where != name:
        return
    if action == "kill":
        os._exit(KILLED)
    if action == "raise":
        raise RuntimeError(f"failpoint {name} (DRAFTEROPS_FAILPOINT)")
    if action == "meet":
        meet(os.environ.get("DRAFTEROPS_FAILPOINT_MEET", ""))


def meet(spec: str) -> None:
    """Mark this process as arrived and wait for the others (a mark per process: arriving twice counts once)."""
    folder, _, n = spec.rpartition(":")
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / str(os.getpid())).touch()
    deadline = time.monotonic() + MEET_TIMEOUT_S
    while len(list(Path(folder).iterdir())) < int(n) and time.monotonic() < deadline:
        time.sleep(0.01)
