"""A stand-in for SpecForge's `scripts/prepare_hidden_states.py`, which needs SGLang on a GPU: the same command
line and the same output (one `.ckpt` per conversation: input_ids, loss_mask, hidden_state after the final
norm, aux_hidden_state), the states taken from the target loaded in this process. `--chat-template mangled`
tokenizes otherwise (one token dropped), as a template that is not the target's would."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from drafter.data.prompts import tokenize_record
from drafter.model.target import load_target


def main() -> None:
    p = argparse.ArgumentParser()
    for flag in ("--target-model-path", "--data-path", "--output-path", "--chat-template", "--strategy",
                 "--draft-model-config"):  # fmt: skip
        p.add_argument(flag, required=True)
    p.add_argument("--max-length", type=int, required=True)
    p.add_argument("--tp-size", type=int, default=1)
    args = p.parse_args()
    layers = json.loads(Path(args.draft_model_config).read_text())["eagle_aux_hidden_state_layer_ids"]
    target = load_target(args.target_model_path, progress=False)
    target.set_aux_layers(layers)
    out = Path(args.output_path) / "rows_0-5000"
    out.mkdir(parents=True)
    for i, line in enumerate(Path(args.data_path).read_text().splitlines()):
        rec = {"messages": json.loads(line)["conversations"]}
        tok = tokenize_record(target.tokenizer, rec, args.max_length)
        ids = tok.input_ids[1:] if args.chat_template == "mangled" else tok.input_ids
        res = target.forward(torch.tensor([ids]))
        mask = torch.tensor(tok.loss_mask[: len(ids)]).long()
        sample = {"input_ids": torch.tensor(ids), "loss_mask": mask, "hidden_state": res.last_hidden,
                  "aux_hidden_state": res.aux_hidden}  # fmt: skip
        torch.save(sample, out / f"data_{i}.ckpt")


if __name__ == "__main__":
    main()
