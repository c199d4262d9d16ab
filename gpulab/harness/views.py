"""Interactive views for the notebooks: ipywidgets controls over a matplotlib figure.

Each view is a function that draws a :class:`matplotlib.figure.Figure` from a few
parameters, and :func:`interactive_view` that puts controls (sliders, toggles) in front
of it. In JupyterLab the controls redraw the figure (mouse or keyboard: a focused slider
moves with the arrow keys). Where no widget can be shown — nbval, a plain notebook
viewer, GitHub — the same output carries a static PNG of the initial state: the view is
displayed as one bundle holding both the widget and the image, and every frontend
shows the richest one it can. Without IPython (a script) the figure is returned.

The views:

* :func:`running_max_view` (notebook 04): the running max of a row of scores, the max
  FlashAttention-4 keeps in use, and the rescales it triggers, as the lazy-rescaling
  threshold τ moves;
* :func:`page_pool_view` (notebook 05): a pool of KV pages as requests arrive, grow and
  finish (step slider), for several page sizes, with what each page size wastes;
* :func:`roofline_view` (any notebook): a kernel's benchmark cases on the roofline of
  the GPU they were measured on: the bound from its bytes and FLOPs, and the measured
  point from the saved results.

Nothing here imports a technique: notebooks pass the technique's functions in.
"""
from __future__ import annotations

import base64
import io
import math
import random
import sys
from typing import Callable

import matplotlib
import torch
from IPython.display import Image, display
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.ticker import FuncFormatter, MaxNLocator, NullFormatter

from . import bench
from .plots import plain_number
from .spec import all_specs, get

try:                                 # the views degrade to a static image without it
    import ipywidgets as widgets
except ImportError:                  # pragma: no cover - ipywidgets is a dependency
    widgets = None


# -- the machinery ---------------------------------------------------------------------------
def figure_png(fig: Figure, dpi: int = 100) -> bytes:
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    return buf.getvalue()


def in_notebook() -> bool:
    ipython = sys.modules.get("IPython")
    return ipython is not None and ipython.get_ipython() is not None


class InteractiveView:
    """Controls + the PNG of ``draw(**values)``, redrawn when a control changes."""

    def __init__(self, draw: Callable[..., Figure], controls: dict, caption: str = ""):
        self.draw = draw
        self.controls = controls
        self.caption = caption
        self.png = figure_png(draw(**self.values()))
        self.redraws = 0
        if widgets is not None:
            self.image = widgets.Image(value=self.png, format="png",
                                       layout=widgets.Layout(max_width="100%"))
            for c in controls.values():
                c.observe(self.update, names="value")
            rows = [widgets.HBox(list(controls.values()))]
            if caption:
                rows.append(widgets.HTML(f"<small>{caption}</small>"))
            self.widget = widgets.VBox(rows + [self.image])
            self.widget.add_class("gpulab-view")

    def values(self) -> dict:
        return {name: c.value for name, c in self.controls.items()}

    def update(self, _change=None) -> None:
        self.png = figure_png(self.draw(**self.values()))
        self.image.value = self.png
        self.redraws += 1

    def _repr_mimebundle_(self, **kwargs):
        static = {"image/png": base64.b64encode(self.png).decode("ascii"),
                  "text/plain": f"<{self.caption or 'gpulab view'}: static image; the controls "
                                f"need a notebook frontend with ipywidgets>"}
        if widgets is None:
            return static
        bundle = self.widget._repr_mimebundle_(**kwargs)
        data = bundle[0] if isinstance(bundle, tuple) else bundle
        return {**static, **{k: v for k, v in data.items() if k != "text/plain"}}


def interactive_view(draw: Callable[..., Figure], defaults: dict, make_controls: Callable[[], dict],
                     caption: str = "", show: bool = True):
    """Display controls in front of ``draw``'s figure, starting from ``defaults``;
    ``make_controls()`` builds the widgets (one per parameter of ``draw``). Without
    ipywidgets: the static figure (displayed in IPython, returned in a script)."""
    if widgets is None:
        fig = draw(**defaults)
        if show and in_notebook():
            display(Image(figure_png(fig)))
        return fig
    view = InteractiveView(draw, make_controls(), caption)
    if show and in_notebook():
        display(view)
    return view


