"""Running one scheduled step through the model: plan once, then every layer.

**The plan** (:meth:`ModelRunner.plan`, host side, once per step) flattens the batch
into rows, decodes first, then prefill chunks:

    input_ids, positions     the tokens to run and where they sit in their sequence
    slot_mapping             page · block_size + offset where each row's K and V go
    decode: block table + lengths (or a shared prefix + suffixes, for cascade)
    append: qo_indptr + block table + kv lengths (ragged prefill chunks)
    sample_rows              the rows whose logits pick a next token (each sequence's
                             last row, once its prompt is fully computed)

**The layers** then call ``attend`` once per layer: write this step's keys and values
into their slots, run decode attention on the decode rows and append attention on the
rest (:mod:`.batch_attention`). Eager decode rows use FlashInfer's plan/run split
(:class:`gpulab.paged.PagedDecodeWrapper`): checked and partitioned once in the plan,
launched by every layer without a host sync. Linear layers are the packed BitLinears (gpulab's
Triton kernels) or, with ``linear="torch"``, the same arithmetic in PyTorch ops;
``attention="torch"`` likewise runs attention as the PyTorch reference. "auto" picks
Triton where kernels are compiled (a GPU) and PyTorch in the interpreter, which is
about a thousand times slower than PyTorch on the CPU (it exists to check kernels).

**CUDA graphs** (compiled mode only): a decode-only step of B sequences replays a graph
captured for the smallest bucket ≥ B (1, 2, 4, ..., max_num_seqs), the spare rows padded
(they write to a scratch page and attend to nothing). Replaying removes the CPU cost of
launching each kernel of each layer.

**Piecewise CUDA graphs** (:mod:`.piecewise`, compiled mode only): a step with prompt
chunks replays, per token-count bucket, graphs of the model's work *between* its
attention calls and runs only attention eagerly (:meth:`ModelRunner.capture_piecewise`).

**Whole-step CUDA graphs** (:mod:`.full_graphs`, compiled mode only): a step with prompt
chunks (up to 128 rows of 16 requests, or up to 2048 rows of any number of requests)
replays one graph of its whole forward, every row an append row, attention's work list
built inside the graph (:meth:`ModelRunner.capture_full`); the plan writes such a step
into the bucket's inputs. Bigger steps take the piecewise graphs.

**Host cost.** At batch 256 the forward of a decode step is a few milliseconds, so the
host's share matters: the plan writes all of a step's index arrays with NumPy into one
host buffer (pinned on a GPU) and sends it with a single non-blocking copy; a graph
step's buffer has the bucket's static layout, so that copy *is* the graph's input update
and replay copies nothing.
"""
from __future__ import annotations

import functools
import itertools
import math
import operator
from dataclasses import dataclass

import numpy as np
import torch

from .. import runtime
from ..paged import PagedDecodeWrapper
from .batch_attention import (append_attention, append_attention_reference, decode_attention,
                              plan_append_attention, shared_prefix_pages)
from .full_graphs import MAX_TOKENS as FULL_MAX_TOKENS
from .full_graphs import FullStepGraphs, full_input_fields
from .graph_capture import capture, tokens_from_device
from .model import TernaryTransformer
from .piecewise import PiecewiseGraphs
from .sequence import SamplingParams, Sequence


@dataclass
class StepPlan:
    input_ids: torch.Tensor           # long [T]
    positions: torch.Tensor           # long [T]
    slot_mapping: torch.Tensor        # long [T]
    num_decode: int                   # rows 0 .. num_decode-1 are one-token decodes
    decode_table: torch.Tensor        # int32 [num_decode, W] (the suffix pages under cascade)
    decode_lens: torch.Tensor         # int32 [num_decode]
    prefix: tuple | None              # (prefix_pages int32 [k], prefix_len) for cascade
    append_indptr: torch.Tensor       # int32 [num_append + 1], rows after the decodes
    append_table: torch.Tensor        # int32 [num_append, W]
    append_lens: torch.Tensor         # int32 [num_append]
    sample_rows: torch.Tensor         # long [S]
    sample_seqs: list[Sequence]
    use_graph: bool = False
    decode_planned: bool = False      # the runner's PagedDecodeWrapper holds this step's decode plan
    graph_bucket: int = 0             # the CUDA graph whose static inputs hold this plan (use_graph)
    sample_all: bool = False          # sample_rows is 0 .. num_decode-1 (a graph step reads out[:n])
    append_work: tuple | None = None  # the append rows' work list, built once for all layers
    feed: torch.Tensor | None = None  # long [T]: row r's input id is the runner's kept token
                                      # feed[r] where >= 0 (see ModelRunner.keep_tokens)
    feed_all: bool = False            # every row is fed
    full_bucket: int = 0              # the whole-step graph whose static inputs hold this plan
                                      # (.full_graphs: a step with prompt chunks)
    full_decode_lens: torch.Tensor | None = None    # int32 [R]: a big whole-step graph's decode
                                      # kernel lengths (0 for requests that are not decodes)
    full_append_indptr: torch.Tensor | None = None  # int32 [R + 1]: its append kernel's requests
                                      # (the decodes own no rows there)


