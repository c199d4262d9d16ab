"""The host path of public functions, with their Triton launches replaced by no-ops.

    PYTHONPATH=. python3 tools/host_path.py [--calls 3000] [--profile]

On a GPU a decode-sized call is often host-bound: the Python before the launch (checks,
allocation, planning, Triton's launcher) takes longer than the kernel. This isolates that
Python on any machine (tensors on gpulab's device: the GPU where there is one, else the
CPU): every Triton kernel and autotuner of the modules below (paged, cascade, bitlinear) launches
nothing, so the time per call is the host path alone (without Triton's own launcher, which
the GPU host adds). Compare two commits by running it with each on PYTHONPATH, alternately:
timings on a shared machine move by tens of percent.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402

from gpulab import bitlinear, cascade, paged, runtime  # noqa: E402


class _NoLaunch:
    """Stands in for a kernel or an autotuner: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def stub_launches(module) -> None:
    for name in dir(module):
        kind = type(getattr(module, name)).__name__
        if kind in ("JITFunction", "InterpretedFunction", "Autotuner"):
            setattr(module, name, _NoLaunch())
        elif isinstance(getattr(module, name), dict) and name.endswith("_tuned"):
            setattr(module, name, {k: _NoLaunch() for k in getattr(module, name)})


def calls() -> dict:
    B, hq, hkv, d, page, length = 4, 32, 8, 128, 16, 32768
    pages = B * length // page
    dev = runtime.device()
    q = torch.randn(B, hq, d, dtype=torch.bfloat16, device=dev)
    k = torch.empty(pages, page, hkv, d, dtype=torch.bfloat16, device=dev)
    table = torch.arange(pages, dtype=torch.int32, device=dev).view(B, -1)
    lens = torch.full((B,), length, dtype=torch.int32, device=dev)
    x_q = torch.randint(-127, 127, (1, 8192), dtype=torch.int8, device=dev)
    x_scale = torch.rand(1, device=dev) + 0.5
    x_q16 = torch.randint(-127, 127, (16, 8192), dtype=torch.int8, device=dev)
    x_scale16 = torch.rand(16, device=dev) + 0.5
    w = torch.randint(0, 255, (8192, 2048), dtype=torch.uint8, device=dev)
    w_scale = torch.tensor([0.7], device=dev)
    # cascade: a 32768-token prefix shared by 256 requests with 256 tokens each (32/8 heads)
    cq = torch.randn(256, hq, d, dtype=torch.bfloat16, device=dev)
    ck = torch.empty(32768 // page + 256 * 256 // page, page, hkv, d, dtype=torch.bfloat16, device=dev)
    prefix = torch.arange(32768 // page, dtype=torch.int32, device=dev)
    ctable = (32768 // page + torch.arange(256 * 256 // page, dtype=torch.int32, device=dev)).view(256, -1)
    clens = torch.full((256,), 256, dtype=torch.int32, device=dev)
    return {"paged_decode_attention B4 L32768": lambda: paged.paged_decode_attention(q, k, k, table, lens),
            "cascade_decode_attention 256 x (32768 + 256)": lambda: cascade.cascade_decode_attention(
                cq, ck, ck, prefix, 32768, ctable, clens),
            "ternary_matmul M=1 K=N=8192": lambda: bitlinear.ternary_matmul(x_q, x_scale, w, w_scale),
            "ternary_matmul M=16 K=N=8192": lambda: bitlinear.ternary_matmul(x_q16, x_scale16, w, w_scale)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--profile", action="store_true", help="also print where the time goes")
    a = p.parse_args(argv)
    for module in (paged, cascade, bitlinear):
        stub_launches(module)
    for name, fn in calls().items():
        for _ in range(100):
            fn()
        batches = []              # the fastest of 7 batches: other processes only slow a batch down
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(a.calls // 7):
                fn()
            batches.append((time.perf_counter() - t0) / (a.calls // 7) * 1e6)
        print(f"{name:46} {min(batches):7.1f} µs a call (launches stubbed; fastest of 7 batches, "
              f"median {sorted(batches)[3]:.1f})")
        if a.profile:
            prof = cProfile.Profile()
            prof.runcall(lambda: [fn() for _ in range(a.calls)])
            pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    return 0


if __name__ == "__main__":
    sys.exit(main())
