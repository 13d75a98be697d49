"""Errors that the entry points turn into one-line messages and docs/design.md's exit codes:
0 ok, 1 a gate or the promotion rule said no, 2 bad input, 3 an internal error (anything unforeseen)."""

from __future__ import annotations


class DrafterOpsError(Exception):
    """Base class: `exit_code` is what the entry point exits with."""

    exit_code = 2


class BadInput(DrafterOpsError):
    """Unreadable, corrupt or inconsistent input (exit 2): nothing is written."""

    exit_code = 2


class GateRefused(DrafterOpsError):
    """A gate said no (shape gate failed, promotion refused): exit 1."""

    exit_code = 1


class InternalError(DrafterOpsError):
    """Something that should not happen did (a decoding bug, an engine fault): exit 3, never a figure."""

    exit_code = 3


INTERNAL_ERROR = 3
