"""Serving engines behind one interface: decode these prompts with this drafter and report per-prompt
cycles, acceptance and timings. The in-process decoder (drafter/speculate.py), vLLM and SGLang each
sit behind it; `steps/evaluate.py` only picks one and logs what it reports."""
