"""What the tests share, as a small library (no fixtures here: those stay in tests/conftest.py).

- `drafters`: tiny drafters and the real K2 drafter's tensor shapes, written by the tests (no downloads).
- `targets`: tiny DeepSeek-V3 targets, flat and Kimi-K2.5-style, with a trained tokenizer.
- `prompts`: a few chat and text records, and writing them as JSONL.
- `steps`: a step as a user runs it (forked from the step zygote, a new interpreter, or in this process).
- `step_zygote`: the zygote itself, a script the `steps` client starts.
- `servers`: free loopback ports, a live `mlflow server`, a throwaway PostgreSQL.
- `stores`: reading what the steps logged (the project's runs, every run of a store).
- `promotion`: gated tiny drafters and the profiles that pin their workload (promote, export, attacks).
- `main_job`: the main job's command line at the suite's settings (full tier), and the small main job
  (fast tier) run once and read by any worker.
- `checks`: assertions more than one test module makes (one line, exit 2).
- `rank_train`: one rank of the data-parallel test, run as a process or under torchrun.
"""
