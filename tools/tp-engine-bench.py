#!/usr/bin/env python3
"""The serving engine's model at TP=n against TP=1 on a machine with n GPUs (NCCL, one
process per GPU): identical greedy tokens, and the per-token (decode-step) latency of
each. Writes JSON into OUTDIR; copy tp_engine.json into gpulab/results/parallel/.

usage:  python3 tools/tp-engine-bench.py OUTDIR [--quick] [--no-graphs] [--world-size N] [--dry-run-gloo]

Every measurement launches N ranks (gpulab.parallel.run_ranks). Each rank loads the same
model, serves the same prompts greedily through gpulab.engine.LLM at TP=N
(gpulab.parallel.tensor_parallel_model.TensorParallelTransformer: rank-local KV cache,
int32 all-reduces) and then the unsharded model alone on its own GPU (TP=1), on
gpulab's Triton kernels, with and without CUDA graphs. Per-token latency = the time of a
decode step (every running sequence gets one token), median over the run.

Models: the engine's shipped checkpoint (d_model 128, 4 layers: tiny, so TP=N pays its
collectives and gains nothing), and a random model of 7B-like layer width
(d_model 4096, 32/8 heads of 128, hidden 11008, 4 layers; --quick: 2048-wide) where the
matmuls are big enough for the split to pay. Batches of 1 and 8 prompts.

Outputs: tp_engine.json (one row per model × batch × graphs: tokens identical on every
rank and to TP=1, per-token ms for TP=1 and TP=N, pages freed) and tp_engine_summary.json
(the target: identical tokens everywhere; the latency ratios). A failing run is recorded
with its error and the others still run.

NVLink multicast stays off in every process (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1), and
TORCH_NCCL_ASYNC_ERROR_HANDLING=1. No internet needed. Takes about 2-6 minutes.
"""
import os
import sys

for _k, _v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
               "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}.items():
    os.environ.setdefault(_k, _v)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from gpulab.engine.model import TINY  # noqa: E402
from gpulab.parallel import bandwidth as bw  # noqa: E402
from gpulab.parallel import launch  # noqa: E402
from gpulab.parallel.tensor_parallel_model import PROMPTS, tp_engine_rank  # noqa: E402

WIDE = dict(d_model=4096, n_layers=4, n_heads=32, n_kv_heads=8, head_dim=128, hidden=11008, max_seq_len=512)
WIDE_QUICK = dict(d_model=2048, n_layers=4, n_heads=16, n_kv_heads=8, head_dim=128, hidden=5632, max_seq_len=512)


def write(out: Path, name: str, data) -> None:
    path = out / name
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"  wrote {path}", flush=True)


def batch_prompts(batch: int) -> list[str]:
    return [f"{PROMPTS[i % len(PROMPTS)]} ({i})" for i in range(batch)]