# The host buffer of a step: (name, NumPy dtype, shape) per field, in this order
def eager_input_fields(num_rows: int, num_sample: int, nd: int, na: int, width: int, prefix) -> list:
    fields = [("rows", np.int64, (4, num_rows)),           # input ids, positions, slot mapping, feed
              ("sample", np.int64, (num_sample,)), ("lens", np.int32, (nd + na,)),
              ("indptr", np.int32, (na + 1,)), ("table", np.int32, (nd + na, width))]
    if prefix is not None:
        fields += [("prefix", np.int32, (len(prefix[0]),)), ("dec_table", np.int32, (nd, width))]
    return fields


def graph_input_fields(bucket: int, max_blocks: int, table_rows: int | None = None) -> list:
    """A decode graph's static inputs; the table comes last, so a step of n rows sends
    only the first n rows of it (the padded rows have length 0 and read no page)."""
    return [("rows", np.int64, (4, bucket)), ("sample", np.int64, (bucket,)), ("lens", np.int32, (bucket,)),
            ("table", np.int32, (bucket if table_rows is None else table_rows, max_blocks))]


_tokens_of = operator.itemgetter(1)         # of a (sequence, tokens) item
_TORCH_DTYPE = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}


class HostBuffer:
    """One step's index arrays in one host buffer (pinned for a GPU), each field at a
    16-byte-aligned offset: filled through NumPy views, sent to the device with one copy.
    A pinned buffer comes from PyTorch's caching host allocator, which reuses it only
    after the copy that reads it has run."""

    def __init__(self, fields: list, pin: bool):
        self.layout = field_layout(fields)
        self.nbytes = end = self.layout[-1][2]
        self.host = torch.empty(max(end, 8), dtype=torch.uint8, pin_memory=pin)
        raw = self.host.numpy()
        self.arrays = {name: raw[a:b].view(dt).reshape(shape) for name, a, b, dt, shape in self.layout}

    def send(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The fields on ``device``: one non-blocking copy (none on the CPU)."""
        if device.type == "cpu":
            return {name: torch.from_numpy(v) for name, v in self.arrays.items()}
        return tensor_fields(self.host[:self.nbytes].to(device, non_blocking=True), self.layout)

    def send_into(self, out: torch.Tensor) -> None:
        """One non-blocking copy into the first bytes of ``out`` (a buffer of this layout)."""
        out[:self.nbytes].copy_(self.host[:self.nbytes], non_blocking=True)


def field_layout(fields: list) -> list:
    """(name, first byte, end byte, dtype, shape) per field, each at a 16-byte-aligned
    offset (any field can be viewed as int64, and Triton sees the same pointer alignment
    every step: no recompilation); the last end is the buffer's size."""
    layout, start = [], 0
    for name, dtype, shape in fields:
        dtype = np.dtype(dtype)
        end = start + dtype.itemsize * math.prod(shape)
        layout.append((name, start, end, dtype, shape))
        start = -(-end // 16) * 16
    return layout


def tensor_fields(buf: torch.Tensor, layout: list) -> dict[str, torch.Tensor]:
    """Typed views of a byte buffer laid out as :class:`HostBuffer` lays out its fields."""
    return {name: buf[a:b].view(_TORCH_DTYPE[dt]).view(shape) for name, a, b, dt, shape in layout}


def fill_tables(out: np.ndarray, tables: list[list[int]]) -> None:
    """``out[i, :len(tables[i])] = tables[i]``, zeros elsewhere: one conversion of all
    the step's page ids, not one per row."""
    out.fill(0)
    if not tables:
        return
    lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    w = int(lens.max())
    flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int32, count=int(lens.sum()))
    out[:, :w][np.arange(w) < lens[:, None]] = flat


def bucket_sizes(max_num_seqs: int) -> list[int]:
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    return sizes + [max_num_seqs]


class ModelRunner:
    def __init__(self, model: TernaryTransformer, num_blocks: int, block_size: int,
                 max_num_seqs: int = 64, linear: str = "auto", attention: str = "auto",
                 cuda_graphs: bool = True, cascade: bool = False, decode_hook=None,
                 kv_split: bool | int = False):
        for name, v in (("linear", linear), ("attention", attention)):
            if v not in ("auto", "triton", "torch"):
                raise ValueError(f"{name} must be 'auto', 'triton' or 'torch', got {v!r}")
        if not isinstance(kv_split, (bool, int)) or (type(kv_split) is int and kv_split < 1):
            raise ValueError(f"kv_split must be True, False or a number of parts >= 1, got {kv_split!r}")
        self.kv_split = kv_split
        if not model.packed:
            raise ValueError("the runner serves packed models: call model.pack() (or load_checkpoint)")
        cfg = model.cfg
        self.model, self.cfg, self.block_size = model, cfg, block_size
        self.device = model.embed.weight.device
        self.dtype = model.embed.weight.dtype
        auto = "triton" if runtime.mode() == "compiled" and self.device.type == "cuda" else "torch"
        self.linear = auto if linear == "auto" else linear
        self.attention = auto if attention == "auto" else attention
        self.cascade, self.decode_hook = cascade, decode_hook
        self.max_blocks = -(-cfg.max_seq_len // block_size)      # block-table width
        # page num_blocks is scratch: padded graph rows write there
        shape = (cfg.n_layers, num_blocks + 1, block_size, cfg.n_kv_heads, cfg.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.scratch_slot = num_blocks * block_size
        self.graphs: dict[int, tuple] = {}
        self.graph_inputs: dict[int, torch.Tensor] = {}      # bucket -> its static input bytes
        self.graph_views: dict[int, dict] = {}               # bucket -> typed views of them
        self.bucket_of: list[int] = []                       # decode rows -> graph bucket
        self.max_num_seqs = max_num_seqs
        self.pin = self.device.type == "cuda"                # pinned host buffers: asynchronous copies
        self.no_indptr = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.no_table = torch.zeros((0, 1), dtype=torch.int32, device=self.device)
        self.no_lens = torch.zeros(0, dtype=torch.int32, device=self.device)
        # eager decode steps: planned (and checked) once per step, run by every layer
        self.decode_wrapper = PagedDecodeWrapper()
        # graphs replay gpulab's decode kernels; a hook or the PyTorch reference may sync the host
        self.graphs_possible = (cuda_graphs and runtime.mode() == "compiled" and self.device.type == "cuda"
                                and self.attention == "triton" and decode_hook is None)
        self.piecewise: PiecewiseGraphs | None = None          # see capture_piecewise
        self.full_graphs: FullStepGraphs | None = None         # see capture_full
        self.kept = torch.zeros(max_num_seqs, dtype=torch.long, device=self.device)   # see keep_tokens
        if self.graphs_possible:
            self.capture_graphs()

    # -- plan -------------------------------------------------------------------------------
    def plan(self, items: list[tuple[Sequence, int]], feed: dict[Sequence, int] | None = None) -> StepPlan:
        """Flatten one step's (sequence, new tokens) into tensors, decodes first.

        Every index array of the step is written in NumPy into one host buffer (pinned on
        a GPU) and sent with one non-blocking copy. A decode-only step that a CUDA graph
        can run is laid out as that graph's bucket reads it: the copy lands in the graph's
        static input buffer and :meth:`replay` copies nothing (such a plan's tensors are
        views of that buffer: valid until the next plan of the same bucket)."""
        bs = self.block_size
        if max(map(_tokens_of, items), default=1) == 1:
            dec, app = [s for s, _ in items], []
        else:
            dec, app = [s for s, n in items if n == 1], [(s, n) for s, n in items if n > 1]
        nd, na = len(dec), len(app)
        # decode rows: one token each, the sequence's next uncomputed one
        starts = [s.num_computed_tokens for s in dec]
        ids = [s.token_ids[p] for s, p in zip(dec, starts)]
        tables = [s.block_table for s in dec]
        sample_seqs = [s for s, p in zip(dec, starts) if p + 1 == len(s.token_ids)]
        sample_all = len(sample_seqs) == nd          # else a 1-token prompt chunk is not sampled
        rows = list(range(nd)) if sample_all else [r for r, (s, p) in enumerate(zip(dec, starts))
                                                   if p + 1 == len(s.token_ids)]
        # append rows (prompt chunks, several tokens each)
        a_starts, a_lens = [], []
        for seq, n in app:
            start = seq.num_computed_tokens
            ids += seq.token_ids[start:start + n]
            tables.append(seq.block_table)
            a_starts.append(start)
            a_lens.append(n)
            if start + n == len(seq.token_ids):
                rows.append(len(ids) - 1)
                sample_seqs.append(seq)
        num_rows = len(ids)
        w = max(map(len, tables), default=1) or 1   # the step's longest table, not the context's
        prefix = None
        if self.cascade and self.attention == "triton" and nd > 1:
            dec_lens = [p + 1 for p in starts]
            k = shared_prefix_pages(tables[:nd], dec_lens, bs)
            if k:
                prefix = (tables[0][:k], k * bs)
        fed_rows = [feed.get(s, -1) for s in dec] if feed else None
        use_graph = na == 0 and prefix is None and 0 < nd <= self.max_num_seqs and bool(self.graphs)
        full = 0 if use_graph or not na or prefix is not None or self.full_graphs is None \
            else self.full_graphs.bucket(num_rows, nd + na)
        if full or use_graph:                          # a graph's bucket layout, its padding set
            if full:                                   # all rows as append rows
                fields = full_input_fields(full, self.full_graphs.requests[full], self.max_blocks, nd + na)
            else:
                b = self.bucket_of[nd]
                fields = graph_input_fields(b, self.max_blocks, nd)
            host = HostBuffer(fields, self.pin)
            a = host.arrays
            a["rows"][:, num_rows:] = 0
            a["rows"][2, num_rows:] = self.scratch_slot   # padded rows write to the scratch page
            a["rows"][3, num_rows:] = -1
            a["lens"][nd + na:] = 0                    # padded rows / requests: no history
            a["sample"][len(rows):] = 0
            table = a["table"]
        else:
            host = HostBuffer(eager_input_fields(num_rows, len(rows), nd, na, w, prefix), self.pin)
            a = host.arrays
            a["indptr"][0] = 0
            table = a["table"]
        r = a["rows"]                                  # int64 [4, rows]: ids, positions, slots, feed
        r[0, :num_rows] = ids
        fed = r[3, :num_rows]
        fed[:] = -1
        if fed_rows:                                   # decode rows whose token is still on the device
            fed[:nd] = fed_rows
        fed_any = bool(fed_rows) and max(fed_rows) >= 0
        fed_all = fed_any and num_rows == nd and min(fed_rows) >= 0
        pos = r[1, :num_rows]
        pos[:nd] = starts
        fill_tables(table, tables)
        lens = a["lens"]
        lens[:nd] = pos[:nd]
        lens[:nd] += 1
        if na:
            n_a = np.array(a_lens, dtype=np.int64)
            first = np.cumsum(n_a) - n_a               # each chunk's first row among the append rows
            pos[nd:] = np.repeat(np.array(a_starts, dtype=np.int64) - first, n_a) + np.arange(num_rows - nd)
            row_of = np.concatenate([np.arange(nd), np.repeat(np.arange(nd, nd + na), n_a)])
            indptr = a["indptr"]
            if full:                                   # decodes are requests of one row; unused ones own none
                indptr[:nd + 1] = np.arange(nd + 1)
                np.cumsum(n_a, out=indptr[nd + 1:nd + na + 1])
                indptr[nd + 1:nd + na + 1] += nd
                indptr[nd + na + 1:] = num_rows
                a["app_indptr"][:] = indptr            # for the decode kernel beside it: no decode
                a["app_indptr"][:nd + 1] = nd          # owns rows in the append kernel
                dec_lens = a["dec_lens"]
                dec_lens[:] = 0
                dec_lens[:nd] = lens[:nd]
            else:
                np.cumsum(n_a, out=indptr[1:])
            lens[nd:nd + na] = np.array(a_starts, dtype=np.int64) + n_a
        else:
            row_of = np.arange(nd)
        r[2, :num_rows] = table[row_of, pos // bs] * bs + pos % bs
        a["sample"][:len(rows)] = rows
        if prefix is not None:
            k = len(prefix[0])
            a["prefix"][:] = prefix[0]
            dt = a["dec_table"]
            dt[:, :w - k] = table[:nd, k:w]
            dt[:, w - k:] = 0
            lens[:nd] -= k * bs
        if full:
            host.send_into(self.full_graphs.inputs[full])
            v = self.full_graphs.views[full]
            # every row an append row (a decode is a request of one): no decode rows
            plan = StepPlan(v["rows"][0][:num_rows], v["rows"][1][:num_rows], v["rows"][2][:num_rows], 0,
                            v["table"][:0], v["lens"][:0], None, v["indptr"], v["table"], v["lens"],
                            v["sample"][:len(rows)], sample_seqs, full_bucket=full)
            if self.full_graphs.splits_decodes(full):
                plan.full_decode_lens, plan.full_append_indptr = v["dec_lens"], v["app_indptr"]
            if fed_any:
                plan.feed = v["rows"][3][:num_rows]
            return plan
        if use_graph:
            host.send_into(self.graph_inputs[b])
            plan = self.graph_plan(b, nd, len(rows), sample_all, sample_seqs)
            if fed_any:                                # substituted before the replay
                plan.feed, plan.feed_all = self.graph_views[b]["feed"][:nd], fed_all
        else:
            t = host.send(self.device)
            rows_t = t["rows"]
            plan = StepPlan(
                input_ids=rows_t[0], positions=rows_t[1], slot_mapping=rows_t[2], num_decode=nd,
                decode_table=t["dec_table"] if prefix is not None else t["table"][:nd],
                decode_lens=t["lens"][:nd],
                prefix=None if prefix is None else (t["prefix"], prefix[1]),
                append_indptr=t["indptr"], append_table=t["table"][nd:], append_lens=t["lens"][nd:],
                sample_rows=t["sample"], sample_seqs=sample_seqs, feed=rows_t[3] if fed_any else None,
                feed_all=fed_all)
        if nd and prefix is None and not plan.use_graph and self.attention == "triton" \
                and self.decode_hook is None:
            self.plan_decode(plan)
        if na and self.attention == "triton" and runtime.mode() == "compiled":
            c = self.cfg
            split = self.kv_split                    # False, True (planned) or a number of parts
            plan.append_work = plan_append_attention(
                plan.append_indptr, num_rows - nd, self.dtype, c.n_heads, c.n_kv_heads, c.head_dim, self.device,
                capacity=None if split is False else plan.append_table.shape[1] * self.block_size,
                num_splits=split if type(split) is int else None)
        return plan

    def graph_plan(self, b: int, n: int, num_sample: int, sample_all: bool, sample_seqs) -> StepPlan:
        """The plan of a decode-only step of ``n`` rows in bucket ``b``: views of the
        bucket's static inputs (written by this step's one copy)."""
        v = self.graph_views[b]
        return StepPlan(v["ids"][:n], v["pos"][:n], v["slots"][:n], n, v["table"][:n], v["lens"][:n], None,
                        self.no_indptr, self.no_table, self.no_lens,
                        v["all"][:n] if sample_all else v["sample"][:num_sample], sample_seqs,
                        use_graph=True, graph_bucket=b, sample_all=sample_all)

    def plan_decode(self, plan: StepPlan) -> None:
        """FlashInfer's plan/run for an eager step's decode rows: the split-KV partitioning
        is chosen here, once, and each layer's run() only launches kernels. The layout is
        not read back: it was built here on the host from the block manager's pages, and
        reading it on the device would wait for the step before (the engine reads the
        fault flag with each step's tokens instead, :class:`~.engine.InFlight`); with
        ``GPULAB_DEBUG=1`` (:func:`gpulab.runtime.debug_checks`) it is, every step."""
        cfg = self.cfg
        self.decode_wrapper.plan(plan.decode_table, plan.decode_lens, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                                 self.block_size, self.k_cache.shape[1], self.dtype,
                                 # the interpreter pays per program: one partition per sequence
                                 num_splits=1 if runtime.interpreting() else None,
                                 check_layout=runtime.debug_checks())
        plan.decode_planned = True

    # -- run --------------------------------------------------------------------------------
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate pages (all layers, K and V) before anything writes."""
        if copies:
            src = torch.tensor([s for s, _ in copies], device=self.device)
            dst = torch.tensor([d for _, d in copies], device=self.device)
            self.k_cache[:, dst] = self.k_cache[:, src]
            self.v_cache[:, dst] = self.v_cache[:, src]

    def kv_destination(self, slots: torch.Tensor):
        """The model's ``kv_cache`` for a step whose rows go to ``slots`` (long [rows]: page ·
        block_size + offset): layer -> (slots, its K cache, its V cache as rows of slots).
        The model stores each layer's K, V there (in its RoPE kernel) before attention."""
        kc, vc = self.k_cache, self.v_cache
        return lambda layer: (slots, kc[layer].flatten(0, 1), vc[layer].flatten(0, 1))

    def attend(self, plan: StepPlan, layer: int, q, k, v, out: torch.Tensor | None = None):
        """Attention for every row of the step, over the paged cache, where this step's K, V
        already are (the model stored them: :meth:`kv_destination`); into ``out`` [rows, Hq,
        D] when given (the piecewise graphs' static buffer)."""
        kc, vc = self.k_cache[layer], self.v_cache[layer]
        nd = plan.num_decode
        if self.attention == "torch" and self.decode_hook is None:     # PyTorch reference only
            indptr = torch.arange(nd + 1, dtype=torch.int32, device=q.device)
            if nd == q.shape[0]:
                o = append_attention_reference(q, kc, vc, indptr, plan.decode_table, plan.decode_lens)
            else:
                indptr = torch.cat([indptr, plan.append_indptr[1:] + nd])
                o = append_attention_reference(q, kc, vc, indptr, torch.cat([plan.decode_table, plan.append_table]),
                                               torch.cat([plan.decode_lens, plan.append_lens]))
            return o if out is None else out.copy_(o)
        if plan.full_decode_lens is not None:      # a big whole-step graph: decodes, then chunks
            r = min(plan.full_decode_lens.shape[0], q.shape[0])
            o = torch.empty_like(q) if out is None else out
            o[:r] = decode_attention(q[:r], kc, vc, plan.append_table[:r], plan.full_decode_lens[:r])
            append_attention(q, kc, vc, plan.full_append_indptr, plan.append_table, plan.append_lens, out=o,
                             work=plan.append_work)       # overwrites the chunk rows among 0 .. r-1
            return o
        if plan.decode_planned:      # the plan's buffer (or out), consumed before the next layer
            dec = self.decode_wrapper.run(q[:nd], kc, vc, out=None if out is None else out[:nd])
        else:
            dec = decode_attention(q[:nd], kc, vc, plan.decode_table, plan.decode_lens,
                                   hook=self.decode_hook, prefix=plan.prefix) if nd else None
            if out is not None and dec is not None:
                dec = out[:nd].copy_(dec)
        if nd == q.shape[0]:
            return dec
        app = append_attention(q[nd:], kc, vc, plan.append_indptr, plan.append_table, plan.append_lens,
                               out=None if out is None else out[nd:], work=plan.append_work)
        if out is not None:
            return out
        return app if dec is None else torch.cat([dec, app])

    def forward(self, plan: StepPlan) -> torch.Tensor:
        """Logits [S, vocab] (float32) of the plan's sample rows."""
        h = self.model.hidden_states(plan.input_ids, plan.positions,
                                     lambda layer, q, k, v: self.attend(plan, layer, q, k, v),
                                     reference=self.linear == "torch",
                                     kv_cache=self.kv_destination(plan.slot_mapping))
        return self.model.logits(h[plan.sample_rows])

    def keep_tokens(self, tokens: torch.Tensor) -> None:
        """Keep a step's sampled tokens (long [S], on the device) for the next step's
        ``feed``: its decode rows read them there, before the host has seen them."""
        if self.kept.numel() < tokens.numel():
            self.kept = torch.zeros(max(tokens.numel(), 2 * self.kept.numel()), dtype=torch.long,
                                    device=self.device)
        self.kept[:tokens.numel()].copy_(tokens)

    def feed_tokens(self, plan: StepPlan) -> None:
        """Input ids from the kept tokens where ``plan.feed`` says so (no host sync, before
        the forward or the graph replay): one gather when every row is fed (a decode step
        in steady state), else a few small launches."""
        ids, fed = plan.input_ids, plan.feed
        if plan.feed_all:
            torch.index_select(self.kept, 0, fed, out=ids)
        else:
            ids.copy_(tokens_from_device(ids, fed, self.kept))

    @torch.no_grad()
    def run(self, items: list[tuple[Sequence, int]], copies=(), feed: dict[Sequence, int] | None = None
            ) -> tuple[torch.Tensor, list[Sequence], StepPlan]:
        """Plan and run one step: (logits of the sampled rows, their sequences, the plan).
        ``feed``: sequence -> index of its last token among the tokens last kept
        (:meth:`keep_tokens`), for sequences whose last token the host has not read yet."""
        self.copy_blocks(list(copies))
        plan = self.plan(items, feed)
        if plan.feed is not None:
            self.feed_tokens(plan)
        if plan.use_graph:
            return self.replay(plan), plan.sample_seqs, plan
        if plan.full_bucket:
            return self.full_graphs.replay(plan), plan.sample_seqs, plan
        if self.piecewise is not None and self.piecewise.fits(plan):
            return self.piecewise.run(plan), plan.sample_seqs, plan
        return self.forward(plan), plan.sample_seqs, plan

    # -- CUDA graphs --------------------------------------------------------------------------
    def warm_up(self, max_tokens: int) -> list[int]:
        """Run one prefill of each size a step can bring (1, 2, 4, ... tokens, up to
        ``max_tokens``) and steps mixing a decode with a prefill, so that Triton
        compiles and autotunes every kernel shape here, at start-up, and not inside the
        first requests. (On the H200, a fresh engine served its first two requests at 42
        tok/s and the third at 2460: each new prefill length met new autotuning keys.)
        The pages written are ones no sequence holds yet. Returns the prefill sizes."""
        bs = self.block_size
        limit = max(1, min(max_tokens, self.cfg.max_seq_len, (self.k_cache.shape[1] - 1) * bs))
        sizes = [1 << i for i in range(limit.bit_length()) if 1 << i < limit] + [limit]

        def prefill(n, computed=0):
            seq = Sequence(-1, "warm-up", [0] * n, n, SamplingParams(max_tokens=1), 0,
                           num_computed_tokens=computed, block_table=list(range(-(-n // bs))))
            return seq, n - computed

        with torch.no_grad():
            for n in sizes:
                self.forward(self.plan([prefill(n)]))
            if limit > 2:     # an odd row count too: rmsnorm_quant's tuner keys on whether rows
                self.forward(self.plan([prefill(limit - 1)]))   # fill its blocks (EVEN); served
                # steps of many rows take either (the static baseline autotuned three configs
                # while serving without this, H200 2026-12-04)
            if limit > 1:     # a decode row next to a prefill chunk: the eager decode path
                decode_row = prefill(min(limit, bs) + 1, computed=min(limit, bs))
                self.forward(self.plan([decode_row, prefill(limit - 1)]))
                # The append rows' block table starts after the decode rows' in one buffer: at
                # an address Triton sees as 16-byte aligned or not, with the decode rows ×
                # the step's table width. Both classes here, or the first request to meet the
                # other compiles the append kernel again (a second on the H200, 2026-12-01).
                # A chunk of 2 tokens after a history sets the width whatever the budget.
                width = -(-max(min(limit, bs) + 1, limit - 1) // bs)
                other = 2 if width % 4 == 0 else 4
                if limit > 2 and other < self.k_cache.shape[1] and other * bs <= self.cfg.max_seq_len:
                    self.forward(self.plan([decode_row, prefill(other * bs, computed=other * bs - 2)]))
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return sizes

    def capture_graphs(self) -> None:
        """One graph per batch-size bucket for decode-only steps (largest first, sharing
        one memory pool). Each bucket has its own static input buffer, laid out as a
        step's host buffer (:func:`graph_input_fields`), so a step's one copy fills it."""
        self.allocate_graph_inputs()
        pool = None
        for b in reversed(bucket_sizes(self.max_num_seqs)):
            views = self.graph_views[b]
            plan = StepPlan(views["ids"], views["pos"], views["slots"], b, views["table"], views["lens"], None,
                            self.no_indptr, self.no_table, self.no_lens, views["all"], [])
            # warmed up on the capture's stream: autotuning and lazy set-up stay outside the graph
            graph, out = capture(functools.partial(self.forward, plan), pool)
            pool = graph.pool()
            # the graph reads the plan's tensors (sample_rows, the empty append ones) at
            # every replay: keep them alive, or their memory is reused and read as indices
            self.graphs[b] = (graph, out, plan)

    def capture_piecewise(self, max_tokens: int, emulate: bool = False) -> bool:
        """Piecewise CUDA graphs for the steps no decode graph runs (prompt chunks, mixed
        batches, cascade decodes) of up to ``max_tokens`` rows (:mod:`.piecewise`).
        Call it after :meth:`warm_up` (kernels compile and autotune outside any graph).
        Captured where the decode graphs are (compiled mode on a GPU, Triton attention,
        no decode hook); ``emulate`` builds the same machinery without graphs, each
        segment called instead of replayed (tests on a CPU). Returns whether steps now
        take this path (not for a model whose blocks do not split at attention into
        ``pre_attention``/``post_attention``, e.g. the tensor-parallel one)."""
        splits = all(hasattr(b, "pre_attention") and hasattr(b, "post_attention") for b in self.model.blocks)
        if splits and (emulate or self.graphs_possible):
            self.piecewise = PiecewiseGraphs(self, max_tokens, cuda=not emulate)
        return self.piecewise is not None

    def capture_full(self, max_tokens: int, emulate: bool = False) -> bool:
        """Whole-step CUDA graphs for steps with prompt chunks (:mod:`.full_graphs`), of up
        to ``max_tokens`` rows (at most :data:`.full_graphs.MAX_TOKENS`). Call it after
        :meth:`warm_up`. Captured where the decode graphs are; ``emulate`` builds the same
        buffers and calls the forward at each replay (tests on a CPU). Returns whether
        such steps now take this path."""
        if max_tokens >= 1 and (emulate or self.graphs_possible):
            self.full_graphs = FullStepGraphs(self, min(max_tokens, FULL_MAX_TOKENS), cuda=not emulate)
        return self.full_graphs is not None

    def allocate_graph_inputs(self) -> None:
        """Each bucket's static input buffer (padded rows: scratch slot, length 0) and its
        typed views; ``bucket_of[n]``: the bucket of a decode step of n rows."""
        dev = self.device
        buckets = bucket_sizes(self.max_num_seqs)
        for b in buckets:
            layout = field_layout(graph_input_fields(b, self.max_blocks))
            buf = torch.zeros(layout[-1][2], dtype=torch.uint8, device=dev)
            v = tensor_fields(buf, layout)
            v["rows"][2].fill_(self.scratch_slot)
            self.graph_inputs[b] = buf
            self.graph_views[b] = dict(ids=v["rows"][0], pos=v["rows"][1], slots=v["rows"][2], feed=v["rows"][3],
                                       lens=v["lens"],
                                       table=v["table"], sample=v["sample"], all=torch.arange(b, device=dev))
        self.bucket_of = [0] + [next(b for b in buckets if b >= n) for n in range(1, self.max_num_seqs + 1)]

    def replay(self, plan: StepPlan) -> torch.Tensor:
        """Run a decode-only step's graph: its inputs are in place already (the plan's copy)."""
        graph, out, _ = self.graphs[plan.graph_bucket]
        graph.replay()
        return out[:plan.num_decode] if plan.sample_all else out[plan.sample_rows]
