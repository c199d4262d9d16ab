"""The draft rollout kernel's launch options on a GPU (gpulab.block_step.draft_rollout).

usage: python tools/rollout_probe.py OUT.json

With the shipped MLGRU draft in bf16, at batch 1 and 64 and k = 4: for each variant of
(num_warps, the GLU's chunk of hidden columns, num_stages), the mean time of a CUDA-graph
replay of one launch (a variant whose tiles overflow shared memory prints its error);
then the block-step kernel alone (batch 1) with 4 and 8 warps. Each variant's drafts and
states are compared with the first's ("DIFFERENT": a reduction's order changed a
rounding somewhere). Earlier runs: on 2026-12-04 (call 3 of 2026-12-04f, the build with
unrolled loops) 4/8/16 warps took 274/208/230 µs (k = 4, batch 1); the GLU's hidden rows
kept in a workspace were slower. With loops (call 1 of 2026-12-04g) 8 warps took 298 µs;
call 2 of 2026-12-04g: the whole hidden row and 256 logits a chunk, one stage, 210 µs
(gpulab.block_step.rollout_tiles, the default since, with the hidden row made once).
Since the eighth session of 2026-12-04 each kernel also runs with its ternary weights as
int8 (int8 tensor-core dots; gpulab.block_step.INT8_WEIGHTS, on since 2026-12-05): the same
drafts and states to the bit, half the weight bytes. And, with the default tiles, the
two launches the engine makes of it: the k drafting steps, then the last step alone (the
states after the last draft, which the engine runs beside the next verify pass).
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
    weights = {torch.float16: w.with_weight_dtype(torch.float16), torch.int8: w.with_weight_dtype(torch.int8)}
    # (num_warps, GLU chunk, head chunk, num_stages, weights): None = the launcher's default
    # (call 2 of 2026-12-04g swept chunks 64-512 and stages; 512/256 with one stage won)
    variants = [(8, None, None, None, torch.float16), (8, None, None, None, torch.int8),
                (8, 64, 64, None, torch.float16), (8, 64, 64, None, torch.int8), (8, 256, 256, 1, torch.float16),
                (4, None, None, None, torch.int8), (16, None, None, None, torch.int8)]
    for b, k, (warps, chunk, head_chunk, stages, wdtype) in itertools.product((1, 64), (4,), variants):
        wname = str(wdtype).replace("torch.", "")
        first = torch.randint(0, 256, (b,), device="cuda", generator=torch.Generator("cuda").manual_seed(b))
        state = torch.randn((L, b, D), device="cuda", generator=torch.Generator("cuda").manual_seed(k))
        drafts = torch.empty((k, b), dtype=torch.long, device="cuda")
        out_states = torch.empty((L, b * (k + 1), D), device="cuda")
        src, dst = torch.arange(b, device="cuda"), torch.arange(b * (k + 1), device="cuda")

        def run():
            draft_rollout_into(first, src, dst, state, out_states, weights[wdtype], k, drafts, num_warps=warps,
                               chunk=chunk, head_chunk=head_chunk, num_stages=stages)
        try:
            ms = graph_ms(run)
        except Exception as e:          # a chunk's tiles may not fit in shared memory
            print(f"rollout B={b:>2} k={k} warps={warps:>2} chunk={chunk}/{head_chunk} stages={stages} {wname}: "
                  f"{type(e).__name__}: {str(e)[:160]}", flush=True)
            rows.append(dict(kernel="draft_rollout", batch=b, k=k, num_warps=warps, chunk=chunk, head_chunk=head_chunk,
                             num_stages=stages, weights=wname,
                             error=f"{type(e).__name__}: {str(e)[:300]}"))
            continue
        key = (b, k)
        same = None
        if key not in ref:
            ref[key] = (drafts.clone(), out_states.clone())
        else:
            same = bool(torch.equal(ref[key][0], drafts) and torch.equal(ref[key][1], out_states))
        rows.append(dict(kernel="draft_rollout", batch=b, k=k, num_warps=warps, chunk=chunk, head_chunk=head_chunk,
                             num_stages=stages, weights=wname,
                         us=1e3 * ms, us_per_draft_step=1e3 * ms / (k + 1), same_as_first=same))
        verdict = "" if same is None else " same" if same else " DIFFERENT"
        print(f"rollout B={b:>2} k={k} warps={warps:>2} chunk={chunk}/{head_chunk} stages={stages} {wname}: "
              f"{1e3 * ms:7.1f} µs ({1e3 * ms / (k + 1):5.1f} µs a step){verdict}", flush=True)
        if chunk is None and warps == 8:      # the engine's split: the k drafting steps, then the last
            parts = {}
            for part in ("drafts", "last"):
                parts[part] = 1e3 * graph_ms(lambda: draft_rollout_into(
                    first, src, dst, state, out_states, weights[wdtype], k, drafts, part=part))
            rows.append(dict(kernel="draft_rollout", batch=b, k=k, num_warps=warps, weights=wname,
                             drafts_part_us=parts["drafts"], last_part_us=parts["last"]))
            print(f"    as the engine launches it: drafts {parts['drafts']:.1f} µs, then the last step "
                  f"{parts['last']:.1f} µs beside the verify pass", flush=True)
    block = model.blocks[0].step_weights()
    x = torch.randn((1, D), device="cuda", dtype=torch.bfloat16)
    h = torch.randn((1, D), device="cuda")
    for warps, wdtype in itertools.product((4, 8), (torch.float16, torch.int8)):
        x_out, h_out = torch.empty_like(x), torch.empty_like(h)
        wb = block.with_weight_dtype(wdtype)
        ms = graph_ms(lambda: block_step_into(x, h, wb, x_out, h_out, num_warps=warps))
        wname = str(wdtype).replace("torch.", "")
        rows.append(dict(kernel="block_step", batch=1, num_warps=warps, weights=wname, us=1e3 * ms))
        print(f"block_step B=1 warps={warps:>2} {wname}: {1e3 * ms:6.1f} µs", flush=True)
    Path(out).write_text(json.dumps(dict(date=datetime.date.today().isoformat(), gpu=runtime.gpu_name(),
                                         versions=runtime.versions(), rows=rows), indent=1))


if __name__ == "__main__":
    if runtime.mode() != "compiled":
        sys.exit("tools/rollout_probe.py times GPU kernels: run it on a machine with a GPU")
    main(sys.argv[1])
