#!/usr/bin/env python
"""Why the lab's rmsnorm_quant template trails the hand-written kernel on a GPU: time the
package kernel at 4 and 8 warps and the template (one row per program, a grid) at 4 and
8 warps under each subset of the rewrites that might matter, all on the lab's bench
tensors (8192 x 8192 bf16), in three interleaved rounds (median reported). The template
with ``round_once`` alone is the package kernel before its one reduction (two in a row),
and the package kernel with ``ONE_REDUCTION=False`` its two independent reductions: the
A/B of that change. The template with ``one_reduction`` and ``row_before_weights`` is
the package kernel's code (with ``rsqrt``: one reciprocal square root where the package
kernel divides by a square root).

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


variants = {}
for hand_w in (4, 8):
    for one in (True, False):
        variants[f"hand-written kernel R1 W{hand_w}{'' if one else ', tl.sum and tl.max'}"] = (
            lambda nw, one: lambda: normquant.rmsnorm_quant_fwd_kernel[(8192,)](
                x, w, q, s, x, s, 8192, 8192, 8192, 8192, 0, 1e-6, BLOCK_R=1, BLOCK_N=8192, FAKE_QUANT=False,
                ONE_REDUCTION=one, num_warps=nw))(hand_w, one)
variants["rmsnorm_quant_into (autotuned)"] = lambda: normquant.rmsnorm_quant_into(x, w, q, s)
variants["rmsnorm_quant (the public function, as called)"] = lambda: normquant.rmsnorm_quant(x, w)
for nw in (4, 8):
    for extra in ([], ["rsqrt"], ["stream_loads"], ["absmax_beside_norm"], ["absmax_beside_norm", "one_reduction"],
                  ["absmax_beside_norm", "one_reduction", "stream_loads"],
                  ["absmax_beside_norm", "one_reduction", "rsqrt"],
                  # the hand-written kernel's order of loads (the row before the weights)
                  ["absmax_beside_norm", "one_reduction", "row_before_weights"],
                  ["absmax_beside_norm", "one_reduction", "rsqrt", "row_before_weights"]):
        names = ["round_once", *extra]
        src = rw.apply_all(task.render({"ROWS_PER_PROGRAM": 1, "NUM_WARPS": nw, "PERSISTENT": False}).source, names)
        if src is None:
            print(f"W{nw} {names}: a rewrite does not apply", flush=True)
            continue
        m = load(src, f"v{nw}_{'_'.join(names)}")
        variants[f"template R1 W{nw} grid + {', '.join(names)}"] = (lambda m: lambda: m.launch(x, w, q, s))(m)
times = {k: [] for k in variants}
for _ in range(3):
    for k, fn in variants.items():
        times[k].append(t(fn))
for label, each in times.items():
    ms = sorted(each)[1]
    print(f"{label:60} {ms * 1e3:8.1f} µs  {copy_bytes / (ms * 1e-3) / 1e12:5.2f} TB/s  "
          f"({', '.join(f'{v * 1e3:.1f}' for v in each)})", flush=True)
