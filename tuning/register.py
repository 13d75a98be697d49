"""The study's best trial becomes a registry version (lineage, settings, files), and the alias
follows the study's best; and the init a study starts from, refused unless its gate passed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common.errors import BadInput


def prepare_init(init: str, dataset: Any, arch: str):
    """(base drafter or None for scratch, its config, ModelVersion or None); refuses an init whose
    shape gate has not passed for the dataset's target."""
    import torch

    from drafter.formats.checkpoint import load_drafter
    from drafter.methods import config_file_method, folder_method
    from drafter.model.config import DrafterConfig
    from drafter.train.loop import attach_target_embedding, check_fit

    if init == "scratch":
        path = arch_config_path(arch)
        other = config_file_method(path)
        if other is not None:  # another draft method's network, built fresh in each trial (tuning/trial.py)
            _scratch_fits(arch, *other, dataset)
            return None, other[1], None
        cfg = DrafterConfig.from_file(path)
        check_fit(cfg, dataset)
        return None, cfg, None
    mv = None
    if init.startswith("models:/"):
        from registry.access import naming, store

        mv = store.get_version(init)
        gate, gate_target = mv.tags.get(naming.TAG_GATE), mv.tags.get(naming.TAG_GATE_TARGET)
        if gate != "passed":
            raise BadInput(
                f"{init}: shape gate says {gate or 'nothing (never run)'}; run shape_gate against the "
                "dataset's target first"
            )
        data_target = str(dataset.index.get("target", ""))
        if data_target and gate_target and not naming.same_target(gate_target, data_target):
            raise BadInput(f"{init}: shape gate passed for {gate_target!r}, but the dataset is from {data_target!r}")
        folder = store.download_version(f"models:/{mv.name}/{mv.version}").folder
    else:
        from registry.access.resolve import resolve_drafter

        folder = resolve_drafter(init).folder
    found = folder_method(folder)
    if found is not None:  # another draft method: loaded over the dataset's target embedding and head
        _reads_fit(init, *found[0].reads(folder), dataset)
        model = found[0].load(folder, torch.float32, dataset.target_embedding(), dataset.target_head())
        return model, model.config, mv
    model = load_drafter(folder)
    check_fit(model.config, dataset)
    attach_target_embedding(model, dataset)
    return model, model.config, mv


def arch_config_path(arch: str) -> Path:
    """The config file `--arch` names: a folder's config.json, or the file itself."""
    return Path(arch) / "config.json" if Path(arch).is_dir() else Path(arch)


def _scratch_fits(arch: str, method: Any, cfg: Any, dataset: Any) -> None:
    """Before any trial or run: the layers and width it reads are the dataset's, and the method's own checks of a
    config against the dataset (method.check_scratch: its gate's rules, what it borrows from the target) hold; bad
    input in one line naming --arch, nothing trained or registered."""
    _reads_fit(arch, *method.config_reads(cfg), dataset)
    try:
        method.check_scratch(cfg, dataset)
    except BadInput as exc:
        raise BadInput(f"--arch {arch}: {exc}") from None


def _reads_fit(what: str, layers: list[int], hidden: int, dataset: Any) -> None:
    """Another method's drafter reads these target layers at this width: the dataset must hold them."""
    from drafter.data.dataset import layers_for

    layers_for(dataset, layers)  # bad input naming the layers it lacks
    if int(dataset.hidden_size) != hidden:
        raise BadInput(f"{what}: reads target states {hidden} wide; the dataset's are {dataset.hidden_size}")


def init_digest(init: str, parent: Any) -> str:
    """The init's weights by value (drafter.analysis.fingerprint.tensor_digest; "" from scratch): whatever the init
    was named by (registry URI, folder or hub id), lineage follows it to the runs that produced it."""
    from drafter.analysis.fingerprint import tensor_digest

    if init == "scratch":
        return ""
    if parent is not None:
        from registry.access import store

        return tensor_digest(store.download_version(f"models:/{parent.name}/{parent.version}").folder)
    from registry.access.resolve import resolve_drafter

    return tensor_digest(resolve_drafter(init).folder)


