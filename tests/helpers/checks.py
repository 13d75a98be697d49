"""Assertions that more than one test module makes."""

from __future__ import annotations


def one_line_exit_2(res, *needles: str) -> None:
    """Bad input: exit 2, one line on stderr naming what was wrong, no traceback."""
    err = res.stderr.strip()
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
