"""The draft rollout kernel's launch options on a GPU (gpulab.block_step.draft_rollout).

usage: python tools/rollout_probe.py OUT.json

With the shipped MLGRU draft in bf16: each of num_warps 4, 8 and 16, at batch 1 and 64
and k = 4 and 8, the mean time of a CUDA-graph replay of one launch; then the block-step
kernel alone (batch 1) the same ways. Each variant's drafts and states are compared with
4 warps' ("DIFFERENT": the row reductions' order changed a rounding somewhere; on the
H200, 2026-12-04, 16 warps did, 8 did not). That run (call 3 of 2026-12-04f) also timed
the GLU's hidden rows kept in a workspace, an option since removed: slower.
"""
from __future__ import annotations

import datetime
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gpulab import runtime  # noqa: E402
from gpulab.block_step import block_step_into, draft_rollout_into  # noqa: E402
from gpulab.engine.speculative import load_mlgru_draft  # noqa: E402
from gpulab.harness import bench  # noqa: E402


def graph_ms(fn) -> float:
    fn()                                    # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return bench.mean_ms(g.replay, 200, warmup=10)


def main(out: str) -> None:
    model = load_mlgru_draft(device="cuda", dtype=torch.bfloat16)
    w = model.rollout_weights()
    L, D = w.n_layers, w.blocks.d_model
    rows, ref = [], {}
    for b, k, warps in itertools.product((1, 64), (4, 8), (4, 8, 16)):
        first = torch.randint(0, 256, (b,), device="cuda", generator=torch.Generator("cuda").manual_seed(b))
        state = torch.randn((L, b, D), device="cuda", generator=torch.Generator("cuda").manual_seed(k))
        drafts = torch.empty((k, b), dtype=torch.long, device="cuda")
        out_states = torch.empty((L, b * (k + 1), D), device="cuda")
        src, dst = torch.arange(b, device="cuda"), torch.arange(b * (k + 1), device="cuda")

        def run():
            draft_rollout_into(first, src, dst, state, out_states, w, k, drafts, num_warps=warps)
        ms = graph_ms(run)
        key = (b, k)
        same = None
        if key not in ref:
            ref[key] = (drafts.clone(), out_states.clone())
        else:
            same = bool(torch.equal(ref[key][0], drafts) and torch.equal(ref[key][1], out_states))
        rows.append(dict(kernel="draft_rollout", batch=b, k=k, num_warps=warps, us=1e3 * ms,
                         us_per_draft_step=1e3 * ms / (k + 1), same_as_first=same))
        print(f"rollout B={b:>2} k={k} warps={warps:>2}: {1e3 * ms:7.1f} µs "
              f"({1e3 * ms / (k + 1):5.1f} µs a step){'' if same is None else ' same' if same else ' DIFFERENT'}",
              flush=True)
    blocks = [blk.step_weights() for blk in model.blocks]
    x = torch.randn((1, D), device="cuda", dtype=torch.bfloat16)
    h = torch.randn((1, D), device="cuda")
    for warps in (4, 8, 16):
        x_out, h_out = torch.empty_like(x), torch.empty_like(h)
        ms = graph_ms(lambda: block_step_into(x, h, blocks[0], x_out, h_out, num_warps=warps))
        rows.append(dict(kernel="block_step", batch=1, num_warps=warps, us=1e3 * ms))
        print(f"block_step B=1 warps={warps:>2}: {1e3 * ms:6.1f} µs", flush=True)
    Path(out).write_text(json.dumps(dict(date=datetime.date.today().isoformat(), gpu=runtime.gpu_name(),
                                         versions=runtime.versions(), rows=rows), indent=1))


if __name__ == "__main__":
    if runtime.mode() != "compiled":
        sys.exit("tools/rollout_probe.py times GPU kernels: run it on a machine with a GPU")
    main(sys.argv[1])