def default_name(dataset: Any, method: str = "eagle3") -> str:
    """The target's registered model for drafters of this draft method (a fine-tuned DFlash is no EAGLE-3)."""
    from registry.access.naming import model_name_for

    return model_name_for(str(dataset.index.get("target", "target")), method)


def register_best(
    folder: Path,
    name: str,
    parent: Any,
    dataset: Any,
    trial: Any,
    alias: str | None,
    run_id: str,
    init_digest: str = "",
) -> str:
    from registry.access import store
    from registry.ledger import audit

    hashes = store.file_hashes(folder)
    c = store.client()
    target = str(dataset.index.get("target", ""))
    with store.registry_lock():
        if not _exists(c, name):
            store.ensure_registered_model(c, name, target)
        same = store.find_complete_version(c, name, store.weights_sha256(hashes), hashes.get("config.json", ""))
        if same is None:
            return _register(c, folder, name, parent, dataset, trial, alias, run_id, hashes, target, init_digest)
    # another worker of the same study registered this trial already: the alias still follows the
    # study's best, which is that version
    if alias and audit.current_alias_version(c, name, alias) != str(same.version):
        audit.move_alias(c, name, alias, same.version, f"best of study (trial {trial.number}), registered before")
    return str(same.version)


def replies(dataset: Any) -> str:
    """Who wrote the training replies, from the dataset's own meta (make_data --regenerate)."""
    regen = (getattr(dataset, "index", None) or {}).get("meta", {}).get("regenerated")
    if not isinstance(regen, dict):
        return "as shipped"
    return f"regenerated by the target ({regen.get('by')}, temperature {regen.get('temperature')})"


def _register(
    c: Any,
    folder: Path,
    name: str,
    parent: Any,
    dataset: Any,
    trial: Any,
    alias: str | None,
    run_id: str,
    hashes: dict[str, str],
    target: str,
    init_digest: str = "",
) -> str:
    from registry.access import naming, store
    from registry.ledger import audit

    tags = {
        naming.TAG_SOURCE: f"run:{run_id}",
        naming.TAG_SHA256: store.weights_sha256(hashes),
        naming.TAG_TRAINED_FOR: naming.target_slug(target),
        naming.TAG_DATASET: dataset.digest,
        "optuna.trial": str(trial.number),
        "val_sim_accept_len": f"{trial.value:.4f}",
        naming.TAG_REPLIES: replies(dataset),
    }
    if parent is not None:
        tags[naming.TAG_PARENT] = f"models:/{parent.name}/{parent.version}"
    from drafter.methods import folder_method

    found = folder_method(folder)
    if found is not None:  # as import tags another method's version
        tags["method"] = found[0].NAME
    from drafter.formats.checkpoint import read_header
    from registry.access.describe import contents, run_md, upsert_section

    settings = trial.user_attrs.get("settings") or trial.params
    what = f"## Fine-tuned from `{tags[naming.TAG_PARENT]}`" if parent is not None else "## Trained from scratch"
    desc = (
        f"{what}\n\n- **trained for**: `{tags[naming.TAG_TRAINED_FOR]}`\n"
        f"- **dataset**: `{dataset.digest}` ({len(dataset)} samples)\n- **finetune run**: {run_md(run_id)}\n"
        f"- **best trial**: {trial.number}, val sim_accept_len {trial.value:.3f}\n\n"
        "### Settings\n\n| setting | value |\n|---|---|\n"
        + "\n".join(f"| {k} | {_fmt(v)} |" for k, v in sorted(settings.items()))
        + "\n"
    )
    desc = upsert_section(desc, "contents", contents(hashes, read_header(folder)))
    from drafter.analysis.fingerprint import tensor_digest
    from drafter.analysis.sketch import weights_sketch
    from registry.ledger.lineage import log_training_prompts

    log_training_prompts(dataset, tensor_digest(folder), init_digest, weights_sketch(folder))
    mv = store.register_drafter(folder, name, tags, desc)
    if alias:
        audit.move_alias(c, name, alias, mv.version, f"best of finetune run {run_id} (trial {trial.number})")
    return str(mv.version)


def _fmt(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def _exists(c: Any, name: str) -> bool:
    from mlflow.exceptions import MlflowException

    try:
        c.get_registered_model(name)
        return True
    except MlflowException:
        return False
