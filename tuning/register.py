"""The study's best trial becomes a registry version (lineage, settings, files), and the alias
follows the study's best; and the init a study starts from, refused unless its gate passed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common.errors import BadInput


def prepare_init(init: str, dataset: Any, arch: str):
    """(base drafter or None for scratch, DrafterConfig, ModelVersion or None); refuses an init whose
    shape gate has not passed for the dataset's target."""
    from drafter.checkpoint import load_drafter
    from drafter.config import DrafterConfig
    from drafter.train import attach_target_embedding, check_fit

    if init == "scratch":
        cfg = DrafterConfig.from_file(Path(arch) / "config.json" if Path(arch).is_dir() else arch)
        check_fit(cfg, dataset)
        return None, cfg, None
    mv = None
    if init.startswith("models:/"):
        from registry import naming, store

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
        from registry.resolve import resolve_drafter

        folder = resolve_drafter(init).folder
    model = load_drafter(folder)
    check_fit(model.config, dataset)
    attach_target_embedding(model, dataset)
    return model, model.config, mv


def init_digest(init: str, parent: Any) -> str:
    """The init's weights by value (drafter.fingerprint.tensor_digest; "" from scratch): whatever the init
    was named by (registry URI, folder or hub id), lineage follows it to the runs that produced it."""
    from drafter.fingerprint import tensor_digest

    if init == "scratch":
        return ""
    if parent is not None:
        from registry import store

        return tensor_digest(store.download_version(f"models:/{parent.name}/{parent.version}").folder)
    from registry.resolve import resolve_drafter

    return tensor_digest(resolve_drafter(init).folder)


def default_name(dataset: Any) -> str:
    from registry.naming import model_name_for

    return model_name_for(str(dataset.index.get("target", "target")))


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
    from registry import audit, store

    hashes = store.file_hashes(folder)
    c = store.client()
    target = str(dataset.index.get("target", ""))
    with store.registry_lock():
        if not _exists(c, name):
            store.ensure_registered_model(c, name, target)
        same = store.find_complete_version(c, name, store.weights_sha256(hashes))
        if same is None:
            return _register(c, folder, name, parent, dataset, trial, alias, run_id, hashes, target, init_digest)
    # another worker of the same study registered this trial already: the alias still follows the
    # study's best, which is that version
    if alias and audit.current_alias_version(c, name, alias) != str(same.version):
        audit.move_alias(c, name, alias, same.version, f"best of study (trial {trial.number}), registered before")
    return str(same.version)


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
    from registry import audit, naming, store

    tags = {
        naming.TAG_SOURCE: f"run:{run_id}",
        naming.TAG_SHA256: store.weights_sha256(hashes),
        naming.TAG_TRAINED_FOR: naming.target_slug(target),
        naming.TAG_DATASET: dataset.digest,
        "optuna.trial": str(trial.number),
        "val_sim_accept_len": f"{trial.value:.4f}",
    }
    if parent is not None:
        tags[naming.TAG_PARENT] = f"models:/{parent.name}/{parent.version}"
    from drafter.checkpoint import read_header
    from registry.describe import contents, run_md, upsert_section

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
    from drafter.fingerprint import tensor_digest
    from registry.lineage import log_training_prompts

    log_training_prompts(dataset, tensor_digest(folder), init_digest)
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
