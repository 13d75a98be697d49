"""Drafters in the MLflow Model Registry: register (idempotently, alias last), resolve and download."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from common.errors import BadInput
from drafter.formats.checkpoint import INDEX_FILE, weight_files
from registry.access import naming
from registry.access.reference import DrafterRef

URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:/(?P<version>\d+)|@(?P<alias>[A-Za-z0-9_-]+))$")


_READY: set[str] = set()


def client():
    """A client of the tracking store. A local SQLite store is created (schema, default experiment)
    under the registry lock, so several processes using a fresh store at once do not race its
    migrations; a tracking server does that itself."""
    from mlflow import MlflowClient

    naming.use_default_store()
    warnings.filterwarnings("ignore", module="mlflow")
    uri = naming.tracking_uri()
    if uri.startswith("sqlite:///") and uri not in _READY:
        with registry_lock():
            MlflowClient().search_experiments(max_results=1)
        _READY.add(uri)
    return MlflowClient()


_HASHED: dict[tuple[str, int, int], str] = {}


def sha256_file(path: Path) -> str:
    """A file's sha256; remembered per (path, size, mtime) in this process, so a guard that checks the
    serving versions every minute reads each weights file once, and again only when it changed."""
    st = Path(path).stat()
    key = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns)
    if key not in _HASHED:
        h = hashlib.sha256()
        with Path(path).open("rb") as fh:
            while block := fh.read(1 << 22):
                h.update(block)
        _HASHED[key] = h.hexdigest()
    return _HASHED[key]


def forget_process_state() -> None:
    """Forget the stores made ready and the files hashed, as a new process would (an in-process step in
    the tests starts from here)."""
    _READY.clear()
    _HASHED.clear()


def file_hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file worth recording (weights, config, card, licence)."""
    folder = Path(folder)
    names = set(weight_files(folder)) | {
        n for n in ("config.json", INDEX_FILE, "README.md", "LICENSE") if (folder / n).is_file()
    }
    return {n: sha256_file(folder / n) for n in sorted(names)}


def drafter_files(folder: Path) -> dict[str, str]:
    """sha256 of every file an engine loads (config.json, the index, the weights): what evidence binds.
    config.json is hashed in one canonical spelling (sorted keys, no spaces), so a reformatted file is
    the same drafter and a changed value is not."""
    import json

    folder = Path(folder)
    out = {n: h for n, h in file_hashes(folder).items() if n not in ("README.md", "LICENSE")}
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        raise BadInput(f"{folder}/config.json: missing or not valid JSON") from None
    out["config.json"] = hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return out


def drafter_digest(files: dict[str, str]) -> str:
    return hashlib.sha256("\n".join(f"{n} {h}" for n, h in sorted(files.items())).encode()).hexdigest()


def weights_sha256(hashes: dict[str, str]) -> str:
    """The weights' identity: the file's hash, or a hash of the sorted shard hashes when sharded."""
    shards = sorted(v for k, v in hashes.items() if k.endswith(".safetensors"))
    if len(shards) == 1:
        return shards[0]
    return hashlib.sha256("\n".join(shards).encode()).hexdigest()


def parse_uri(uri: str) -> tuple[str, str | None, str | None]:
    m = URI.match(uri)
    if not m:
        raise BadInput(f"{uri}: not a model URI (models:/<name>/<version> or models:/<name>@<alias>)")
    naming.check_name(m["name"], uri + ":")
    return m["name"], m["version"], m["alias"]


def get_version(uri: str, mlflow_client: Any = None):
    """The ModelVersion a models:/ URI names; a clear error when it does not exist."""
    from mlflow.exceptions import MlflowException

    c = mlflow_client or client()
    name, version, alias = parse_uri(uri)
    try:
        mv = c.get_model_version(name, version) if version else c.get_model_version_by_alias(name, alias)
    except MlflowException:
        raise BadInput(f"{uri}: no such registered model version in {c.tracking_uri}") from None
    if mv.tags.get(naming.TAG_COMPLETE) != "true":
        raise BadInput(f"{uri}: version {mv.version} was never completely registered (an interrupted import)")
    return mv


def download_version(uri: str, dst: str | Path | None = None) -> DrafterRef:
    """Resolve a models:/ URI to a folder holding the version's files as the registry holds them now.

    A local artifact store is read in place. Otherwise the files are fetched fresh and kept under the
    digest of what was fetched (a content-addressed cache): a version whose files changed in the store
    is never measured from a stale copy."""
    import shutil

    import mlflow

    c = client()
    mv = get_version(uri, c)
    ref = dict(model_name=mv.name, model_version=str(mv.version))
    if dst is None:
        local = local_folder(c, mv)
        if local is not None:
            return DrafterRef(uri, local, "registry", **ref)
    store_key = hashlib.sha256(str(c.tracking_uri).encode()).hexdigest()[:12]
    base = cache_dir() / store_key
    fetch = Path(dst) if dst else Path(tempfile.mkdtemp(prefix=".fetch-", dir=_mkdir(base)))
    fetch.mkdir(parents=True, exist_ok=True)
    mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{mv.name}/{mv.version}", dst_path=str(fetch))
    if dst:
        return DrafterRef(uri, fetch, "registry", **ref)
    keep = base / drafter_digest(drafter_files(fetch))
    if keep.is_dir():
        shutil.rmtree(fetch)
    else:
        os.replace(fetch, keep)
    return DrafterRef(uri, keep, "registry", **ref)


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def local_folder(c: Any, mv: Any) -> Path | None:
    """The version's folder when the artifact store is a local path (nothing to download or cache)."""
    from urllib.parse import unquote, urlparse

    parsed = urlparse(c.get_model_version_download_uri(mv.name, mv.version))
    if parsed.scheme in ("", "file"):
        folder = Path(unquote(parsed.path))
        if (folder / "config.json").is_file():
            return folder
    return None


