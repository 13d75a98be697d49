"""Importing a drafter as a service: a hub id or local folder fetched (pinned to its commit), staged in the
project's layout with its headers checked against its config, and registered with its provenance (its own run,
alias `imported`). The import_drafter step calls it with its own parameters; compare stages each candidate
first, gates it, and registers only the ones that pass."""

from __future__ import annotations

import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from common.errors import BadInput
from common.runs import OpenRun
from drafter.formats.checkpoint import header_problems, load_config, read_header
from drafter.formats.layouts import detect, family_of
from drafter.formats.speculators import verifier_of
from drafter.methods import folder_method
from drafter.model.config import read_json
from registry.access import naming
from registry.access.resolve import HUB_DRAFTER_FILES, parse_hub_ref

PICKLE_SUFFIXES = (".bin", ".pt", ".pth")


@dataclass
class Staged:
    """A drafter ready to register: the folder in the project's layout and what was read from it."""

    folder: Path
    header: dict
    converted: dict[str, str]  # what the conversion was, as tags
    source_tag: str
    commit: str | None


def stage(source: str, revision: str | None, tmp: Path, allow_pickle: bool = False) -> Staged:
    """The drafter fetched, in the project's layout under `tmp` (a drafter of another draft method in its makers'
    layout, drafter/methods), its header checked against its config."""
    folder, source_tag, commit = fetch(source, revision)
    other = folder_method(folder)
    if other is not None:
        return Staged(folder, other[0].checked_header(folder), {"method": other[0].NAME}, source_tag, commit)
    folder, converted = project_layout(folder, tmp, allow_pickle)
    return Staged(folder, checked_header(folder), converted, source_tag, commit)


def import_drafter(source: str, target: str, open_run: OpenRun, asked: Mapping[str, object], name: str | None = None,
                   revision: str | None = None, trained_for: str | None = None,
                   allow_pickle: bool = False) -> Registered:  # fmt: skip
    """Fetched, staged, registered: the version (or the one the same weights were registered as before)."""
    if name:
        naming.check_name(name)
    with tempfile.TemporaryDirectory() as tmp:
        staged = stage(source, revision, Path(tmp), allow_pickle)
        return register(staged, source, target, open_run, asked, name, trained_for, revision)


def fetch(source: str, revision: str | None) -> tuple[Path, str, str | None]:
    """(folder, source tag, pinned commit). Local folders as they are; hub ids by snapshot_download
    limited to configs, safetensors, card and licence, pinned to the commit they resolve to."""
    path = Path(source)
    if path.exists():
        if not path.is_dir():
            raise BadInput(f"{source}: not a folder")
        return path, f"file://{path.resolve()}", None
    repo, rev = parse_hub_ref(source)
    if repo.count("/") != 1 or source.startswith(("/", ".")):
        raise BadInput(f"{source}: no such folder, and not a hub id (org/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        folder = Path(
            snapshot_download(
                repo, revision=revision or rev, allow_patterns=[*HUB_DRAFTER_FILES, *[f"*{s}" for s in PICKLE_SUFFIXES]]
            )
        )
    except LocalEntryNotFoundError:
        raise BadInput(f"{source}: not in the local hub cache and the hub cannot be reached (offline?)") from None
    except (RepositoryNotFoundError, HfHubHTTPError, OSError, ValueError) as exc:
        first = str(exc).splitlines()[0][:160] if str(exc) else exc.__class__.__name__
        raise BadInput(f"{source}: cannot download from the hub ({first})") from None
    commit = folder.name  # snapshot folders are named by the commit they hold
    return folder, f"hf://{repo}@{commit}", commit


def convert_pickle(folder: Path, out: Path) -> Path:
    """Opt-in path for torch pickles: read with weights_only=True, write safetensors."""
    import shutil

    import torch
    from safetensors.torch import save_file

    files = sorted(p for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    state = {}
    for f in files:
        try:
            loaded = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as exc:  # any unpickling failure: name the file, keep the reason short
            raise BadInput(f"{f}: not loadable with weights_only=True ({exc.__class__.__name__})") from None
        state.update({k: v.contiguous() for k, v in loaded.items()})
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "README.md", "LICENSE"):
        if (folder / name).is_file():
            shutil.copyfile(folder / name, out / name)
    return out


def to_project_with_card(folder: Path, out: Path) -> Path:
    """A folder in another layout (drafter/formats/layouts.py) as the project's, its card and licence kept for the
    provenance."""
    import shutil

    from drafter.formats.layouts import to_project

    to_project(folder, out)
    for name in ("README.md", "LICENSE"):
        if (folder / name).is_file():
            shutil.copyfile(folder / name, out / name)
    return out


