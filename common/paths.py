"""Where the repository's own files are: the mini world (the embedded default), the deployment profiles
and the other configs. Every layer may read these; nothing here imports anything of the project."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MINIWORLD = ROOT / "miniworld"
CONFIGS = ROOT / "configs"
PROFILE_DIR = CONFIGS / "profiles"
