"""The `drafterops` MLflow flavor: a model whose files *are* the drafter folder in the serving layout.

`mlflow.artifacts.download_artifacts("models:/<name>@production")` therefore returns a folder that
SGLang and vLLM load as it is (config.json + safetensors; they ignore MLmodel). The pyfunc flavor
loads it with the project's strict loader through `loader_module`: nothing is pickled, not even the
wrapper."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

FLAVOR_NAME = "drafterops"
SERVING_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json", "README.md", "LICENSE")


def serving_files(folder: Path) -> list[Path]:
    folder = Path(folder)
    files = [folder / n for n in SERVING_FILES if (folder / n).is_file()]
    files += sorted(p for p in folder.glob("model-*-of-*.safetensors"))
    return files


def save_model(path: str | Path, drafter_folder: str | Path, mlflow_model: Any = None, **_: Any) -> None:
    """Write the drafter files + MLmodel into `path` (called by mlflow.models.Model.log)."""
    import mlflow.pyfunc
    from mlflow.models import Model

    import drafter

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for f in serving_files(Path(drafter_folder)):
        shutil.copyfile(f, path / f.name)
    mlflow_model = mlflow_model or Model()
    from drafter.methods import folder_method

    other = folder_method(drafter_folder)
    layout = "sglang" if other is None else other[0].LAYOUT
    mlflow_model.add_flavor(FLAVOR_NAME, drafter_version=getattr(drafter, "__version__", "0.1.0"), layout=layout)
    mlflow.pyfunc.add_to_model(mlflow_model, loader_module="registry.access.flavor", data=".")
    mlflow_model.save(str(path / "MLmodel"))


class DrafterPyfunc:
    """pyfunc wrapper: predict({'input_ids': [...], 'aux_hidden': [[...]], 'k': 3}) -> proposed ids.

    Needs the target's embedding when the drafter folder has none (the serving layout drops it): pass
    it as {'embedding': [[...]]} once, or load a folder that includes embed_tokens."""

    def __init__(self, folder: str) -> None:
        from drafter.formats.checkpoint import load_drafter
        from drafter.methods import folder_method

        other = folder_method(folder)
        if other is not None:
            raise ValueError(f"{folder}: a {other[0].NAME} drafter drafts from its target's embedding and head: "
                             "load it beside the target with its method's `load` (drafter.methods)")  # fmt: skip
        self.folder = folder
        self.model = load_drafter(folder)

    def predict(self, model_input: Any, params: dict[str, Any] | None = None) -> list[int]:
        import torch

        from drafter.model.eagle3 import DraftCache

        data = dict(model_input) if not hasattr(model_input, "to_dict") else model_input.to_dict("list")
        if "embedding" in data:
            with torch.no_grad():
                self.model.embed_tokens.weight.copy_(torch.tensor(data["embedding"]))
            self.model.has_embedding = True
        if not self.model.has_embedding:
            raise ValueError("this drafter has no embed_tokens; pass the target's embedding as 'embedding'")
        ids = torch.tensor(data["input_ids"]).flatten()
        aux = torch.tensor(data["aux_hidden"], dtype=torch.float32).reshape(-1, self.model.fc.in_features)
        if aux.shape[0] not in (len(ids), len(ids) - 1):
            raise ValueError("aux_hidden needs one row per input token (the last token's row may be omitted)")
        aux = aux[: len(ids) - 1]  # position t pairs the target's states at t with token t + 1
        k = int((params or {}).get("k", data.get("k", 3)))
        cache = DraftCache()
        hidden = self.model.extend(cache, ids[1:], aux)
        tokens, _ = self.model.propose(cache, hidden[:, -1:], k)
        return tokens.tolist()


def _load_pyfunc(path: str) -> DrafterPyfunc:
    return DrafterPyfunc(path)
