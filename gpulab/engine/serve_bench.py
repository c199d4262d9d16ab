"""``gpulab serve-bench``: drive the engine with a generated workload, next to static
batching, and report latency, throughput, pages and prefix-cache hits.

The workload: ``--requests`` requests arriving as a Poisson process of ``--rate``
requests per second (``inf``: all at once); prompt and output lengths drawn uniformly
from ``--prompt-len LO:HI`` and ``--output-len LO:HI`` (outputs run to their length:
EOS does not stop them); a share ``--shared`` of the prompts starts with one common
system prompt of ``--system-len`` tokens. Prompts are windows of the bundled poems.

    gpulab serve-bench                                  # CPU-sized defaults, shipped model
    gpulab serve-bench --requests 400 --rate 50 --json out.json --plot out.png

Prints a table (continuous batching vs static batching, same model, kernels and KV
memory), saves JSON (summaries, per-request metrics, per-step records) and plots
(latency distributions, a timeline of what ran each step and the pages in use).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

from .. import runtime
from .engine import LLM, EngineConfig, frozen_heap
from .metrics import format_summary
from .model import BOS, ModelConfig, TernaryTransformer, corpus_tokens, load_checkpoint, prepare_for_serving
from .sequence import SamplingParams
from .static import StaticBatchLLM


@dataclass
class Workload:
    requests: int = 24
    rate: float = math.inf              # requests per second (Poisson); inf: all at t = 0
    prompt_len: tuple[int, int] = (8, 64)
    output_len: tuple[int, int] = (4, 48)
    shared: float = 0.5                 # share of prompts that start with the system prompt
    system_len: int = 64
    seed: int = 0


def make_requests(w: Workload, max_model_len: int) -> list[dict]:
    """[{"arrival": s, "prompt": [ids], "params": SamplingParams}], arrivals ascending."""
    rng = random.Random(w.seed)
    corpus = corpus_tokens().tolist()
    corpus = [t for t in corpus if t < 256]
    if w.system_len + w.prompt_len[1] + w.output_len[1] + 1 > max_model_len:
        raise ValueError(f"system prompt + prompt + output ({w.system_len} + {w.prompt_len[1]} + "
                         f"{w.output_len[1]}) do not fit the model's context of {max_model_len}")
    system = [(corpus * (1 + w.system_len // len(corpus)))[i] for i in range(w.system_len)]
    t, out = 0.0, []
    for i in range(w.requests):
        if math.isfinite(w.rate):
            t += rng.expovariate(w.rate)
        n = rng.randint(*w.prompt_len)
        start = rng.randrange(len(corpus) - n)
        prompt = [BOS] + (system if rng.random() < w.shared else []) + corpus[start:start + n]
        params = SamplingParams(max_tokens=rng.randint(*w.output_len), stop_at_eos=False, seed=i)
        out.append({"arrival": t, "prompt": prompt, "params": params})
    return out


SPIN_S = 0.5e-3          # how long before an arrival run_requests stops sleeping


def run_requests(engine, requests: list[dict], progress: bool = True, desc: str = "") -> dict:
    """Feed requests at their arrival times (relative to now), step until all are done;
    returns the engine's summary."""
    # as a serving process runs: no full collection of the start-up heap; and count the
    # kernels Triton compiles meanwhile (each one stalls a step for about a second)
    with frozen_heap(), runtime.count_compilations() as compiled:
        t0 = time.perf_counter()
        pending = list(requests)
        bar = tqdm(total=len(requests), desc=desc or type(engine).__name__, mininterval=0.5, disable=not progress)
        while pending or engine.has_unfinished():
            now = time.perf_counter() - t0
            while pending and pending[0]["arrival"] <= now:
                r = pending.pop(0)
                engine.add_request(r["prompt"], r["params"], arrival_time=t0 + r["arrival"])
            if engine.has_unfinished():
                bar.update(len(engine.step(finished_only=True)))
            elif pending:
                # sleep until just before the next arrival, then watch the clock: a sleep
                # overshoots by about 0.1 ms, which would count in that request's TTFT
                wake = t0 + pending[0]["arrival"]
                time.sleep(max(0.0, wake - time.perf_counter() - SPIN_S))
                while time.perf_counter() < wake:
                    pass
        bar.close()
    summary = engine.summary()
    summary["kernels_compiled"] = compiled.count
    summary["kernels_compiled_names"] = sorted(set(compiled.names))
    # Triton's description of each (launch options, argument types and specialisation):
    # which argument's class was new, so that the warm-up can be taught to meet it
    summary["kernels_compiled_details"] = compiled.details[:32]
    return summary


