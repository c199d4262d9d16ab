#!/usr/bin/env python
"""Why the lab's rmsnorm_quant template trailed the hand-written kernel on a GPU: time the
template at a few genes (with the round_once rewrite; a grid of one row block per program
also through the persistent loop, one trip each) and the package kernel at each warp
count, all on the lab's bench tensors (8192 x 8192 bf16).

    python tools/lab_rmsnorm_probe.py
"""
import importlib.util
import sys
import tempfile
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gpulab import normquant  # noqa: E402
from gpulab.lab import rewrites as rw  # noqa: E402
from gpulab.lab.tasks import get_task  # noqa: E402

task = get_task("rmsnorm_quant")
tmp = Path(tempfile.mkdtemp())


def load(src: str, name: str):
    p = tmp / f"{name}.py"
    p.write_text(src)
    spec = importlib.util.spec_from_file_location(name, p)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
w = torch.rand(8192, device="cuda", dtype=torch.bfloat16) + 0.5
q = torch.empty(8192, 8192, device="cuda", dtype=torch.int8)
s = torch.empty(8192, device="cuda", dtype=torch.float32)
copy_bytes = x.numel() * 3 + 8192 * 6


def t(fn):
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=100)


rows = []
for hand_w in (4, 8, 16):
    ms = t(lambda: normquant.rmsnorm_quant_fwd_kernel[(8192,)](
        x, w, q, s, x, s, 8192, 8192, 8192, 8192, 0, 1e-6, BLOCK_R=1, BLOCK_N=8192, FAKE_QUANT=False,
        num_warps=hand_w))
    rows.append((f"hand-written kernel R1 W{hand_w}", ms))
rows.append(("rmsnorm_quant_into (autotuned)", t(lambda: normquant.rmsnorm_quant_into(x, w, q, s))))
for r in (1, 2, 4):
    for nw in (4, 8, 16):
        for pers in (False, True):
            src = rw.apply_all(task.render({"ROWS_PER_PROGRAM": r, "NUM_WARPS": nw, "PERSISTENT": pers}).source,
                               ["round_once"])
            m = load(src, f"v{r}_{nw}_{pers}")
            rows.append((f"template R{r} W{nw} {'persistent' if pers else 'grid'}", t(lambda: m.launch(x, w, q, s))))
            if not pers:   # the grid's programs through the persistent loop (one trip each)
                rows.append((f"template R{r} W{nw} grid, through the loop", t(lambda: m.rmsnorm_quant_kernel[
                    (triton.cdiv(8192, r),)](x, w, q, s, 8192, 8192, 1e-6, R=r, BLOCK_N=8192,
                                             PERSISTENT=True, num_warps=nw))))
for label, ms in rows:
    print(f"{label:45} {ms * 1e3:8.1f} µs  {copy_bytes / (ms * 1e-3) / 1e9:6.0f} GB/s", flush=True)
