"""The main job as a user starts it: `mlflow run . --env-manager local` on the mini world."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# the full tier's main job: a smaller study and fewer decoded tokens than the README's defaults (the same
# code paths); the fast tier runs `steps.main` at the smallest settings that still train, evaluate and decide,
# its bake-off included. Here the bake-off is left out: at --limit 6 it would evaluate all six drafters again
# on the whole workload (about 7 minutes of a tier budgeted at 35; compare is tests/test_compare.py's)
MAIN_PARAMS = {"n_trials": "2", "max_steps": "60", "limit": "6", "max_new_tokens": "32", "calibrate": "no",
               "bakeoff": "no"}  # fmt: skip


def main_command(tmp: Path) -> tuple[list[str], dict[str, str]]:
    """`mlflow run . --env-manager local` on the mini world into `tmp`, at MAIN_PARAMS."""
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp}/mlflow.db",
        "DRAFTEROPS_CACHE": str(tmp / "cache"),
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
    }
    cmd = [str(Path(sys.executable).with_name("mlflow")), "run", str(ROOT), "--env-manager", "local",
           "--experiment-name", "drafterops"]  # fmt: skip
    cmd += ["-P", f"workdir={tmp / 'work'}", *[x for k, v in MAIN_PARAMS.items() for x in ("-P", f"{k}={v}")]]
    return cmd, env


# the fast tier's main job: one trial of a few steps, evidence on a small pinned set at a lenient
# break-even (0.3: any drafter beats it), so the decision is a real promotion on real evidence
SMALL_PARAMS = {"n_trials": "1", "max_steps": "8", "limit": "0", "max_new_tokens": "auto", "calibrate": "no"}


def small_profile(folder: Path) -> Path:
    """A profile pinned to the first 8 prompts of the mini world's code workload, 8 new tokens each."""
    from common.prompt_files import file_digest

    prompts = folder / "small-workload.jsonl"
    lines = (ROOT / "miniworld" / "prompts" / "workload-code.jsonl").read_text().splitlines()[:8]
    prompts.write_text("".join(line + "\n" for line in lines))
    profile = folder / "small.yaml"
    profile.write_text(
        "name: small\nbaseline_tps: 33.4\nverify_ms: 30\ndraft_step_ms: 0\ndraft_steps: 2\nmin_prompts: 8\n"
        f"target: {ROOT / 'miniworld' / 'k2.5-mini'}\n"
        f"eval_prompts: {prompts.name}\neval_prompts_sha256: {file_digest(prompts)}\neval_max_new_tokens: 8\n"
    )
    return profile


def small_main_args(folder: Path) -> list[str]:
    """`python -m steps.main` at the smallest settings that still train, evaluate and decide."""
    args = ["--workdir", str(folder / "work"), "--profile", str(small_profile(folder))]
    return args + [x for k, v in SMALL_PARAMS.items() for x in (f"--{k}", v)]


class SmallMainJob:
    """`python -m steps.main` at SMALL_PARAMS into `folder`, its result kept there for other readers."""

    def __init__(self, folder: Path, timeout: float = 900) -> None:
        self.folder, self.timeout = folder, timeout
        self.record = folder / "result.json"

    def run(self) -> None:
        """Run it and record how it ended, a timeout or a crash of the runner included, so a later reader
        sees that outcome instead of running it again over what this run left in the folder."""
        from tests.helpers.steps import run_module, step_env

        args = small_main_args(self.folder)
        try:
            res = run_module("steps.main", args, self.folder, step_env(self.folder), self.timeout)
            done = {"args": res.args, "returncode": res.returncode, "stdout": res.stdout, "stderr": res.stderr}
        except BaseException as exc:
            done = {
                "args": ["python", "-m", "steps.main", *args],
                "returncode": -1,
                "stdout": "",
                "stderr": f"the small main job did not finish: {exc!r}",
            }
            raise
        finally:
            staged = self.record.with_suffix(".tmp")
            staged.write_text(json.dumps(done))
            staged.replace(self.record)  # whole or absent for a reader

    def result(self) -> tuple[Path, subprocess.CompletedProcess]:
        done = json.loads(self.record.read_text())
        return self.folder, subprocess.CompletedProcess(
            done["args"], done["returncode"], done["stdout"], done["stderr"]
        )
