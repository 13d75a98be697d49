"""A drafter as the registry hands it over: where it came from and the local folder its files are in.
Its own module so that store (which makes them for registry versions) and resolve (which makes them for
folders and hub ids, and asks store for the rest) both import it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from drafter.model.config import DrafterConfig


@dataclass
class DrafterRef:
    """Where a drafter came from and where its files are now."""

    ref: str
    folder: Path
    kind: str  # "registry" | "local" | "hub"
    revision: str | None = None  # resolved hub commit
    model_name: str | None = None  # registry name and version when kind == "registry"
    model_version: str | None = None

    @property
    def config(self) -> DrafterConfig:
        return DrafterConfig.from_file(self.folder / "config.json")