def cache_dir() -> Path:
    return Path(os.environ.get("DRAFTEROPS_CACHE", Path.home() / ".cache" / "drafterops" / "registry"))


def find_complete_version(c: Any, name: str, sha: str, config_sha: str | None = None):
    """A complete version whose weights are these (`sha`), and whose config.json is this one where `config_sha` is
    given (the same weights under another config are another drafter): the tag narrows the search, the files
    decide (a tag edited onto another version finds nothing)."""
    for mv in c.search_model_versions(f"name={naming.quote_filter_value(name)}"):
        if mv.tags.get(naming.TAG_SHA256) == sha and mv.tags.get(naming.TAG_COMPLETE) == "true":
            folder = local_folder(c, mv) or download_version(f"models:/{mv.name}/{mv.version}").folder
            hashes = file_hashes(folder)
            if weights_sha256(hashes) == sha and (config_sha is None or hashes.get("config.json") == config_sha):
                return mv
    return None


def drop_incomplete(c: Any, name: str, sha: str) -> list[str]:
    """Versions a crash left behind for these weights (never aliased): delete them."""
    dropped = []
    for mv in c.search_model_versions(f"name={naming.quote_filter_value(name)}"):
        if mv.tags.get(naming.TAG_SHA256) == sha and mv.tags.get(naming.TAG_COMPLETE) != "true":
            c.delete_model_version(name, mv.version)
            dropped.append(mv.version)
    return dropped


def ensure_registered_model(c: Any, name: str, target: str) -> None:
    """Create the registered model for `target`, or refuse a name that belongs to another target."""
    from mlflow.exceptions import MlflowException

    naming.check_name(name)
    try:
        rm = c.get_registered_model(name)
    except MlflowException:
        c.create_registered_model(
            name,
            tags={naming.MODEL_TAG_TARGET: target},
            description=f"EAGLE-3 drafters for target `{target}` (managed by drafterops).",
        )
        return
    owner = rm.tags.get(naming.MODEL_TAG_TARGET)
    if owner is not None and owner != target:
        raise BadInput(f"registered model {name!r} belongs to target {owner!r}, not {target!r}; choose another name")
    if owner is None:
        c.set_registered_model_tag(name, naming.MODEL_TAG_TARGET, target)


def register_drafter(folder: Path, name: str, tags: dict[str, str], description: str):
    """Log the drafter as a `drafterops`-flavor model in the active run and create a version.

    The version gets every tag and its description first and `drafterops.complete` last; aliases are
    set by the caller after that, so a crash anywhere leaves nothing under an alias."""
    import mlflow
    from mlflow.models import Model

    from registry.access import flavor

    c = client()
    run = mlflow.active_run()
    info = Model.log(
        artifact_path=None,
        name="drafter",
        flavor=flavor,
        drafter_folder=str(folder),
        run_id=run.info.run_id if run else None,
    )
    mv = mlflow.register_model(info.model_uri, name, tags=tags, await_registration_for=300)
    c.update_model_version(name, mv.version, description=description)
    for _ in range(300):
        if c.get_model_version(name, mv.version).status == "READY":
            break
        time.sleep(0.1)
    c.set_model_version_tag(name, mv.version, naming.TAG_COMPLETE, "true")
    from registry.access.describe import refresh_model_page

    refresh_model_page(c, name)  # the model page lists every version, this one too
    return c.get_model_version(name, mv.version)


def version_folder(uri: str) -> tuple[Any, Path]:
    """(ModelVersion, folder with its files): in place when the artifact store is a local path, so a
    header-only check reads headers only; fetched otherwise."""
    mv = get_version(uri, client())
    return mv, download_version(f"models:/{mv.name}/{mv.version}").folder


def locked_locally() -> bool:
    """Whether `registry_lock` serialises this store's writers (a local SQLite store) or the server does."""
    return naming.tracking_uri().startswith("sqlite:///")


@contextlib.contextmanager
def registry_lock():
    """Serialise registry writes that must see each other (idempotent registration, promotion) against
    one local store; a tracking server serialises its own writes, and the audit trail keeps both."""
    uri = naming.tracking_uri()
    if not uri.startswith("sqlite:///"):
        yield
        return
    path = Path(uri.removeprefix("sqlite:///") + ".registry.lock")
    with path.open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def model_created(c: Any, name: str) -> int:
    """A registered model's creation time (with its name, which model it is); BadInput when there is none."""
    from mlflow.exceptions import MlflowException

    try:
        return int(c.get_registered_model(name).creation_timestamp or 0)
    except MlflowException:
        raise BadInput(f"--model {name}: no registered model of that name") from None
