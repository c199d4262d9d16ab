"""The attention family's benchmarks on a GPU (run through tools/attention-bench.sh).

For each kernel: ``gpulab.harness.bench.run`` (rows: the public function as called, run()
replayed in a CUDA graph, baselines, FlashInfer when importable), saved as OUTDIR/NAME.json;
then the host time per call of each public path at the benchmark shapes, which is what a
call costs beyond the GPU's own time when it is not hidden behind earlier work.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import gpulab
from gpulab import cascade, paged
from gpulab.grading import paged as paged_grading
from gpulab.harness import bench

KERNELS = ("paged_decode_attention", "cascade_decode_attention", "merge_state")


def host_overhead() -> dict:
    rows = {}
    spec = gpulab.get_spec("paged_decode_attention")
    for case in spec.cases["bench"]:
        inp = spec.inputs(case, torch.bfloat16, "cuda")
        args = [inp[k] for k in ("q", "k_cache", "v_cache", "block_table", "seq_lens")]
        run = paged_grading.paged_decode_planned(inp)
        o, lse = torch.empty_like(inp["q"]), torch.empty(inp["q"].shape[:2], device="cuda")
        rows[f"paged decode {case.label}"] = {
            "paged_decode_attention (as called)": bench.host_us_per_call(lambda: paged.paged_decode_attention(*args)),
            "paged_decode_attention(validate=True)": bench.host_us_per_call(
                lambda: paged.paged_decode_attention(*args, validate=True), calls=50),
            "paged_decode_into (launcher)": bench.host_us_per_call(lambda: paged.paged_decode_into(*args, o, lse)),
            "PagedDecodeWrapper.run()": bench.host_us_per_call(run)}
        torch.cuda.empty_cache()
    spec = gpulab.get_spec("cascade_decode_attention")
    for case in spec.cases["bench"][:2]:
        inp = spec.inputs(case, torch.bfloat16, "cuda")
        args = [inp[k] for k in ("q", "k_cache", "v_cache", "prefix_pages", "prefix_len", "block_table", "seq_lens")]
        casc = cascade.CascadeDecodeWrapper()
        casc.plan(*args[3:], 32, inp["k_cache"].shape[2], 128, 16, inp["k_cache"].shape[0], torch.bfloat16)
        rows[f"cascade {case.label}"] = {
            "cascade_decode_attention (as called)": bench.host_us_per_call(lambda: cascade.cascade_decode_attention(*args)),
            "CascadeDecodeWrapper.run()": bench.host_us_per_call(lambda: casc.run(*args[:3]))}
        torch.cuda.empty_cache()
    return rows


def main(argv) -> int:
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    save = "--save" in argv[1:]
    names = [a for a in argv[1:] if a != "--save"] or list(KERNELS)
    bench.require_gpu("tools/attention_bench.py")
    if paged_grading.PEER_NOTE:
        print(paged_grading.PEER_NOTE)
    status = 0
    for name in names:
        try:
            result = bench.run(name, compile_baselines=True)
        except Exception as e:      # one kernel failing must not cost the others' figures
            print(f"{name}: {type(e).__name__}: {e}")
            status = 1
            continue
        print(bench.format_table(result), flush=True)
        (out / f"{name}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
        if save:
            print(f"saved {bench.save(result)}")
        torch.cuda.empty_cache()
    overhead = host_overhead()
    (out / "host_overhead.json").write_text(json.dumps(overhead, indent=1) + "\n")
    for shape, rows in overhead.items():
        for path, us in rows.items():
            print(f"host time per call  {shape:28} {path:42} {us:8.1f} µs")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