def model_card(folder: Path) -> dict[str, str]:
    """Licence, base model and training-sample count, when the card or a LICENSE file says so."""
    info: dict[str, str] = {}
    card = folder / "README.md"
    text = card.read_text(errors="replace") if card.is_file() else ""
    front = re.match(r"^---\n(.*?)\n---", text, re.S)
    if front:
        import yaml

        try:
            meta = yaml.safe_load(front.group(1)) or {}
        except yaml.YAMLError:
            meta = {}
        if isinstance(meta, dict):
            for key in ("license", "base_model"):
                if meta.get(key):
                    info[key] = str(meta[key])
    m = re.search(r"(?i)training samples?\D{0,20}([\d.,]+\s*[kKmM]?)", text) or re.search(
        r"(?i)([\d.,]+\s*[kKmM]?)\s+(?:training\s+)?samples", text
    )
    if m:
        info["training_samples"] = m.group(1).strip()
    if "license" not in info and (folder / "LICENSE").is_file():
        info["license"] = (folder / "LICENSE").read_text(errors="replace").strip().splitlines()[0][:80]
    return info


def describe(source_tag: str, hashes: dict[str, str], header: dict, card: dict[str, str], trained_for: str) -> str:
    from registry.access.describe import contents, parameter_count, upsert_section

    head = (
        f"## Imported drafter\n\n- **source**: `{source_tag}`\n- **trained for**: `{trained_for}`\n"
        f"- **licence**: {card.get('license', 'not stated')}\n"
        f"- **training samples**: {card.get('training_samples', 'not stated')}\n"
        f"- **parameters**: {parameter_count(header) / 1e6:.2f} M (without embed_tokens)\n"
    )
    return upsert_section(head, "contents", contents(hashes, header))


def project_layout(folder: Path, tmp: Path, allow_pickle: bool) -> tuple[Path, dict[str, str]]:
    """The drafter in the project's own layout: pickled weights converted only when allowed (read with
    weights_only=True), the other layouts public drafters ship in converted (drafter/formats/layouts.py); with what
    the conversion was, as tags."""
    pickles = [p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES]
    if pickles and not any(folder.glob("*.safetensors")):
        if not allow_pickle:
            raise BadInput(
                f"{folder}: weights are pickle files ({', '.join(pickles)}); unpickling can run "
                "arbitrary code. Convert to safetensors, or pass --allow_pickle true to read them "
                "with torch.load(weights_only=True)"
            )
        folder = convert_pickle(folder, tmp / "converted")
    layout = detect(folder)  # speculators, ModelOpt, TorchSpec: the same tensors under other names
    if layout == "project":
        return folder, {}
    converted = {"converted_from": layout, "layout.family": family_of(read_json(folder / "config.json"), layout)}
    if layout == "speculators":
        converted["speculators.verifier"] = verifier_of(folder)
    return to_project_with_card(folder, tmp / f"from-{layout}"), converted


def checked_header(folder: Path) -> dict:
    """The weights' header checked against the config, from headers only: no weights enter memory."""
    cfg = load_config(folder)
    header = read_header(folder)
    problems = header_problems(header, cfg)
    if problems:
        raise BadInput(f"{folder}: checkpoint does not match its config: " + "; ".join(problems))
    return header


@dataclass(frozen=True)
class Registered:
    name: str
    version: str
    sha: str
    existing: bool  # the same weights were registered before: nothing added
    source_tag: str = ""  # where the weights came from (hf://org/name@commit, file://...)


def register(staged: Staged, source: str, target: str, open_run: OpenRun, asked: Mapping[str, object],
             name: str | None = None, trained_for: str | None = None,
             revision: str | None = None) -> Registered:  # fmt: skip
    """A new version with its provenance (source, revision, sha256 per file, card) and alias `imported`; the
    same weights registered before are found by digest and not added again. `name`, `trained_for`, `revision`:
    None when not given (the target's model name, the card's base model, the commit or none)."""
    import mlflow

    from registry.access import store
    from registry.ledger import audit

    folder, source_tag, header = staged.folder, staged.source_tag, staged.header
    hashes = store.file_hashes(folder)
    sha = store.weights_sha256(hashes)
    card = model_card(folder)
    trained_for = naming.target_slug(trained_for or card.get("base_model", "unknown"))
    target = str(Path(target).resolve()) if Path(target).exists() else str(target)
    name = name or naming.model_name_for(target, staged.converted.get("method", "eagle3"))
    c = store.client()
    with store.registry_lock():  # a concurrent import of the same weights sees this one
        store.ensure_registered_model(c, name, target)
        existing = store.find_complete_version(c, name, sha)
        if existing is not None:
            return Registered(name, str(existing.version), sha, True, source_tag)
        store.drop_incomplete(c, name, sha)
        tags = {naming.TAG_SOURCE: source_tag, naming.TAG_SHA256: sha, naming.TAG_TRAINED_FOR: trained_for,
                **{f"card.{k}": v for k, v in card.items()}, **staged.converted}  # fmt: skip
        revision = staged.commit or revision or "none (a local folder)"
        params = {"source": source, "revision": revision, "name": name, "target": target, "trained_for": trained_for}
        with open_run("import_drafter", f"import {Path(source).name} -> {name}", params, asked):
            mlflow.set_tags({f"drafter.{k}": v for k, v in tags.items()})
            mlflow.log_dict(hashes, "sha256.json")
            mv = store.register_drafter(folder, name, tags, describe(source_tag, hashes, header, card, trained_for))
            audit.move_alias(c, name, "imported", mv.version, f"imported from {source_tag}")
    return Registered(name, str(mv.version), sha, False, source_tag)