def slider(description: str, value, lo, hi, step=1, fmt: str | None = None):
    """A float or int slider that redraws on release (and on each arrow key)."""
    kind = widgets.IntSlider if all(isinstance(v, int) for v in (value, lo, hi, step)) else widgets.FloatSlider
    kw = {"readout_format": fmt} if fmt else {}
    return kind(value=value, min=lo, max=hi, step=step, description=description,
                continuous_update=False, style={"description_width": "initial"}, **kw)


def choice(description: str, options, value=None):
    return widgets.ToggleButtons(options=list(options), value=value if value is not None else list(options)[0],
                                 description=description, style={"button_width": "auto",
                                                                 "description_width": "initial"})


# -- 04: running max and lazy rescaling -----------------------------------------------------------
def draw_running_max(rows, trace: Callable, tau: float, block_n: int = 128, title: str = "") -> Figure:
    """``trace(row, block_n, tau) -> (true max per block, max in use, rescale flags)``, maxima
    in log2 units of a row of scores in natural units (as the kernel sees them)."""
    true_max, used, flags = trace(rows[0], block_n, tau)
    _, _, flags0 = trace(rows[0], block_n, 0.0)
    per_row = sum(sum(trace(r, block_n, tau)[2]) for r in rows) / len(rows)
    per_row0 = sum(sum(trace(r, block_n, 0.0)[2]) for r in rows) / len(rows)
    fig = Figure(figsize=(8, 3.4))
    ax = fig.add_subplot()
    blocks = range(len(true_max))
    row = rows[0]
    block_max = [float(row[i:i + block_n].max()) * math.log2(math.e)      # natural -> log2 units
                 for i in range(0, len(row), block_n)]
    ax.scatter(blocks, block_max, s=8, color="0.6", label="each block's max")
    ax.plot(blocks, true_max, color="C0", label="true running max")
    ax.step(blocks, used, where="post", color="C1", label=f"max in use (τ = {tau:g})")
    ax.step(blocks, [u + tau for u in used], where="post", color="C1", ls="--", lw=0.8,
            label="max in use + τ: a block above this forces a rescale")
    hits = [i for i, f in enumerate(flags) if f]
    ax.scatter(hits, [used[i] for i in hits], marker="x", s=60, color="C3", zorder=3,
               label=f"rescale ({len(hits)} in this row)")
    ax.set(xlabel=f"key block ({block_n} keys each)", ylabel="max (log2 units)")
    ax.set_title(f"{title}τ = {tau:g}: {per_row:.1f} rescales per row on average, "
                 f"against {per_row0:.1f} with τ = 0", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


def running_max_view(score_rows: Callable[[str], object], trace: Callable, kinds=("recency", "iid", "sink"),
                     tau: float = 4.0, rows: int = 8, block_n: int = 128, show: bool = True):
    """Notebook 04: move the threshold τ and watch which blocks force a rescale.
    ``score_rows(kind)`` gives rows of scores (natural units), ``trace`` is
    ``gpulab.attention.running_max_trace`` (or the learner's own)."""
    cache = {}

    def draw(tau, kind):
        if kind not in cache:
            cache[kind] = list(score_rows(kind))[:rows]
        return draw_running_max(cache[kind], trace, tau, block_n, title=f"{kind} scores, ")
    return interactive_view(
        draw, {"tau": float(tau), "kind": kinds[0]},
        lambda: {"tau": slider("threshold τ", float(tau), 0.0, 12.0, 0.5, ".1f"),
                 "kind": choice("scores", kinds)},
        caption="Lazy rescaling: the accumulator is rescaled only when a block's max exceeds "
                "the max in use by more than τ.", show=show)


# -- 05: the page pool ----------------------------------------------------------------------------
def request_trace(n: int = 48, seed: int = 0, steps: int = 150) -> list[tuple[int, int, int]]:
    """(arrival step, prompt tokens, answer tokens) of ``n`` requests, long-tailed lengths."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        arrive = int(i * steps * 0.5 / n)
        prompt = max(1, min(200, int(rng.lognormvariate(3.6, 0.7))))
        answer = max(1, min(120, int(rng.lognormvariate(3.4, 0.8))))
        out.append((arrive, prompt, answer))
    return out


def simulate_pool(make_cache: Callable[[int, int], object], page_size: int, slots: int,
                  requests: list[tuple[int, int, int]], steps: int, empty_kv: Callable[[int], tuple]):
    """Run the requests through a paged cache: admission in arrival order while the prompt
    fits; each step every running request decodes one token; a request that needs a page
    when none is free preempts the newest running request, which frees its pages and
    starts over later (vLLM's recompute preemption). Returns one snapshot per step:
    (page owners, tokens per owner, running, waiting, finished)."""
    cache = make_cache(slots // page_size, page_size)
    waiting = list(range(len(requests)))
    running = {}                    # request -> [sequence id, tokens still to generate], admission order
    finished, snaps = 0, []
    for step in range(steps + 1):
        for r in list(waiting):
            arrive, prompt, answer = requests[r]
            if arrive > step or cache.pages_needed(prompt + 1) > cache.free_pages:
                break
            seq = cache.allocate()
            cache.append(seq, *empty_kv(prompt))
            running[r] = [seq, answer]
            waiting.remove(r)
        for r in list(running):
            if r not in running:    # preempted earlier in this step
                continue
            seq, left = running[r]
            if left == 0:
                cache.free(seq)
                del running[r]
                finished += 1
                continue
            while cache.pages_needed(cache.seq_len(seq) + 1) - len(cache.pages_of(seq)) > cache.free_pages:
                victim = list(running)[-1]
                cache.free(running.pop(victim)[0])
                waiting = sorted(waiting + [victim])
                if victim == r:
                    break
            if r in running:
                cache.append(seq, *empty_kv(1))
                running[r][1] = left - 1
        owners = cache.page_owners().tolist()
        seq_req = {seq: r for r, (seq, _left) in running.items()}
        snaps.append(([seq_req.get(o, -1) for o in owners],
                      {seq_req[s]: cache.seq_len(s) for s in seq_req},
                      len(running), len([r for r in waiting if requests[r][0] <= step]), finished))
    return snaps


def draw_page_pool(snaps_by_size: dict, page_size: int, step: int, slots: int) -> Figure:
    owners, lens, running, waiting, finished = snaps_by_size[page_size][step]
    num_pages = len(owners)
    cols = max(8, int(math.ceil(math.sqrt(num_pages * 2))))
    rows = int(math.ceil(num_pages / cols))
    fig = Figure(figsize=(10, 3.6))
    ax, ax2 = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.6, 1]})
    cmap = matplotlib.colormaps["tab20"]
    fill = {}                                      # how full each owner's last page is
    for p, o in enumerate(owners):
        if o >= 0:
            fill.setdefault(o, []).append(p)
    used_slots = sum(lens.values())
    for p, o in enumerate(owners):
        r, c = divmod(p, cols)
        color = (0.93, 0.93, 0.93) if o < 0 else cmap(o % 20)
        frac = 1.0
        if o >= 0 and p == fill[o][-1]:
            frac = ((lens[o] - 1) % page_size + 1) / page_size
        ax.add_patch(Rectangle((c, rows - 1 - r), 0.92, 0.92 * frac,
                                                  color=color, lw=0))
        if frac < 1:
            ax.add_patch(Rectangle((c, rows - 1 - r + 0.92 * frac), 0.92,
                                                      0.92 * (1 - frac), color=color, alpha=0.25, lw=0))
    ax.set_xlim(0, cols)
    ax.set_ylim(0, rows)
    ax.set_aspect("equal")
    ax.axis("off")
    held = sum(1 for o in owners if o >= 0) * page_size
    waste = 1 - used_slots / held if held else 0.0
    ax.set_title(f"step {step}: {running} running, {waiting} waiting, {finished} finished\n"
                 f"{num_pages} pages of {page_size} tokens; held pages {100 * waste:.0f}% empty "
                 f"(pale: unused tail of a last page)", fontsize=9)
    sizes = sorted(snaps_by_size)
    wastes, peaks = [], []
    for s in sizes:
        w = []
        for own, ln, run, _, _ in snaps_by_size[s]:
            h = sum(1 for o in own if o >= 0) * s
            if h:
                w.append(1 - sum(ln.values()) / h)
        wastes.append(100 * sum(w) / max(1, len(w)))
        peaks.append(max(snap[2] for snap in snaps_by_size[s]))
    ax2.plot(sizes, wastes, "o-", color="C3", label="held slots left empty (%)")
    ax2.set_xscale("log", base=2)
    ax2.xaxis.set_major_formatter(FuncFormatter(plain_number))
    ax2.xaxis.set_minor_formatter(NullFormatter())
    ax2.set_xticks(sizes)
    ax2.set_xlabel("page size (tokens)")
    ax2.set_ylabel("internal fragmentation, %", color="C3")
    ax2.axvline(page_size, color="k", lw=0.8, ls=":")
    twin = ax2.twinx()
    twin.plot(sizes, peaks, "s--", color="C0", label="most requests running at once")
    twin.set_ylabel("peak running requests", color="C0")
    twin.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.set_title(f"same requests, same {slots} KV slots", fontsize=9)
    fig.tight_layout()
    return fig


def page_pool_view(make_cache: Callable[[int, int], object], empty_kv: Callable[[int], tuple],
                   page_sizes=(1, 4, 16, 64), page_size: int = 16, slots: int = 1024,
                   steps: int = 150, requests: list | None = None, show: bool = True):
    """Notebook 05: step through arrivals, decoding and completions in a page pool.
    ``make_cache(num_pages, page_size)`` builds the cache (e.g. ``paged.PagedKVCache``
    with one kv head), ``empty_kv(n)`` the ``(k, v)`` of ``n`` tokens to append."""
    requests = requests or request_trace(steps=steps)
    snaps = {s: simulate_pool(make_cache, s, slots, requests, steps, empty_kv) for s in page_sizes}

    def draw(step, page):
        return draw_page_pool(snaps, page, step, slots)
    start = steps // 2
    return interactive_view(
        draw, {"step": start, "page": page_size},
        lambda: {"step": slider("step", start, 0, steps, 1),
                 "page": choice("page size", page_sizes, page_size)},
        caption="Each square is a page; a colour is a request. Requests arrive, decode one token "
                "per step and free their pages when done.", show=show)


# -- the roofline explorer ------------------------------------------------------------------------
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def roofline_points(name: str, case_label: str, dtype_name: str) -> dict:
    """The bound from the spec's bytes and FLOPs and, when saved, the measured point."""
    spec = get(name)
    saved = bench.load(name)
    case = next(c for c in spec.cases["bench"] if c.label == case_label)
    dtype = getattr(torch, DTYPE_NAMES[dtype_name])
    nbytes, nflops = spec.bytes_moved(case.params, dtype), spec.flops(case.params, dtype)
    out = {"bytes": nbytes, "flops": nflops, "intensity": nflops / nbytes, "saved": saved}
    if saved:
        bw, peak = saved["ceilings"]["bytes_per_s"], saved["ceilings"]["flops_per_s"]
        out["bound_flops_per_s"] = min(peak, bw * out["intensity"])
        out["bound_s"] = max(nbytes / bw, nflops / peak)
        row = next((r for r in saved["rows"] if r["impl"] == "gpulab" and r["case"] == case_label
                    and r["dtype"] == DTYPE_NAMES[dtype_name] and r.get("ms")), None)
        if row:
            out["measured_flops_per_s"] = nflops / (row["ms"] * 1e-3)
            out["measured_ms"] = row["ms"]
    return out


def draw_roofline(name: str, case_label: str, dtype_name: str) -> Figure:
    pts = roofline_points(name, case_label, dtype_name)
    saved = pts["saved"]
    fig = Figure(figsize=(7.5, 4))
    ax = fig.add_subplot()
    bw, peak = saved["ceilings"]["bytes_per_s"], saved["ceilings"]["flops_per_s"]
    ridge = peak / bw
    xs = [ridge / 1e4, ridge, ridge * 1e2]
    ax.plot(xs, [min(peak, bw * x) / 1e12 for x in xs], "k-", lw=1.5,
            label=f"roofline: {bw / 1e12:.2f} TB/s, {peak / 1e12:.0f} TFLOP/s (measured)")
    ax.axvline(ridge, color="k", ls=":", lw=0.8)
    for c in get(name).cases["bench"]:        # every case of this kernel, faint
        other = roofline_points(name, c.label, dtype_name)
        if "measured_flops_per_s" in other:
            ax.scatter(other["intensity"], other["measured_flops_per_s"] / 1e12, s=18, color="0.7", zorder=2)
    ax.scatter(pts["intensity"], pts["bound_flops_per_s"] / 1e12, s=90, facecolors="none",
               edgecolors="C0", lw=2, zorder=3, label=f"bound: {pts['bound_s'] * 1e6:.1f} µs")
    if "measured_flops_per_s" in pts:
        share = 100 * pts["bound_s"] / (pts["measured_ms"] * 1e-3)
        ax.scatter(pts["intensity"], pts["measured_flops_per_s"] / 1e12, s=70, color="C3", zorder=4,
                   label=f"measured: {pts['measured_ms'] * 1e3:.1f} µs ({share:.0f}% of the roofline)")
    else:
        ax.text(0.02, 0.04, f"no measured {dtype_name} point saved for this case", transform=ax.transAxes,
                fontsize=8, color="C3")
    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(FuncFormatter(lambda v, _p: f"{v:g}"))
        axis.set_minor_formatter(NullFormatter())
    ax.set(xlabel="arithmetic intensity (FLOP per byte moved)", ylabel="TFLOP/s")
    bound = "memory" if pts["intensity"] < ridge else "compute"
    ax.set_title(f"{name}, {case_label}, {dtype_name}: {pts['bytes'] / 1e6:.1f} MB, "
                 f"{pts['flops'] / 1e9:.2f} GFLOP → {bound}-bound\n{saved['gpu']} ({saved['date']})",
                 fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


def roofline_kernels() -> list[str]:
    """Kernels with bytes, FLOPs, benchmark cases and saved results."""
    return [n for n, s in sorted(all_specs().items())
            if s.bytes_moved and s.flops and s.cases.get("bench") and bench.load(n)]


def roofline_view(name: str | None = None, kernels=None, show: bool = True):
    """Place a kernel's benchmark cases on the roofline: pick the kernel, slide through its
    shapes, switch the dtype; the open circle is the bound from bytes and FLOPs, the dot
    what was measured (saved results, an H200 unless you re-ran ``gpulab bench --save``)."""
    kernels = list(kernels or roofline_kernels())
    name = name or kernels[0]

    def draw(kernel, case, dtype):
        labels = [c.label for c in get(kernel).cases["bench"]]
        return draw_roofline(kernel, case if case in labels else labels[0], dtype)
    labels = [c.label for c in get(name).cases["bench"]]

    def controls():
        kernel = widgets.Dropdown(options=kernels, value=name, description="kernel")
        case = widgets.SelectionSlider(options=labels, value=labels[0], description="shape",
                                       continuous_update=False, layout=widgets.Layout(width="340px"))

        def new_kernel(change):
            case.options = [c.label for c in get(change["new"]).cases["bench"]]
        kernel.observe(new_kernel, names="value")
        return {"kernel": kernel, "case": case, "dtype": choice("dtype", tuple(DTYPE_NAMES), "bf16")}
    return interactive_view(draw, {"kernel": name, "case": labels[0], "dtype": "bf16"}, controls,
                            caption="Open circle: the fastest this case can run on this GPU; dot: "
                            "what gpulab's kernel measured.", show=show)
