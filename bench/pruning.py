"""Trial-steps saved by the median pruner against running every trial to the end, at the same best
value: the same TPE study (same seed, same trials) on the mini world's K2.5 fine-tuning data.

    python -m bench.pruning
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import optuna

from bench._common import write_results
from drafter.capture import capture, plan_capture
from drafter.checkpoint import load_drafter
from drafter.data import HiddenStateDataset
from drafter.prompts import read_prompts
from drafter.target import load_target
from drafter.train import TrainConfig, TrainingStopped, attach_target_embedding, train
from steps.finetune import load_space, suggest

ROOT = Path(__file__).resolve().parents[1]
MW = ROOT / "miniworld"


def study(ds, base, pruner, n_trials: int, steps: int) -> tuple[float, int]:
    space = load_space(str(ROOT / "configs" / "search_space.yaml"))
    used = 0

    def objective(trial):
        nonlocal used
        cfg = TrainConfig(max_steps=steps, batch_size=8, max_len=256, val_every=steps // 4, **suggest(trial, space))
        model = copy.deepcopy(base)
        model.has_embedding = True
        done = [0]

        def on_validate(step, stats):
            done[0] = step
            trial.report(stats.sim_accept_len, step)
            return trial.should_prune()

        try:
            res = train(model, ds, cfg, on_validate=on_validate, progress=False)
        except TrainingStopped as stop:
            used += stop.step
            raise optuna.TrialPruned() from None
        used += steps
        return res.val.sim_accept_len

    s = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=0), pruner=pruner)
    s.optimize(objective, n_trials=n_trials)
    return s.best_value, used


def main() -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    target = load_target(MW / "k2.5-mini")
    base = load_drafter(MW / "aq-mini-eagle3")
    with tempfile.TemporaryDirectory() as tmp:
        meta = {
            "target": "k2.5-mini",
            "layer_ids": base.config.aux_layer_ids,
            "hidden_size": 128,
            "vocab_size": target.config.vocab_size,
        }
        records = read_prompts(MW / "prompts" / "k2.5-train.jsonl")
        capture(
            target,
            plan_capture(target, records, 256),
            Path(tmp) / "ds",
            base.config.aux_layer_ids,
            meta,
            progress=False,
        )
        ds = HiddenStateDataset(Path(tmp) / "ds")
        attach_target_embedding(base, ds)
        n, steps = 8, 120
        with_p = study(ds, base, optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=0), n, steps)
        without = study(ds, base, optuna.pruners.NopPruner(), n, steps)
    rows = [
        {
            "study": f"{n} trials x {steps} steps, MedianPruner",
            "best_val_sim_accept_len": f"{with_p[0]:.3f}",
            "trial_steps": with_p[1],
        },
        {
            "study": f"{n} trials x {steps} steps, no pruning",
            "best_val_sim_accept_len": f"{without[0]:.3f}",
            "trial_steps": without[1],
        },
    ]
    notes = f"Pruning ran {100 * (1 - with_p[1] / without[1]):.0f}% fewer trial-steps."
    print(write_results("pruning", rows, notes).read_text())


if __name__ == "__main__":
    main()
