"""Static matplotlib figures: benchmark results (live on a GPU, saved ones elsewhere)
and training curves.

On a GPU, :func:`benchmark` times gpulab's kernel (and, optionally, the learner's) against
the PyTorch baselines right now. In interpreter mode it plots the results saved in
``gpulab/results/NAME.json``, measured on an H200, and says so in the title: the
notebook reads the same either way.
"""
from __future__ import annotations

import math
import sys
from typing import Callable

from . import bench as _bench
from .spec import get as get_spec
from .. import runtime


def benchmark(name: str, extra: dict[str, Callable[[dict], object]] | None = None, cases=None,
          dtypes=None, metric: str = "auto", compile_baselines: bool | None = None,
          show: bool = True) -> dict | None:
    """Benchmark (GPU) or load saved results (CPU), print the table and plot it.
    ``compile_baselines``: also time the baselines under ``torch.compile`` (default: yes,
    except in fast mode, ``runtime.fast()``: test and CI runs check answers, not timings,
    and time only the first two of the spec's benchmark cases)."""
    if compile_baselines is None:
        compile_baselines = not runtime.fast()
    if runtime.mode() == "compiled":
        source = "measured now"
        all_cases = get_spec(name).cases["bench"]
        if cases is None and runtime.fast() and len(all_cases) > 2:
            cases = all_cases[:2]
            source += f" (fast mode: {len(cases)} of the {len(all_cases)} cases)"
        result = _bench.run(name, cases=cases, dtypes=dtypes, extra=extra,
                            compile_baselines=compile_baselines)
    else:
        result = _bench.load(name)
        if result is None:
            print(f"No saved GPU results for {name} yet (run `gpulab bench {name} --save` on a GPU).")
            return None
        source = "saved results: this machine runs the interpreter, whose timings mean nothing"
    show_table(result)
    if show:
        plot(result, metric=metric, subtitle=source)
    return result


def show_table(result: dict) -> None:
    """Display a benchmark table: HTML in a notebook, 88 columns of text elsewhere."""
    ipython = sys.modules.get("IPython")
    if ipython is not None and ipython.get_ipython() is not None:
        from IPython.display import display
        display(_bench.BenchTable(result))
    else:
        print(_bench.format_table(result))


def plain_number(value: float, _pos=None) -> str:
    """1, 16, 512, 2K, 32K, 1M: tick labels without exponents."""
    if value >= 1024 and float(value).is_integer() and value % 1024 == 0:
        return f"{int(value) // 1024 ** 2}M" if value % 1024 ** 2 == 0 else f"{int(value) // 1024}K"
    return f"{value:g}"


def readable_log_axis(ax, axis: str = "x", ticks=None):
    """A log-scale axis whose labels do not overlap: major ticks at ``ticks`` (default: the
    plotted values, thinned to at most 10), labelled as plain numbers; no minor labels.
    Call it after plotting, e.g. ``readable_log_axis(ax)`` for a batch-size axis."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, NullLocator

    which = ax.xaxis if axis == "x" else ax.yaxis
    (ax.set_xscale if axis == "x" else ax.set_yscale)("log")
    if ticks is None:
        values = set()
        for line in ax.get_lines():
            data = line.get_xdata() if axis == "x" else line.get_ydata()
            values.update(float(v) for v in data if float(v) > 0)
        ticks = sorted(values)
        step = max(1, -(-len(ticks) // 10))
        ticks = ticks[::step]
    which.set_major_locator(FixedLocator(list(ticks)))
    which.set_major_formatter(FuncFormatter(plain_number))
    which.set_minor_locator(NullLocator())
    which.set_minor_formatter(NullFormatter())
    return ax


def plot(result: dict, metric: str = "auto", subtitle: str = "", ax=None):
    """Grouped bars per case: throughput (GB/s or TFLOP/s) of each implementation, with
    the roofline as a line when the spec defines bytes/FLOPs."""
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if "ms" in r]
    if metric == "auto":
        intensity = [r["flops"] / r["bytes"] for r in rows if r.get("flops") and r.get("bytes")]
        metric = "TFLOP/s" if intensity and min(intensity) > 50 else "GB/s"
    cases = list(dict.fromkeys(f"{r['case']}\n{r['dtype']}" for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    if ax is None:
        _, ax = plt.subplots(figsize=(max(6, 1.6 * len(cases) + 2), 4))
    width = 0.8 / max(1, len(impls))
    for k, impl in enumerate(impls):
        xs, ys = [], []
        for i, c in enumerate(cases):
            r = next((r for r in rows if r["impl"] == impl and f"{r['case']}\n{r['dtype']}" == c), None)
            if r and metric in r:
                xs.append(i + (k - (len(impls) - 1) / 2) * width)
                ys.append(r[metric])
        ax.bar(xs, ys, width=width, label=impl)
    ceil = result["ceilings"]["bytes_per_s"] / 1e9 if metric == "GB/s" else None
    if ceil:
        ax.axhline(ceil, color="k", ls="--", lw=1, label=f"measured copy bandwidth ({ceil:.0f} GB/s)")
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels(cases, fontsize=8)
    ax.set_ylabel(metric)
    ax.set_title(f"{result['kernel']} on {result['gpu']} ({result['date']})"
                 + (f"\n{subtitle}" if subtitle else ""), fontsize=10)
    ax.legend(fontsize=8)
    plt.tight_layout()
    plt.show()
    return ax


def plot_losses(losses: list[float], ax=None, smooth: int = 20, vocab_size: int | None = None):
    """A training curve: the loss of every step and a running mean; with ``vocab_size``,
    the loss of a uniform guess over the vocabulary (ln vocab_size) as a dashed line."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(losses, alpha=0.35, lw=1, label="loss per step")
    if len(losses) >= smooth:
        window = [sum(losses[k - smooth:k]) / smooth for k in range(smooth, len(losses) + 1)]
        ax.plot(range(smooth - 1, len(losses)), window, lw=2, label=f"mean of {smooth} steps")
    if vocab_size:
        ax.axhline(math.log(vocab_size), color="k", ls="--", lw=1,
                   label=f"uniform guess, ln {vocab_size}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per token)")
    ax.legend(fontsize=8)
    plt.tight_layout()
    return ax
