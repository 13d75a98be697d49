"""Errors that the entry points turn into one-line messages and DESIGN.md's exit codes."""

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
