#!/usr/bin/env python
"""Where paged decode's CUDA-graph time stands against FlashInfer, tile by tile: at the
bench cases B64 L4096 and B4 L32768 (32/8 heads, D128, page 16, bf16), time the launcher
replayed in a CUDA graph for each number of partitions near the planned one and each tile
configuration (BLOCK_N, warps, stages: the tuned lists and a few more), with FlashInfer's
decode run() on the same tensors, all timed as the benchmark times them (do_bench
median, L2 flushed). Prints one line per configuration, best first, and what plan() and
the autotuner chose.

    python tools/paged_probe.py [--quick]

A probe, not a user of the package: it swaps one-config autotuners into `paged`'s tuning
table (`_decode_tuned`) for each measurement and puts the originals back.
"""
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gpulab import paged  # noqa: E402
from gpulab.grading import paged as grading  # noqa: E402
from gpulab.harness.bench import time_ms  # noqa: E402
from gpulab.harness.spec import Case  # noqa: E402

# (BLOCK_N, warps, stages): the tuned list for sm_80+ and its neighbours
CONFIGS = sorted(set(paged._DECODE_BIG) | {(32, 4, 4), (32, 8, 3), (64, 8, 3), (128, 4, 3), (32, 2, 3),
                                           (64, 2, 3), (16, 4, 3), (64, 4, 5)})
CASES = [Case("B64 L4096", dict(lens=[4096] * 64, page=16, hq=32, hkv=8, d=128, spare=0, pad=0)),
         Case("B4 L32768", dict(lens=[32768] * 4, page=16, hq=32, hkv=8, d=128, spare=0, pad=0))]


def graph_of(fn):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return lambda: g.replay()


def main(argv) -> int:
    quick = "--quick" in argv
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    for case in CASES:
        inp = grading.make_paged_inputs(case.params, torch.bfloat16, torch.device("cuda"), gen)
        q, kc, vc, bt, sl = (inp[k] for k in ("q", "k_cache", "v_cache", "block_table", "seq_lens"))
        o, lse = torch.empty_like(q), torch.empty(q.shape[:2], device="cuda", dtype=torch.float32)
        B, hkv, cap = q.shape[0], kc.shape[2], bt.shape[1] * kc.shape[1]
        planned, _ = paged.plan_splits(B, hkv, cap)
        regime = paged.launch_regime(B * hkv * planned)
        print(f"== {case.label}: plan() splits {planned}, regime {regime!r}", flush=True)
        rows = []
        if grading.FLASHINFER_INSTALLED:
            fi = grading.flashinfer_decode_baseline()
            rows.append((time_ms(lambda: fi(inp)) * 1e3, "FlashInfer decode run() (as called)"))
        ref = paged.paged_decode_attention(q, kc, vc, bt, sl)
        auto = graph_of(lambda: paged.paged_decode_into(q, kc, vc, bt, sl, o, lse))
        rows.append((time_ms(auto) * 1e3, f"gpulab as planned (splits {planned}, autotuned), graph"))
        splits = sorted({s for s in (planned // 2, planned, planned * 2, 1, 2, 3, 4) if s >= 1})
        originals = dict(paged._decode_tuned)
        for bn, w, st in (CONFIGS[:4] if quick else CONFIGS):
            one = triton.autotune(configs=[triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=st)],
                                  key=["BLOCK_G", "BLOCK_D", "UPCAST", "IEEE"])(paged._decode_partition_kernel)
            for s in splits:
                regime_s = paged.launch_regime(B * hkv * s)
                paged._decode_tuned[("big", regime_s)] = one
                try:
                    run = graph_of(lambda: paged.paged_decode_into(q, kc, vc, bt, sl, o, lse, num_splits=s))
                    ok = torch.allclose(o.float(), ref.float(), atol=2e-2, rtol=2e-2)
                    rows.append((time_ms(run) * 1e3, f"splits {s:>3} BLOCK_N {bn:>3} warps {w} stages {st}"
                                 + ("" if ok else "  WRONG OUTPUT")))
                except Exception as e:      # out of shared memory, say
                    rows.append((float("inf"), f"splits {s} BLOCK_N {bn} warps {w} stages {st}: "
                                 f"{type(e).__name__}: {str(e)[:80]}"))
                finally:
                    paged._decode_tuned.update(originals)
        for us, what in sorted(rows):
            print(f"  {us:8.1f} µs  {what}", flush=True)
        del inp, q, kc, vc
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