def build_model(name: str, device=None, dtype=None) -> TernaryTransformer:
    """'shipped' (the checkpoint), 'tiny', or 'random:d_model,n_layers,n_heads,n_kv_heads,head_dim,hidden,ctx'
    (random weights of any size: for timing only)."""
    device = device or runtime.device()
    dtype = dtype or runtime.default_dtype()
    if name == "shipped":
        return load_checkpoint(device=device, dtype=dtype)
    if name == "tiny":
        cfg = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden=128, max_seq_len=512)
    elif name.startswith("random:"):
        d, L, h, kv, hd, hid, ctx = (int(v) for v in name[7:].split(","))
        cfg = ModelConfig(d_model=d, n_layers=L, n_heads=h, n_kv_heads=kv, head_dim=hd, hidden=hid, max_seq_len=ctx)
    else:
        raise ValueError(f"unknown model {name!r}: 'shipped', 'tiny' or 'random:d,layers,heads,kv_heads,head_dim,hidden,ctx'")
    torch.manual_seed(0)
    return prepare_for_serving(TernaryTransformer(cfg), device, dtype)


def decoding_engine(model, batch: int, ctx: int, max_tokens: int = 200, temperature: float = 0.0,
                    **config) -> LLM:
    """An engine holding ``batch`` sequences of ``ctx`` prompt tokens, all past their
    prefill, with room for ``max_tokens`` (≤ 256) more each: for timing decode steps.
    ``temperature``: 0 greedy, else sampled (seed i for request i). ``config`` sets other
    :class:`EngineConfig` fields."""
    cfg = EngineConfig(**{"num_blocks": batch * (-(-(ctx + 256) // 16)) + 16, "block_size": 16,
                          "max_num_seqs": batch, "max_num_batched_tokens": max(8192, ctx + 1), **config})
    llm = LLM(model, cfg)
    for i in range(batch):
        llm.add_request([BOS] + [(i * 7 + j) % 250 for j in range(ctx - 1)],
                        SamplingParams(max_tokens=max_tokens, stop_at_eos=False, temperature=temperature, seed=i))
    while llm.scheduler.waiting or any(s.num_output_tokens == 0 for s in llm.scheduler.running):
        llm.step()
    return llm


def compare(model, config: EngineConfig, workload: Workload, static: bool = True, progress: bool = True) -> dict:
    """Continuous batching (and static batching on the same KV memory) on one workload."""
    reqs = make_requests(workload, model.cfg.max_seq_len)
    result = {"workload": asdict(workload), "config": asdict(config), "model": asdict(model.cfg),
              "mode": runtime.mode(), "gpu": runtime.gpu_name(), "versions": runtime.versions()}
    llm = LLM(model, config)
    result["continuous"] = run_requests(llm, reqs, progress, "continuous")
    result["continuous_detail"] = llm.metrics.to_json()
    if static:
        max_len = max(len(r["prompt"]) for r in reqs) + max(r["params"].max_tokens for r in reqs)
        st = StaticBatchLLM(model, config, max_len=max_len)
        result["static"] = run_requests(st, reqs, progress, f"static (batch {st.batch_size})")
        result["static"]["batch_size"] = st.batch_size
        result["static_detail"] = st.metrics.to_json()
    return result


def format_comparison(result: dict) -> str:
    lines = [format_summary(result["continuous"], "continuous batching (paged KV, chunked prefill, prefix cache)")]
    if "static" in result:
        lines += ["", format_summary(result["static"], f"static batching (contiguous KV, batch "
                                                        f"{result['static']['batch_size']})")]
        ratio = result["continuous"]["throughput_tok_s"] / max(result["static"]["throughput_tok_s"], 1e-9)
        lines += ["", f"throughput: continuous / static = {ratio:.2f}x"]
    if result["mode"] != "compiled":
        lines += [f"(mode {result['mode']}: CPU timings, not GPU performance)"]
    return "\n".join(lines)


def plot_comparison(result: dict, path=None):
    """Latency distributions and per-step timelines (tokens run, pages in use)."""
    import matplotlib.pyplot as plt
    runs = [k for k in ("continuous", "static") if k in result]
    fig, axes = plt.subplots(2, 2, figsize=(11, 6.5))
    for k in runs:
        reqs = result[f"{k}_detail"]["requests"]
        for ax, key in ((axes[0, 0], "ttft"), (axes[0, 1], "e2e")):
            v = sorted(r[key] * 1e3 for r in reqs if r[key] is not None)
            if v:
                ax.plot(v, [(i + 1) / len(v) for i in range(len(v))], label=k)
    for ax, name in ((axes[0, 0], "time to first token"), (axes[0, 1], "end-to-end latency")):
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("share of requests")
        ax.legend(fontsize=8)
    for ax, k in zip(axes[1], runs):
        steps = result[f"{k}_detail"]["steps"]
        t0 = steps[0]["start"] if steps else 0
        x = [s["start"] - t0 for s in steps]
        ax.bar(x, [s["decode_tokens"] for s in steps], width=[s["end"] - s["start"] for s in steps],
               align="edge", label="decode tokens", color="tab:blue")
        ax.bar(x, [s["prefill_tokens"] for s in steps], bottom=[s["decode_tokens"] for s in steps],
               width=[s["end"] - s["start"] for s in steps], align="edge", label="prefill tokens", color="tab:orange")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("tokens per step")
        ax.set_title(k, fontsize=9)
        if k == "continuous":
            ax2 = ax.twinx()
            ax2.plot(x, [s["pages_used"] for s in steps], color="k", lw=1, label="pages in use")
            ax2.set_ylabel("pages in use")
        ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=110)
    return fig


def _range(s: str) -> tuple[int, int]:
    lo, _, hi = s.partition(":")
    try:
        lo, hi = int(lo), int(hi or lo)
    except ValueError:
        lo = hi = 0
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected LO:HI (or one length N) with 1 <= LO <= HI, e.g. 32:512; "
                                         f"got {s!r}")
    return lo, hi


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="gpulab serve-bench", description=__doc__.split("\n\n")[0])
    w, c = Workload(), EngineConfig()
    ap.add_argument("--model", default="shipped", help="shipped | tiny | random:d,layers,heads,kv,head_dim,hidden,ctx")
    ap.add_argument("--requests", type=int, default=w.requests, help=f"requests to serve (default {w.requests})")
    ap.add_argument("--rate", type=float, default=w.rate,
                    help=f"Poisson arrivals per second; inf: all at once (default {w.rate})")
    ap.add_argument("--prompt-len", type=_range, default=w.prompt_len, metavar="LO:HI",
                    help="prompt lengths, uniform in [LO, HI] (default {}:{})".format(*w.prompt_len))
    ap.add_argument("--output-len", type=_range, default=w.output_len, metavar="LO:HI",
                    help="output lengths, uniform in [LO, HI] (default {}:{})".format(*w.output_len))
    ap.add_argument("--shared", type=float, default=w.shared,
                    help=f"share of requests that start with the common system prompt (default {w.shared})")
    ap.add_argument("--system-len", type=int, default=w.system_len,
                    help=f"tokens of the common system prompt (default {w.system_len})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-blocks", type=int, default=c.num_blocks, help=f"KV pages (default {c.num_blocks})")
    ap.add_argument("--block-size", type=int, default=c.block_size, help=f"tokens per page (default {c.block_size})")
    ap.add_argument("--max-num-seqs", type=int, default=c.max_num_seqs,
                    help=f"sequences running at once (default {c.max_num_seqs})")
    ap.add_argument("--budget", type=int, default=c.max_num_batched_tokens, help="tokens per step")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--cascade", action="store_true")
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--no-piecewise-graphs", action="store_true",
                    help="steps with prompt chunks run eagerly (only decode steps replay graphs)")
    ap.add_argument("--no-full-graphs", action="store_true",
                    help="steps with prompt chunks take the piecewise graphs, not one graph of the whole step")
    ap.add_argument("--no-static", action="store_true", help="skip the static-batching baseline")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--plot", help="save the plots here (png)")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    a = ap.parse_args(argv)
    workload = Workload(a.requests, a.rate, a.prompt_len, a.output_len, a.shared, a.system_len, a.seed)
    config = EngineConfig(num_blocks=a.num_blocks, block_size=a.block_size, max_num_seqs=a.max_num_seqs,
                          max_num_batched_tokens=a.budget, prefix_caching=not a.no_prefix_caching,
                          cascade=a.cascade, cuda_graphs=not a.no_cuda_graphs,
                          piecewise_graphs=not a.no_piecewise_graphs, full_graphs=not a.no_full_graphs)
    if runtime.mode() != "compiled":
        torch.set_num_threads(1)   # small ops: threads only wait on each other (and on neighbours)
    model = build_model(a.model)
    result = compare(model, config, workload, static=not a.no_static, progress=not a.quiet)
    print(format_comparison(result))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
        print(f"wrote {a.json}")
    if a.plot:
        plot_comparison(result, a.plot)
        print(f"wrote {a.plot}")
    return 0
