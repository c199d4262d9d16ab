"""Append (paged-prefill) attention on a GPU: correctness, no-sync/no-allocation/graph
checks of plan/run, a tile-configuration sweep, and benchmarks against SDPA and FlashInfer.

usage (repository root, on the H200):  PYTHONPATH=$PWD python tools/prefill_gpu.py OUTDIR [--quick]

Writes OUTDIR/prefill_gpu.json (every measurement) and OUTDIR/append_attention.json (the
`gpulab bench` result format, for gpulab/results/), and prints a summary. --quick skips the
tile sweep. Each part catches its own errors, so one failure does not hide the others.
"""
from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

import torch

import gpulab
from gpulab import prefill, runtime
from gpulab.grading import prefill as G
from gpulab.harness import bench


def _inputs(case, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return G.make_append_inputs(case.params, dtype, torch.device("cuda"), g)


def part(results, name):
    def deco(fn):
        t = time.time()
        print(f"== {name}", flush=True)
        try:
            results[name] = fn()
            print(json.dumps(results[name], indent=1, default=str)[:3000], flush=True)
        except Exception as e:
            results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            print("FAILED", results[name]["traceback"], flush=True)
        results[name + " seconds"] = round(time.time() - t, 1)
        return fn
    return deco


def main(argv):
    out = Path(argv[0] if argv else "prefill_out")
    quick = "--quick" in argv
    out.mkdir(parents=True, exist_ok=True)
    assert runtime.mode() == "compiled", "needs a CUDA GPU"
    res = {"gpu": runtime.gpu_name(), "versions": runtime.versions()}

    @part(res, "checks (GPU cases, compiled)")
    def _():
        rows = {}
        for name in ("append_attention", "append_attention_plan", "append_kv"):
            spec = gpulab.get_spec(name)
            rep = gpulab.check(spec, spec.implementation, quiet=True)
            rows[name] = rep.summary()
        return rows

    @part(res, "plan/run: no host sync, no allocation, CUDA graph replay across re-plans")
    def _():
        # Two layouts of the same model shape; their pages are copied into one shared pool.
        hq, hkv, d = 32, 8, 128
        layouts = [_inputs(c, torch.bfloat16, seed=i) for i, c in enumerate(G.GPU_CASES[1:3])]
        pages = max(x["k_cache"].shape[0] for x in layouts)
        ps = layouts[0]["k_cache"].shape[1]
        max_tokens = max(x["q"].shape[0] for x in layouts)
        max_b = max(x["kv_lens"].shape[0] for x in layouts)
        max_w = max(x["block_tables"].shape[1] for x in layouts)
        kc = torch.randn(pages, ps, hkv, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        attn = prefill.AppendAttention(hq, hkv, d, page_size=ps, num_pages=pages, dtype=torch.bfloat16,
                                       device="cuda", max_batch_size=max_b, max_num_tokens=max_tokens,
                                       max_pages_per_request=max_w)
        q = torch.zeros(max_tokens, hq, d, device="cuda", dtype=torch.bfloat16)
        knew = torch.randn(max_tokens, hkv, d, device="cuda", dtype=torch.bfloat16)
        report = {}
        first = {k: v.cpu() for k, v in layouts[0].items() if k in ("qo_indptr", "block_tables", "kv_lens")}
        attn.plan(**first)
        attn.run(q, kc, vc)                               # compile outside the checks
        attn.run(q, kc, vc, return_lse=True)
        attn.append_kv(knew, knew, kc.clone(), vc.clone())
        x = layouts[0]
        prefill.append_attention(x["q"], x["k_cache"], x["v_cache"], x["qo_indptr"], x["block_tables"],
                                 x["kv_lens"])
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            before = torch.cuda.memory_stats()["allocation.all.allocated"]
            attn.run(q, kc, vc)
            attn.run(q, kc, vc, return_lse=True)
            kc2, vc2 = kc.clone(), vc.clone()
            after_clone = torch.cuda.memory_stats()["allocation.all.allocated"]
            attn.append_kv(knew, knew, kc2, vc2)
            after = torch.cuda.memory_stats()["allocation.all.allocated"]
            report["run/append_kv under set_sync_debug_mode('error')"] = "ok"
            report["allocations during run/append_kv (excluding the 2 clones)"] = after - before - 2
            prefill.append_attention(x["q"], x["k_cache"], x["v_cache"], x["qo_indptr"], x["block_tables"],
                                     x["kv_lens"])
            report["append_attention (no plan) under sync debug 'error'"] = "ok"
        finally:
            torch.cuda.set_sync_debug_mode("default")
        # CUDA graph over run(); re-plan with other layouts (same buffers) and replay
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            attn.run(q, kc, vc)
            with torch.cuda.graph(g, stream=s):
                o_graph = attn.run(q, kc, vc)
        torch.cuda.current_stream().wait_stream(s)
        errs = []
        for i, x in enumerate(layouts):
            lay = {k: v.cpu() for k, v in x.items() if k in ("qo_indptr", "block_tables", "kv_lens")}
            attn.plan(**lay)
            T = x["q"].shape[0]
            q.zero_()
            q[:T] = x["q"]
            # the layout's own pages live in its own cache: copy them into the shared pool
            kc[:x["k_cache"].shape[0]] = x["k_cache"]
            vc[:x["v_cache"].shape[0]] = x["v_cache"]
            g.replay()
            torch.cuda.synchronize()
            ref = prefill.append_attention_reference(x["q"], kc, vc, x["qo_indptr"], x["block_tables"], x["kv_lens"])
            errs.append(float((o_graph[:T].double() - ref["o"]).abs().max()))
        report["graph replay max abs error per re-planned layout (bf16)"] = errs
        report["graph replay ok"] = all(e < 3e-2 for e in errs)
        return report

    if not quick:
        @part(res, "tile sweep (bf16, bench cases, launcher via the plan)")
        def _():
            rows = []
            real = prefill.append_tile_config
            for case in G.BENCH_CASES:
                x = _inputs(case)
                hq, d = x["q"].shape[1], x["q"].shape[2]
                hkv = x["k_cache"].shape[2]
                lay = {k: x[k].cpu() for k in ("qo_indptr", "block_tables", "kv_lens")}
                flops = G.append_flops(case.params, torch.bfloat16)
                for bm in (64, 128):
                    for bn in (32, 64, 128):
                        for warps, stages in ((4, 2), (4, 3), (8, 2), (8, 3), (8, 4)):
                            cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
                            prefill.append_tile_config = lambda *a, **k: dict(cfg)
                            try:
                                attn = prefill.AppendAttention(hq, hkv, d, page_size=x["k_cache"].shape[1],
                                                               num_pages=x["k_cache"].shape[0],
                                                               dtype=torch.bfloat16, device="cuda")
                                attn.plan(**lay)
                                ms = bench.time_ms(lambda: attn.run(x["q"], x["k_cache"], x["v_cache"]))
                                rows.append({"case": case.label, **cfg, "ms": ms, "TFLOP/s": flops / ms / 1e9})
                            except Exception as e:
                                rows.append({"case": case.label, **cfg, "error": f"{type(e).__name__}: {str(e)[:120]}"})
                            finally:
                                prefill.append_tile_config = real
            best = {}
            for r in rows:
                if "ms" in r and (r["case"] not in best or r["ms"] < best[r["case"]]["ms"]):
                    best[r["case"]] = r
            return {"best": best, "current": {c.label: real(torch.bfloat16, 128, 4) for c in G.BENCH_CASES},
                    "rows": rows}

    @part(res, "benchmarks (bf16): as called, launcher, plan+run, run in a CUDA graph, baselines")
    def _():
        rows = []
        ceil = bench.ceilings()
        for case in G.BENCH_CASES:
            x = _inputs(case)
            lay = {k: x[k] for k in ("qo_indptr", "block_tables", "kv_lens")}
            hq, d = x["q"].shape[1], x["q"].shape[2]
            _, ps, hkv, _ = x["k_cache"].shape
            flops = G.append_flops(case.params, torch.bfloat16)
            nbytes = G.append_bytes(case.params, torch.bfloat16)
            roof = max(nbytes / ceil["bytes_per_s"], flops / ceil["flops_per_s"])
            o = torch.empty_like(x["q"])
            lse = torch.empty(x["q"].shape[:2], device="cuda", dtype=torch.float32)
            attn = prefill.AppendAttention(hq, hkv, d, page_size=ps, num_pages=x["k_cache"].shape[0],
                                           dtype=torch.bfloat16, device="cuda")
            host = {k: v.cpu() for k, v in lay.items()}
            attn.plan(**host)
            ref = prefill.append_attention_reference(**x)["o"] if case.params["new"][0] <= 1024 else None
            fns = {
                "append_attention (as called)": lambda: prefill.append_attention(
                    x["q"], x["k_cache"], x["v_cache"], **lay),
                "append_attention_into (launcher, outputs preallocated)": lambda: prefill.append_attention_into(
                    x["q"], x["k_cache"], x["v_cache"], *lay.values(), True, None, o, lse),
                "AppendAttention.plan (host arrays) + run": lambda: (attn.plan(**host), attn.run(
                    x["q"], x["k_cache"], x["v_cache"])),
                "AppendAttention.run": lambda: attn.run(x["q"], x["k_cache"], x["v_cache"]),
                **{name: (lambda f=f: f(x)) for name, f in G.append_baselines().items()},
            }
            for name, fn in fns.items():
                row = {"case": case.label, "impl": name}
                try:
                    row["ms"] = bench.time_ms(fn)
                    if name == "AppendAttention.run":
                        row["ms_graph"] = bench.time_graph_ms(fn)
                    row["TFLOP/s"] = flops / row["ms"] / 1e9
                    row["roofline_pct"] = 100 * roof * 1e3 / row["ms"]
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                rows.append(row)
            if ref is not None:
                got = attn.run(x["q"], x["k_cache"], x["v_cache"])
                rows.append({"case": case.label, "impl": "max abs error vs float64",
                             "value": float((got.double() - ref).abs().max())})
            del x
            torch.cuda.empty_cache()
        return rows

    @part(res, "gpulab bench append_attention (saved format)")
    def _():
        result = bench.run("append_attention", compile_baselines=False)
        (out / "append_attention.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
        result_kv = bench.run("append_kv", compile_baselines=False)
        (out / "append_kv.json").write_text(json.dumps(result_kv, indent=1, default=str) + "\n")
        return bench.format_table(result) + "\n" + bench.format_table(result_kv)

    (out / "prefill_gpu.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    print(f"wrote {out / 'prefill_gpu.json'}")
    return 0 if not any(isinstance(v, dict) and "error" in v for v in res.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
