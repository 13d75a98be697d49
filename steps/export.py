"""`export`: hand a promoted drafter to a server: the folder the engine loads as it is, `serve.sh` with the
exact server command at the depth the promotion was decided at, and EXPORT.md saying what it is.

Only the sanctioned holder of `staging` or `production` is exported (the alias's signed record, not its
label), unless --any_version; the shape gate is recomputed against the export's target first.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cli.spec import Param, Spec
from cli.step import log_params, run_step, step_run
from common.errors import BadInput
from common.values import draft_depth, none_if_empty
from engines.endpoint import drafter_name, export_digest
from engines.vllm import Settings
from pipeline.promotion import decision_of
from registry.access import naming
from registry.ledger import sanction

SERVING = ("production", "staging")


SPEC = Spec(
    "export",
    __doc__,
    (
        Param("model", default="models:/k2.5-mini-eagle3@production", help="a registry URI"),
        Param("engine", default="vllm", help="sglang, vllm or speculators"),
        Param("out", default="none", help="a new (or empty) folder"),
        Param("target", default="auto", help="auto: the registered model's target"),
        Param("draft_steps", default="auto", help="auto: the depth the promotion was decided at"),
        Param(
            "any_version",
            bare="yes",
            default="no",
            help="export a version that holds no serving alias",
            choices=("yes", "no"),
        ),
    ),
)


def build() -> argparse.ArgumentParser:
    return SPEC.parser()


@dataclass(frozen=True)
class Request:
    """A registry version to hand to an engine, checked: where it goes, on which target, at which depth."""

    mv: Any
    folder: Path
    aliases: list[str]  # the serving aliases it holds by a promote decision
    target: str
    k: int
    evidence_run: str
    out: Path


def run(args: argparse.Namespace) -> int:
    request, c = parse(args)
    write(args.engine, request)
    publish(args, c, request)
    mv, out = request.mv, request.out
    print(f"export: models:/{mv.name}/{mv.version} ({', '.join(request.aliases) or 'no serving alias'}) for "
          f"{args.engine} at k={request.k} -> {out}\n  serve it: {out / 'serve.sh'}")  # fmt: skip
    return 0


def parse(args: argparse.Namespace) -> tuple[Request, Any]:
    """The output folder (a plain, empty one whose name serve.sh can carry), the version and the serving alias it
    holds, its target (and the shape gate's pass against it), and the depth the promotion was decided at."""
    # deferred: torch comes with these, and --help or refused input needs none of it
    from drafter.methods import require_fit
    from engines import export
    from registry.access import store

    if args.engine not in export.ENGINES:
        raise BadInput(f"--engine must be one of {', '.join(export.ENGINES)}, got {args.engine!r}")
    out = Path(none_if_empty(args.out) or "")
    if not none_if_empty(args.out):
        raise BadInput("--out must name the folder to write")
    if out.is_symlink() or any(p.is_file() for p in out.resolve().parents):
        raise BadInput(f"--out {out}: a link, or under a file: give a plain folder path")
    if any(ch in str(out.resolve()) for ch in "\"'\\\n$`"):  # serve.sh and the JSON it passes name the folder
        raise BadInput(f"--out {out}: a folder name with quotes, backslashes, $ or backticks cannot be served safely")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise BadInput(f"--out {out} exists and is not an empty folder")
    if not args.model.startswith("models:/"):
        raise BadInput(f"--model must be a registry URI (models:/name@production, models:/name/3), got {args.model!r}")
    c = store.client()  # only once the arguments are known good: bad input leaves no store behind
    mv, folder = store.version_folder(args.model)
    aliases = [a for a in SERVING if sanction.holder(c, mv.name, a).version == str(mv.version)]
    if not aliases and args.any_version != "yes":
        raise BadInput(
            f"models:/{mv.name}/{mv.version} holds no serving alias by a promote decision (staging or production); "
            "give --any_version yes to export it anyway"
        )
    target = none_if_empty(args.target) or c.get_registered_model(mv.name).tags.get(naming.MODEL_TAG_TARGET)
    if not target:
        raise BadInput(f"registered model {mv.name!r} names no target: give --target")
    require_fit(folder, target, f"models:/{mv.name}/{mv.version} has no shape-gate pass against {target}")
    evidence_run, decided_k = decision_of(c, mv.name, aliases)
    if none_if_empty(args.draft_steps):
        k = draft_depth(args.draft_steps)
    elif decided_k:
        k = decided_k
    else:
        raise BadInput(
            f"models:/{mv.name}/{mv.version} has no promotion decision to take the depth from: give --draft_steps"
        )
    if decided_k and k != decided_k:
        print(f"export: warning: k={k}, but the promotion was decided at k={decided_k}: another deployment")
    return Request(mv, folder, aliases, target, k, evidence_run, out), c


def write(engine: str, r: Request) -> None:
    """The folder the engine loads, serve.sh and EXPORT.md, written in a staging folder and renamed into place."""
    # deferred: torch comes with these, and --help or refused input needs none of it
    from drafter.analysis.compat import target_facts
    from engines import export
    from pipeline.promotion import decided_profile
    from registry.access import store
    from serving import speculation_profile

    out = r.out
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        exported = export.write(r.folder, staging, engine, r.k, r.target)
        if engine == "vllm":  # a second served name says which drafter runs (the production watch reads it)
            exported.names = (drafter_name(export_digest(staging)),)
        context = int(target_facts(r.target).config.text_config.get("max_position_embeddings", 4096))
        settings = Settings(k=r.k, max_new_tokens=1, max_model_len=context)
        exported.folder = out.resolve()  # serve.sh names the folder it ends up in
        holder = (r.mv.name, r.aliases[0], str(r.mv.version)) if r.aliases else None
        (staging / "serve.sh").write_text(export.serve_script(exported, settings, holder))
        (staging / "serve.sh").chmod(0o755)
        (staging / "EXPORT.md").write_text(describe(r.mv, r.aliases, r.evidence_run, exported, r.target))
        checkpoint = {"id": f"{r.mv.name}/v{r.mv.version}", "format": exported.engine}
        speculation_profile.write(decided_profile(store.client(), r.evidence_run, r.k, checkpoint), staging)
        if out.exists():
            out.rmdir()
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def publish(args: argparse.Namespace, c: Any, r: Request) -> None:
    """The run (its files and their digests) and the version's `exported.<engine>` tag."""
    # deferred: mlflow, and torch with the modules below, take seconds; --help or refused input needs neither
    import mlflow

    from registry.access import store

    mv, out = r.mv, r.out
    with step_run("export", run_name=f"export v{mv.version} -> {args.engine}"):
        log_params({"model": args.model, "engine": args.engine, "out": str(out), "target": r.target,
                    "draft_steps": r.k, "any_version": args.any_version})  # fmt: skip
        for name in ("config.json", "serve.sh", "EXPORT.md", "speculation_profile.json"):
            mlflow.log_artifact(str(out / name), "export")
        mlflow.log_dict(store.file_hashes(out), "export/files_sha256.json")
        run_id = mlflow.active_run().info.run_id
        mlflow.set_tag("mlflow.note.content", f"Exported models:/{mv.name}/{mv.version} for {args.engine} to `{out}`.")
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        c.set_model_version_tag(
            mv.name, mv.version, f"exported.{args.engine}", f"run {run_id} -> {out} at k={r.k} ({when})"
        )


def describe(mv, aliases: list[str], evidence_run: str, exported, target: str) -> str:
    """EXPORT.md: which version, which alias, which evidence, which target layers the engine feeds."""
    aux = exported.aux
    lines = [
        f"# {mv.name} v{mv.version} for {exported.engine}",
        "",
        f"- version: `models:/{mv.name}/{mv.version}` ("
        + (", ".join(aliases) or "no serving alias: exported with --any_version")
        + ")",
        f"- evidence run: `{evidence_run or 'none'}`",
        f"- target: `{target}`; handed to the engine as `{exported.target}`",
        f"- draft depth: k={exported.k}",
        f"- aux layer ids handed: {aux['handed_ids']} ({exported.engine} reads id i as {aux['engine_reads_id_as']}): "
        f"the target layer outputs fed are {aux['target_layer_outputs_fed']}, the drafter was trained on "
        f"{aux['project_ids']} ({'as trained' if aux['matches_training'] else 'NOT as trained'})",
        "- norm flags: norm_before_residual, norm_before_fc, fc_norm, norm_output all false (the plain EAGLE-3 "
        "network); embed_tokens left out (the engine takes the target's)",
        "",
        "Serve it with `./serve.sh` (PORT, HOST, PYTHON, TARGET can be set).",
    ]
    if exported.engine == "speculators":
        lines.append(
            "The folder names its verifier (`speculators_config.verifier.name_or_path`); on another machine edit "
            "it to where the target is."
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    run_step("export", build, run, argv)


if __name__ == "__main__":
    main()
