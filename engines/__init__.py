"""Serving engines behind one interface (engines/protocol.py): decode these prompts with this drafter and
report per-prompt cycles, acceptance and timings. The in-process decoder (drafter/decode/speculate.py), vLLM and
SGLang each sit behind it; a step picks one by name once and logs what it reports."""
