"""Trial-steps saved by the median pruner against running every trial to the end, at the same best
value: the study `finetune` runs (TPE sized to the budget, the baseline trial first, the honest
objective: validation set, the profile's draft depth, out-of-vocabulary targets as rejections) on
the mini world's K2.5 fine-tuning data, with and without the pruner.

    python -m bench.pruning
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import optuna

from bench._common import write_results
from common.prompt_files import read_prompts
from drafter.data.capture import capture, plan_capture
from drafter.data.dataset import HiddenStateDataset
from drafter.formats.checkpoint import load_drafter
from drafter.model.target import load_target
from drafter.train.loop import TrainConfig, TrainingStopped, attach_target_embedding, train
from serving.profile import load_profile
from tuning.space import load_space, suggest

ROOT = Path(__file__).resolve().parents[1]
MW = ROOT / "miniworld"


def study(ds, val, base, pruner, n_trials: int, steps: int, depth: int) -> tuple[float, int]:
    from tuning.space import DEFAULT_BASELINE, load_settings
    from tuning.study import open_study

    space = load_space(str(ROOT / "configs" / "search_space.yaml"))
    baseline = load_settings(DEFAULT_BASELINE, space)
    used = 0

    def objective(trial):
        nonlocal used
        cfg = TrainConfig(
            max_steps=steps, batch_size=8, max_len=256, val_every=steps // 6, val_draft_steps=depth,
            **suggest(trial, space),
        )  # fmt: skip
        model = copy.deepcopy(base)
        model.has_embedding = True

        def on_validate(step, stats):
            trial.report(stats.sim_accept_len, step)
            return trial.should_prune()

        try:
            res = train(model, ds, cfg, on_validate=on_validate, progress=False, val_dataset=val)
        except TrainingStopped as stop:
            used += stop.step
            raise optuna.TrialPruned() from None
        used += steps
        return res.val.sim_accept_len

    s, _, _ = open_study(optuna.storages.InMemoryStorage(), "bench", 0, n_trials, pruner)
    s.enqueue_trial({k: baseline[k] for k in space})
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
        sets = {}
        for split in ("train", "val"):
            records = read_prompts(MW / "prompts" / f"k2.5-{split}.jsonl")
            folder = Path(tmp) / split
            capture(target, plan_capture(target, records, 256), folder, base.config.aux_layer_ids, meta, progress=False)
            sets[split] = HiddenStateDataset(folder)
        ds, val = sets["train"], sets["val"]
        attach_target_embedding(base, ds)
        depth = load_profile("kimi-k2.5-8xrtxpro6000").draft_steps
        n, steps = 8, 120
        with_p = study(
            ds, val, base, optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=0), n, steps, depth
        )
        without = study(ds, val, base, optuna.pruners.NopPruner(), n, steps, depth)
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
    notes = (
        f"Pruning ran {100 * (1 - with_p[1] / without[1]):.0f}% fewer trial-steps. Objective: val_sim_accept_len "
        f"on k2.5-val at {depth} draft steps; trial 0 is the baseline (configs/baseline_trial.yaml)."
    )
    print(write_results("pruning", rows, notes))


if __name__ == "__main__":
    main()