def measure(n, backend, label, cfg, batch, graphs, max_tokens, engine_extra, start_method) -> dict:
    engine = {"cuda_graphs": graphs, "max_num_seqs": max(1, batch), **engine_extra}
    row = {"model": label, "config": cfg if cfg is not None else "checkpoint", "batch": batch,
           "cuda_graphs": graphs, "world_size": n, "max_tokens": max_tokens}
    t = time.time()
    try:
        res = launch.run_ranks(tp_engine_rank, n, batch_prompts(batch), max_tokens, cfg, 0, None, engine,
                               backend=backend, timeout_s=420, collective_timeout_s=90, start_method=start_method)
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt):
            raise
        traceback.print_exc()
        row.update(ok=False, error=f"{type(e).__name__}: {e}"[:3000], seconds=round(time.time() - t, 1))
        return row
    want = res[0]["tp1"]["tokens"]
    row.update(ok=True, seconds=round(time.time() - t, 1), dtype=res[0]["dtype"], model_config=res[0]["model"],
               tokens_identical_to_tp1=all(r["tp"]["tokens"] == want for r in res),
               tp1_identical_on_all_ranks=all(r["tp1"]["tokens"] == want for r in res),
               pages_freed=all(r[k]["idle"] for r in res for k in ("tp", "tp1")),
               tokens_sample=want[0][:16], text_sample=res[0]["tp1"]["texts"][0][:80])
    for key, name in (("tp1", "tp1"), ("tp", "tpn")):
        runs = [r[key] for r in res]
        row[f"{name}_per_token_ms_p50"] = [r["per_token_ms_p50"] for r in runs]      # one per rank
        row[f"{name}_per_token_ms_min"] = [r["per_token_ms_min"] for r in runs]
        row[f"{name}_decode_steps"] = runs[0]["decode_steps"]
        row[f"{name}_graph_steps"] = runs[0]["graph_steps"]
        row[f"{name}_kv_cache_shape"] = runs[0]["kv_cache_shape"]
    p1, pn = row["tp1_per_token_ms_p50"][0], max(row["tpn_per_token_ms_p50"])
    row["tpn_over_tp1"] = pn / p1 if p1 and pn else None
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="directory for the JSON results")
    p.add_argument("--quick", action="store_true", help="fewer tokens, a 2048-wide model instead of 4096")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--no-graphs", action="store_true", help="eager steps only (no CUDA-graph runs)")
    p.add_argument("--dry-run-gloo", action="store_true",
                   help="rehearse on CPU processes (gloo, tiny model, PyTorch paths): figures meaningless")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    n = a.world_size
    gpus = torch.cuda.device_count()
    backend = "gloo" if a.dry_run_gloo else "nccl"
    if backend == "nccl" and gpus < n:
        print(f"need {n} GPUs, found {gpus}", file=sys.stderr)
        return 2
    env = bw.environment(backend, n)
    env["env"] = {k: os.environ.get(k) for k in (*launch.MULTICAST_OFF, "TORCH_NCCL_ASYNC_ERROR_HANDLING")}
    env["gpus"] = [torch.cuda.get_device_name(i) for i in range(gpus)] if backend == "nccl" else []
    print(json.dumps(env, indent=1), flush=True)
    if a.dry_run_gloo:
        models = [("tiny (dry run)", {k: getattr(TINY, k) for k in TINY.__dataclass_fields__})]
        max_tokens, engine_extra, graph_modes = 4, {"linear": "torch", "attention": "torch"}, (False,)
        start_method = launch.kernel_start_method()      # spawned where the ranks' device is a GPU
    else:
        models = [("engine checkpoint", None), ("wide random", WIDE_QUICK if a.quick else WIDE)]
        max_tokens, engine_extra, graph_modes = (16 if a.quick else 64), {}, (False, True)
        start_method = None
    if a.no_graphs:
        graph_modes = (False,)
    rows = []
    graphs_failed = False
    # eager runs first (the target); graph runs capture NCCL collectives in CUDA graphs,
    # and after one failure the others are skipped (a failed capture can cost a timeout)
    for graphs in graph_modes:
        for label, cfg in models:
            for batch in (1, 8):
                print(f"\n== {label}, batch {batch}, CUDA graphs {graphs}", flush=True)
                if graphs and graphs_failed:
                    rows.append({"model": label, "batch": batch, "cuda_graphs": True, "world_size": n, "ok": False,
                                 "error": "skipped: an earlier run with CUDA graphs failed"})
                    print("  skipped", flush=True)
                    continue
                row = measure(n, backend, label, cfg, batch, graphs, max_tokens, engine_extra, start_method)
                graphs_failed = graphs_failed or (graphs and not row["ok"])
                rows.append(row)
                if row["ok"]:
                    print(f"  tokens identical to TP=1 on every rank: {row['tokens_identical_to_tp1']}; "
                          f"per-token ms p50: TP=1 {row['tp1_per_token_ms_p50'][0]:.3f}, TP={n} "
                          f"{max(row['tpn_per_token_ms_p50']):.3f} (x{row['tpn_over_tp1']:.2f}); "
                          f"graph steps {row['tpn_graph_steps']}; {row['seconds']} s", flush=True)
                else:
                    print(f"  FAILED: {row['error'][:500]}", flush=True)
                write(out, "tp_engine.json", {**env, "kind": "tp_engine", "rows": rows,
                                              "label": f"engine decode, TP={n} vs TP=1 on {env['device']}"})
    ok = [r for r in rows if r["ok"]]
    summary = {"env": env, "runs": len(rows), "failed": [f"{r['model']} b{r['batch']} graphs={r['cuda_graphs']}: "
                                                        f"{r['error'][:300]}" for r in rows if not r["ok"]],
               "targets": {"tp_tokens_identical_to_tp1": {
                   "ok": bool(ok) and all(r["tokens_identical_to_tp1"] and r["tp1_identical_on_all_ranks"] for r in ok),
                   "runs_compared": len(ok)},
                   "pages_freed": all(r["pages_freed"] for r in ok)},
               "per_token_ms": [{k: r[k] for k in ("model", "batch", "cuda_graphs", "tp1_per_token_ms_p50",
                                                   "tpn_per_token_ms_p50", "tpn_over_tp1")} for r in ok]}
    write(out, "tp_engine_summary.json", summary)
    print(json.dumps(summary["targets"], indent=1))
    return 0 if len(ok) == len(rows) and summary["targets"]["tp_tokens_identical_to_tp1"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
