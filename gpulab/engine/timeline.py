"""Seeing the engine work: what the scheduler ran at every step and where the pages went.

:func:`record` serves requests step by step and keeps, per step, the scheduled
sequences (prefill chunk or decode, tokens), the preemptions and the state of every
page: held by one sequence, shared, free but still cached (findable by its hash), or
blank. :func:`draw` renders one step (the timeline up to it and the page pool then);
:func:`explore` puts a step slider in front of it (ipywidgets); without a widget
frontend (nbval, a rendered notebook) the same output is a static image of one step.
"""
from __future__ import annotations

from dataclasses import dataclass

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from ..harness.views import interactive_view, slider
from .engine import LLM


@dataclass
class Frame:
    step: int
    scheduled: list[tuple[int, int, bool]]    # (seq id, tokens, prefill?)
    preempted: list[int]
    pages: list[str]                          # per page: used / shared / cached / free
    owners: list[int]                         # per page: holding sequence id (first holder), -1 if none
    waiting: int


def record(llm: LLM, prompts, params, max_steps: int = 10_000) -> list[Frame]:
    """Serve ``prompts`` to completion, one frame per step. A GPU engine whose host runs a
    step ahead (``EngineConfig.overlap``) records a step only when the next one starts, so
    here it runs one step at a time (the same steps; only when tokens are read differs)."""
    if llm.in_flight is not None:
        raise ValueError("timeline.record needs an engine with no step in flight: "
                         "serve its running requests to the end first")
    for p, sp in zip(prompts, params if isinstance(params, (list, tuple)) else [params] * len(prompts)):
        llm.add_request(p, sp)
    overlap, llm.overlap = llm.overlap, False
    try:
        return _frames(llm, max_steps)
    finally:
        llm.overlap = overlap


def _frames(llm: LLM, max_steps: int) -> list[Frame]:
    frames = []
    while llm.has_unfinished() and len(frames) < max_steps:
        llm.step()
        rec = llm.metrics.steps[-1]
        owners = [-1] * llm.block_manager.num_blocks
        for seq in sorted(llm.scheduler.running, key=lambda s: -s.seq_id):
            for b in seq.block_table:
                owners[b] = seq.seq_id
        frames.append(Frame(len(frames), list(rec.scheduled), list(rec.preempted_ids),
                            llm.block_manager.snapshot(), owners, rec.waiting))
    return frames


_STATE_COLORS = {"free": "#ffffff", "cached": "#c8c8c8", "shared": "#222222"}


def draw(frames: list[Frame], step: int, fig=None, columns: int | None = None):
    """The timeline up to ``step`` (left) and the page pool after it (right)."""
    fig = fig or plt.figure(figsize=(11, 4.2))
    fig.clf()
    ax, pool = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.6, 1]})
    cmap = plt.get_cmap("tab20")
    for f in frames[:step + 1]:
        for sid, n, prefill in f.scheduled:
            ax.barh(sid, 1, left=f.step, height=0.8, color=cmap(sid % 20),
                    alpha=1.0 if prefill else 0.45, edgecolor="k" if prefill else "none", lw=0.5)
        for sid in f.preempted:
            ax.plot(f.step + 0.5, sid, "rx", ms=7, mew=2)
    ax.axvline(step + 1, color="k", lw=1, ls="--")
    ax.set_xlim(0, max(len(frames), 1))
    ax.set_xlabel("step")
    ax.set_ylabel("sequence")
    ax.set_title("scheduled: solid = prefill chunk, pale = decode, x = preempted", fontsize=9)
    f = frames[step]
    n = len(f.pages)
    columns = columns or (8 if n <= 64 else 16)
    rows = -(-n // columns)
    colors = []
    for state, owner in zip(f.pages, f.owners):
        colors.append(cmap(owner % 20) if state == "used" and owner >= 0 else _STATE_COLORS.get(state, "#ffffff"))
    for i, c in enumerate(colors):
        pool.add_patch(plt.Rectangle((i % columns, rows - 1 - i // columns), 0.92, 0.92, color=c, ec="0.6", lw=0.4))
    pool.set_xlim(-0.1, columns)
    pool.set_ylim(-0.1, rows)
    pool.set_aspect("equal")
    pool.axis("off")
    used = sum(s in ("used", "shared") for s in f.pages)
    cached = sum(s == "cached" for s in f.pages)
    pool.set_title(f"page pool after step {step}: {used} held, {cached} cached, {f.waiting} waiting", fontsize=9)
    pool.legend(handles=[Patch(color=cmap(0), label="held (colour = sequence)"),
                         Patch(color=_STATE_COLORS["shared"], label="shared (ref > 1)"),
                         Patch(facecolor=_STATE_COLORS["cached"], label="free, cached"),
                         Patch(facecolor="white", edgecolor="0.6", label="free, blank")],
                fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=2)
    fig.tight_layout()
    return fig


def explore(frames: list[Frame]):
    """A step slider in front of the figure (:func:`gpulab.harness.views.interactive_view`:
    where no widget frontend runs, a static image of the middle step)."""
    mid = len(frames) // 2
    return interactive_view(lambda step: draw(frames, step, fig=Figure(figsize=(11, 4.2))), {"step": mid},
                            lambda: {"step": slider("step", mid, 0, max(len(frames) - 1, 0))},
                            caption="what the scheduler ran up to this step, and the page pool after it")
