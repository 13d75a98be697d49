"""Turn what a user passes as a drafter (registry URI, local folder, hub id) into a local folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common.errors import BadInput
from registry.access.reference import DrafterRef

HUB_CONFIG_ONLY = ["config.json", "README.md", "LICENSE*"]
HUB_DRAFTER_FILES = [*HUB_CONFIG_ONLY, "*.safetensors", "model.safetensors.index.json"]


def parse_hub_ref(ref: str) -> tuple[str, str | None]:
    """'org/name', 'org/name@rev' or 'hf://org/name@rev' -> (repo id, revision)."""
    ref = ref.removeprefix("hf://")
    repo, _, rev = ref.partition("@")
    return repo, rev or None


def resolve_drafter(ref: str, config_only: bool = False, revision: str | None = None) -> DrafterRef:
    """models:/name/N and models:/name@alias through the registry; a folder as is; else a hub id."""
    if ref.startswith("models:/"):
        from registry.access.store import download_version

        return download_version(ref)
    path = Path(ref)
    if path.exists():
        if not path.is_dir() or not (path / "config.json").is_file():
            raise BadInput(f"{ref}: not a drafter folder (no config.json)")
        return DrafterRef(ref, path, "local")
    repo, rev = parse_hub_ref(ref)
    if repo.count("/") != 1:
        raise BadInput(f"{ref}: not a folder, a models:/ URI or a hub id (org/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        folder = Path(
            snapshot_download(
                repo, revision=revision or rev, allow_patterns=HUB_CONFIG_ONLY if config_only else HUB_DRAFTER_FILES
            )
        )
    except (LocalEntryNotFoundError, RepositoryNotFoundError, HfHubHTTPError, OSError, ValueError) as exc:
        first = str(exc).splitlines()[0][:160] if str(exc) else ""
        raise BadInput(f"{ref}: cannot fetch from the hub ({exc.__class__.__name__}: {first})") from None
    if not (folder / "config.json").is_file():
        raise BadInput(f"{ref}: hub repository has no config.json")
    return DrafterRef(ref, folder, "hub", revision=folder.name)


def resolve_model(model: str) -> tuple[Path, Any]:
    """(drafter folder, ModelVersion or None): a registry URI through the store, a folder or hub id as is."""
    if model.startswith("models:/"):
        from registry.access import store  # only a registry URI needs the store, as in resolve_drafter

        mv = store.get_version(model)
        return store.download_version(f"models:/{mv.name}/{mv.version}").folder, mv
    return resolve_drafter(model).folder, None
