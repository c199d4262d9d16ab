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
captured for the smallest bucket ≥ B (1, 2, 4, ..., max_num_seqs), its inputs copied
into static buffers and the spare rows padded (they write to a scratch page and attend
to nothing). Replaying removes the CPU cost of launching each kernel of each layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .. import runtime
from ..paged import PagedDecodeWrapper
from .batch_attention import append_attention, append_attention_reference, decode_attention, shared_prefix_pages
from .model import TernaryTransformer
from .sequence import Sequence


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


def bucket_sizes(max_num_seqs: int) -> list[int]:
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    return sizes + [max_num_seqs]


class ModelRunner:
    def __init__(self, model: TernaryTransformer, num_blocks: int, block_size: int,
                 max_num_seqs: int = 64, linear: str = "auto", attention: str = "auto",
                 cuda_graphs: bool = True, cascade: bool = False, decode_hook=None):
        for name, v in (("linear", linear), ("attention", attention)):
            if v not in ("auto", "triton", "torch"):
                raise ValueError(f"{name} must be 'auto', 'triton' or 'torch', got {v!r}")
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
        self.max_num_seqs = max_num_seqs
        # eager decode steps: planned (and checked) once per step, run by every layer
        self.decode_wrapper = PagedDecodeWrapper()
        # graphs replay gpulab's decode kernels; a hook or the PyTorch reference may sync the host
        if (cuda_graphs and runtime.mode() == "compiled" and self.device.type == "cuda"
                and self.attention == "triton" and decode_hook is None):
            self.capture_graphs()

    # -- plan -------------------------------------------------------------------------------
    def plan(self, items: list[tuple[Sequence, int]]) -> StepPlan:
        """Flatten one step's (sequence, new tokens) into tensors, decodes first."""
        bs = self.block_size
        order = [it for it in items if it[1] == 1] + [it for it in items if it[1] > 1]
        ids, pos, slots, tables, lens, indptr, rows, sample_seqs = [], [], [], [], [], [0], [], []
        num_decode = sum(1 for _, n in items if n == 1)
        for seq, n in order:
            start = seq.num_computed_tokens
            bt = seq.block_table
            ids += seq.token_ids[start:start + n]
            pos += range(start, start + n)
            slots += [bt[p // bs] * bs + p % bs for p in range(start, start + n)]
            tables.append(bt)
            lens.append(start + n)
            if n > 1:
                indptr.append(indptr[-1] + n)
            if start + n == seq.num_tokens:
                rows.append(len(ids) - 1)
                sample_seqs.append(seq)
        prefix = None
        dec_tables, dec_lens = tables[:num_decode], lens[:num_decode]
        if self.cascade and self.attention == "triton" and num_decode > 1:
            k = shared_prefix_pages(dec_tables, dec_lens, bs)
            if k:
                prefix = (self._ints(dec_tables[0][:k]), k * bs)
                dec_tables = [t[k:] for t in dec_tables]
                dec_lens = [n - k * bs for n in dec_lens]
        # one table width for the step: its longest table, not the context's (a table as
        # wide as max_seq_len would cost the host more than the decode step's kernels)
        w = max((len(t) for t in tables), default=1) or 1
        long = lambda v: torch.tensor(v, dtype=torch.long, device=self.device)  # noqa: E731
        plan = StepPlan(
            input_ids=long(ids), positions=long(pos), slot_mapping=long(slots), num_decode=num_decode,
            decode_table=self._table(dec_tables, w), decode_lens=self._ints(dec_lens),
            prefix=prefix, append_indptr=self._ints(indptr), append_table=self._table(tables[num_decode:], w),
            append_lens=self._ints(lens[num_decode:]), sample_rows=long(rows), sample_seqs=sample_seqs,
            use_graph=(num_decode == len(items) and prefix is None and 0 < num_decode <= self.max_num_seqs
                       and bool(self.graphs)))
        if num_decode and prefix is None and not plan.use_graph and self.attention == "triton" \
                and self.decode_hook is None:
            self.plan_decode(plan)
        return plan

    def plan_decode(self, plan: StepPlan) -> None:
        """FlashInfer's plan/run for an eager step's decode rows: the layout is checked
        and the split-KV partitioning chosen here, once, and each layer's run() only
        launches kernels (no host sync per layer)."""
        cfg = self.cfg
        self.decode_wrapper.plan(plan.decode_table, plan.decode_lens, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                                 self.block_size, self.k_cache.shape[1], self.dtype,
                                 # the interpreter pays per program: one partition per sequence
                                 num_splits=1 if runtime.interpreting() else None)
        plan.decode_planned = True

    def _ints(self, v):
        return torch.tensor(v, dtype=torch.int32, device=self.device)

    def _table(self, rows: list[list[int]], width: int) -> torch.Tensor:
        """int32 [len(rows), width] block tables, zero-padded (entries past a sequence's
        pages are never read), built in NumPy and copied to the device once."""
        table = np.zeros((len(rows), width), dtype=np.int32)
        for i, row in enumerate(rows):
            table[i, :len(row)] = row
        return torch.from_numpy(table).to(self.device)

    # -- run --------------------------------------------------------------------------------
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate pages (all layers, K and V) before anything writes."""
        if copies:
            src = torch.tensor([s for s, _ in copies], device=self.device)
            dst = torch.tensor([d for _, d in copies], device=self.device)
            self.k_cache[:, dst] = self.k_cache[:, src]
            self.v_cache[:, dst] = self.v_cache[:, src]

    def attend(self, plan: StepPlan, layer: int, q, k, v):
        """Write this step's K, V into the paged cache, then attention for every row."""
        kc, vc = self.k_cache[layer], self.v_cache[layer]
        kc.view(-1, *kc.shape[2:]).index_copy_(0, plan.slot_mapping, k)
        vc.view(-1, *vc.shape[2:]).index_copy_(0, plan.slot_mapping, v)
        nd = plan.num_decode
        if self.attention == "torch" and self.decode_hook is None:     # PyTorch reference only
            indptr = torch.arange(nd + 1, dtype=torch.int32, device=q.device)
            if nd == q.shape[0]:
                return append_attention_reference(q, kc, vc, indptr, plan.decode_table, plan.decode_lens)
            indptr = torch.cat([indptr, plan.append_indptr[1:] + nd])
            return append_attention_reference(q, kc, vc, indptr, torch.cat([plan.decode_table, plan.append_table]),
                                              torch.cat([plan.decode_lens, plan.append_lens]))
        if plan.decode_planned:
            dec = self.decode_wrapper.run(q[:nd], kc, vc)     # the plan's buffer, consumed before the next layer
        else:
            dec = decode_attention(q[:nd], kc, vc, plan.decode_table, plan.decode_lens,
                                   hook=self.decode_hook, prefix=plan.prefix) if nd else None
        if nd == q.shape[0]:
            return dec
        app = append_attention(q[nd:], kc, vc, plan.append_indptr, plan.append_table, plan.append_lens)
        return app if dec is None else torch.cat([dec, app])

    def forward(self, plan: StepPlan) -> torch.Tensor:
        """Logits [S, vocab] (float32) of the plan's sample rows."""
        h = self.model.hidden_states(plan.input_ids, plan.positions,
                                     lambda layer, q, k, v: self.attend(plan, layer, q, k, v),
                                     reference=self.linear == "torch")
        return self.model.logits(h[plan.sample_rows])

    @torch.no_grad()
    def run(self, items: list[tuple[Sequence, int]], copies=()) -> tuple[torch.Tensor, list[Sequence], StepPlan]:
        """Plan and run one step: (logits of the sampled rows, their sequences, the plan)."""
        self.copy_blocks(list(copies))
        plan = self.plan(items)
        if plan.use_graph:
            return self.replay(plan), plan.sample_seqs, plan
        return self.forward(plan), plan.sample_seqs, plan

    # -- CUDA graphs --------------------------------------------------------------------------
    def capture_graphs(self) -> None:
        """One graph per batch-size bucket for decode-only steps (largest first, sharing
        one memory pool)."""
        b_max = self.max_num_seqs
        dev = self.device
        self.buf = dict(ids=torch.zeros(b_max, dtype=torch.long, device=dev),
                        pos=torch.zeros(b_max, dtype=torch.long, device=dev),
                        slots=torch.full((b_max,), self.scratch_slot, dtype=torch.long, device=dev),
                        table=torch.zeros((b_max, self.max_blocks), dtype=torch.int32, device=dev),
                        lens=torch.zeros(b_max, dtype=torch.int32, device=dev))
        pool = None
        empty = torch.zeros(0, dtype=torch.int32, device=dev)
        for b in reversed(bucket_sizes(b_max)):
            plan = StepPlan(self.buf["ids"][:b], self.buf["pos"][:b], self.buf["slots"][:b], b,
                            self.buf["table"][:b], self.buf["lens"][:b], None, torch.zeros(1, dtype=torch.int32, device=dev),
                            empty.reshape(0, self.max_blocks), empty, torch.arange(b, device=dev), [])
            with torch.no_grad():
                for _ in range(2):            # warm-up: autotuning and lazy init happen outside the graph
                    self.forward(plan)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.forward(plan)
            pool = graph.pool()
            # the graph reads the plan's tensors (sample_rows, the empty append ones) at
            # every replay: keep them alive, or their memory is reused and read as indices
            self.graphs[b] = (graph, out, plan)

    def replay(self, plan: StepPlan) -> torch.Tensor:
        n = plan.num_decode
        b = next(s for s in sorted(self.graphs) if s >= n)
        buf = self.buf
        buf["ids"][:n] = plan.input_ids
        buf["pos"][:n] = plan.positions
        buf["slots"][:n] = plan.slot_mapping
        buf["slots"][n:b] = self.scratch_slot
        buf["table"][:n, :plan.decode_table.shape[1]] = plan.decode_table
        buf["lens"][:n] = plan.decode_lens
        buf["lens"][n:b] = 0
        graph, out, _ = self.graphs[b]
        graph.replay()
        return out[plan.sample_rows]
