"""Named points where a test can make a process die or crash for real, to prove recovery.

`DRAFTEROPS_FAILPOINT=<name>:kill` ends the process at that point as `kill -9` would (exit 137, no
cleanup, no `finally`); `<name>:raise` raises an unforeseen error there (an internal error, exit 3).
Unset, a failpoint costs one dictionary lookup. Names: `<step>` (the start of an entry point),
`capture:after_partial`, `capture:after_head`, `capture:sample_<n>`, `capture:shard_<n>`,
`capture:before_index`.
"""

from __future__ import annotations

import os

KILLED = 137


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
