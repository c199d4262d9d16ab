"""The speculative benchmark's first configuration alone (GPU only): batch 1, the MLGRU
draft, k = 2, drafting and verifying in CUDA graphs, against the target alone on the
benchmark's prompts; prints OK or the first token that differs and is not a near tie.

    python tools/speculative_check.py [--max-tokens 48]
    GPULAB_DIRECT_LAUNCH=0 python tools/speculative_check.py    # Triton's own launch path

On 2026-12-03 (`8949d58`) tools/speculative_bench.py failed here (request 1, token 39,
not a near tie); this reruns just that, a minute instead of six, to bisect it.
"""
import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import speculative_bench as sb  # noqa: E402
from gpulab.engine import speculative as spec  # noqa: E402
from gpulab.engine.model import load_checkpoint  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=48)
    a = ap.parse_args()
    target = load_checkpoint(device="cuda", dtype=torch.bfloat16)
    draft = spec.load_mlgru_draft(device="cuda", dtype=torch.bfloat16)
    label = f"direct launch {os.environ.get('GPULAB_DIRECT_LAUNCH', '1')}"
    try:
        sb.bench_speculation(target, {"mlgru": lambda: spec.MLGRUDrafter(draft)}, 1, a.max_tokens, (2,), 1)
    except AssertionError as e:
        print(f"DIFFERS ({label}): {e}")
        return 1
    print(f"OK ({label})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
