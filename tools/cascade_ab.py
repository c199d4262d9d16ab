"""Time ``cascade_decode_attention`` of whichever gpulab is first on sys.path, kernel by kernel.

An A/B tool for a regression: run it once for the current package and once with an older
checkout first on PYTHONPATH (``git archive <commit> gpulab | tar -x -C /tmp/old``), in the
same GPU session, on the same tensors (built here from a fixed seed, with plain torch, so
both versions see identical data). Prints the median time of the public call (L2 flushed),
the per-kernel GPU times from torch.profiler, and each autotuned kernel's chosen config.

    python3 tools/cascade_ab.py                      # the package in this checkout
    PYTHONPATH=/tmp/old python3 tools/cascade_ab.py  # an older one
"""
import sys

import gpulab   # first: on a CPU it selects Triton's interpreter before any kernel exists
import torch
import triton
import triton.testing
from gpulab import cascade


def inputs(prefix=32768, batch=256, hq=32, hkv=8, d=128, page=16, seed=0):
    """Prefix pages and each request's suffix pages, all shuffled in one pool (as the spec's
    benchmark case: suffix lengths 1..256 from seed 0)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 257, (batch,), generator=g).tolist()
    n_pre = -(-prefix // page)
    per_req = [-(-n // page) for n in lens]
    width = max(per_req)
    total = n_pre + sum(per_req) + 2
    perm = torch.randperm(total, generator=g)
    pre, rest = perm[:n_pre], perm[n_pre:]
    bt = torch.zeros(batch, width, dtype=torch.int32)
    at = 0
    for b, n in enumerate(per_req):
        bt[b, :n] = rest[at:at + n]
        at += n
    dev, dt = "cuda", torch.bfloat16
    k = torch.randn(total, page, hkv, d, generator=g).to(dev, dt)
    v = torch.randn(total, page, hkv, d, generator=g).to(dev, dt)
    q = (1.5 * torch.randn(batch, hq, d, generator=g)).to(dev, dt)
    return dict(q=q, k_cache=k, v_cache=v, prefix_pages=pre.to(dev, torch.int32), prefix_len=prefix,
                block_table=bt.to(dev), seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev))


def kernel_times(fn, n=20):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / e.count, e.count) for e in prof.key_averages()
            if e.device_time_total > 0]
    for name, us, count in sorted(rows, key=lambda r: -r[1] * r[2]):
        print(f"    {us:9.1f} µs x{count // n:<3} {name[:90]}")


def tuned_configs():
    for mod in (cascade, getattr(gpulab, "paged", None)):
        for name, obj in vars(mod).items():
            tuners = obj.values() if isinstance(obj, dict) else [obj]
            for t in tuners:
                if isinstance(t, triton.runtime.autotuner.Autotuner) and t.cache:
                    for key, cfg in t.cache.items():
                        print(f"    {mod.__name__}.{name} {t.fn.__name__}: {cfg}  (key {key[:4]}...)")


def main():
    print("gpulab from", gpulab.__file__, "| triton", triton.__version__, "| torch", torch.__version__)
    for hq, hkv in ((32, 8), (32, 32)):
        inp = inputs(hq=hq, hkv=hkv)
        fn = lambda: cascade.cascade_decode_attention(**inp)  # noqa: E731
        fn()
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(fn, warmup=25, rep=100)
        print(f"P32768 B256 {hq}/{hkv}: cascade_decode_attention as called {ms * 1e3:.1f} µs")
        kernel_times(fn)
    tuned_configs()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
