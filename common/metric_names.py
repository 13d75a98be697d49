"""The names of the metrics a run logs, built and read back in this one place.

A figure measured per traffic class is `class_<class>_<figure>`, per context-length bucket
`ctx_<bucket>_<figure>`, as a serving engine measured it `engine_<figure>`, at an operating point (requests
in flight) `<figure>_c<n>`, at a draft depth and an operating point `<figure>_k<k>_c<n>`. Whoever writes one
uses a builder below and whoever reads a run's metrics back uses the matching reader: nobody slices strings,
so a renamed figure cannot leave a reader silently empty.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

CLASS, CONTEXT, ENGINE = "class_", "ctx_", "engine_"


def per_class(name: str, figure: str) -> str:
    return f"{CLASS}{name}_{figure}"


def per_context(bucket: str, figure: str) -> str:
    return f"{CONTEXT}{bucket}_{figure}"


def per_group(prefix: str, name: str, figure: str) -> str:
    """A class's (prefix CLASS) or a context bucket's (prefix CONTEXT) figure."""
    return per_class(name, figure) if prefix == CLASS else per_context(name, figure)


def engine(figure: str) -> str:
    return f"{ENGINE}{figure}"


def at_concurrency(figure: str, concurrency: int) -> str:
    return f"{figure}_c{int(concurrency)}"


def at_depth_and_concurrency(figure: str, k: int, concurrency: int) -> str:
    return f"{figure}_k{int(k)}_c{int(concurrency)}"


def groups(metrics: Iterable[str], prefix: str, figure: str) -> list[str]:
    """The classes (prefix CLASS) or context buckets (CONTEXT) that have `figure` among these metrics, sorted."""
    tail = f"_{figure}"
    return sorted(k[len(prefix) : -len(tail)] for k in metrics if k.startswith(prefix) and k.endswith(tail)
                  and len(k) > len(prefix) + len(tail))  # fmt: skip


def by_concurrency(metrics: Mapping[str, float], figure: str) -> dict[int, float]:
    """{concurrency: value} of every `<figure>_c<n>` among these metrics."""
    pattern = re.compile(re.escape(figure) + r"_c(\d+)$")
    out = {}
    for key, value in metrics.items():
        m = pattern.match(key)
        if m:
            out[int(m.group(1))] = value
    return out
