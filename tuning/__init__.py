"""The Optuna study behind `finetune`: search space, sampler and storage, trials and their ranks."""
