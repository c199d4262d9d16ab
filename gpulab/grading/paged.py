"""Grading of notebook 05 (gpulab.paged): inputs, cases, specs, baselines, the no-sync check.

Specs (``gpulab.check(NAME, fn)``): ``paged_decode_attention`` (a launcher
``fn(q, k_cache, v_cache, block_table, seq_lens, o, lse)``), ``split_kv_reduce``,
``paged_decode_split`` (a forced number of partitions) and ``paged_decode_plan_run`` (a
class with ``plan``/``run`` whose run may not read device data on the host).
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import math

import torch

from .. import runtime
from ..attention_state import merge_states_reference
from ..harness.bench import cuda_graph_replay
from ..harness.checking import CheckFailure, Hypothesis, hypotheses_hint, rounding_tolerance
from ..harness.spec import Case, KernelSpec, bytes_of, randn
from ..paged import (PagedDecodeWrapper, fixed_splits, gather_kv, paged_decode_attention, paged_decode_into,
                     paged_decode_reference, paged_decode_split_into, split_reduce_into, split_reduce_reference,
                     to_flashinfer)

# FlashInfer is an optional peer (pip install gpulab[peers]): benchmarks add its rows when it
# is installed. Imported on first use, not here: it is heavy and compiles kernels on the fly.
FLASHINFER_INSTALLED = importlib.util.find_spec("flashinfer") is not None
PEER_NOTE = ("" if FLASHINFER_INSTALLED else
             "FlashInfer is not installed: its rows are skipped (pip install gpulab[peers] adds them)")


def flashinfer_module():
    """The flashinfer module, imported on first use (an optional dependency)."""
    return importlib.import_module("flashinfer")


# =========================================================================================
# The no-host-sync check: what a run() (or any hot path) must not do
# =========================================================================================
class HostSyncError(CheckFailure):
    """Code that must not wait for the GPU read device data on the host."""


_CONVERSIONS = ("item", "tolist", "numpy", "__int__", "__float__", "__bool__", "__index__", "__complex__")
_MISSING = object()


@contextlib.contextmanager
def no_host_sync(what: str = "run()"):
    """Fail (HostSyncError) when the code inside reads device data on the host.

    Everywhere: converting a tensor to a Python value (``.item()``, ``.tolist()``,
    ``int(t)``, ``bool(t)``, ``if t:``, using it as an index...) raises: on a GPU each is a
    copy to the host that waits for every kernel queued before it. On a GPU also
    ``torch.cuda.set_sync_debug_mode("error")``: any other synchronizing CUDA call
    (``nonzero()``, a blocking copy) raises."""
    def refuse(name):
        def method(self, *args, **kwargs):
            raise HostSyncError(
                f"{what} converted a tensor to a Python value (Tensor.{name}). On a GPU that copies "
                f"the value to the host and waits for every kernel queued before it (a host sync), "
                f"and it cannot be captured in a CUDA graph. Compute it once in plan() and keep the "
                f"result, or leave it on the device for the kernel to load.")
        return method
    originals = {name: torch.Tensor.__dict__.get(name, _MISSING) for name in _CONVERSIONS}
    for name in _CONVERSIONS:
        setattr(torch.Tensor, name, refuse(name))
    cuda = runtime.mode() == "compiled"
    previous = torch.cuda.get_sync_debug_mode() if cuda else None
    if cuda:
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    except RuntimeError as e:
        if cuda and "synchroniz" in str(e):
            raise HostSyncError(f"{what} made a synchronizing CUDA call ({str(e).splitlines()[0][:200]}): "
                                f"the host waited for the GPU. Move it to plan().") from e
        raise
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(previous)
        for name, original in originals.items():
            if original is _MISSING:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)


def plan_run_launcher(plan_run_cls):
    """The launcher convention ``fn(q, k_cache, v_cache, block_table, seq_lens, o, lse)`` for
    a class with ``plan(block_table, seq_lens, num_qo_heads, num_kv_heads, head_dim,
    page_size, num_pages, dtype)`` and ``run(q, k_cache, v_cache, out, lse)``, checked the way
    a serving engine uses it: plan while the sequences are shorter, run once (compile and
    autotune), grow the lengths in place, run again under :func:`no_host_sync`."""
    def launcher(q, k_cache, v_cache, block_table, seq_lens, o, lse):
        decode = plan_run_cls()
        real = seq_lens.clone()
        seq_lens.copy_(torch.div(real, 2, rounding_mode="floor"))
        decode.plan(block_table, seq_lens, q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1],
                    k_cache.shape[0], q.dtype)
        decode.run(q, k_cache, v_cache, torch.empty_like(o), torch.empty_like(lse))    # warm-up
        seq_lens.copy_(real)              # the sequences grew since plan(), in place
        with no_host_sync("run()"):
            decode.run(q, k_cache, v_cache, o, lse)
    return launcher


def adapt_plan_run(obj):
    """A class is checked through :func:`plan_run_launcher`; a launcher is used as it is."""
    return plan_run_launcher(obj) if isinstance(obj, type) else obj


def plan_run_hint(output, got, expected, inputs):
    """Was the answer computed for the lengths seq_lens held at plan time?"""
    stale = paged_decode_reference(**{**inputs, "seq_lens": torch.div(inputs["seq_lens"], 2,
                                                                       rounding_mode="floor")})[output]
    atol, rtol = rounding_tolerance(got.dtype, 1e-3, 1e-3)
    if got.shape == stale.shape and torch.allclose(got.double().cpu(), stale.double().cpu(), atol=atol,
                                                   rtol=rtol, equal_nan=True):
        return ("run() answered for the lengths seq_lens held when plan() ran, not for their values "
                "now: read the lengths on the device inside the kernel, and plan partitions from the "
                "block table's capacity (width × page_size), which the lengths never exceed.")
    return None


# =========================================================================================
# Diagnoses: the references recomputed under plausible mistakes
# =========================================================================================
def decode_variant(inp, *, head_map="group", lens=None, starts=None, page_shift=0, score_factor=1.0,
                   lse_factor=1.0):
    """paged_decode_reference with one mistake: query head h reading kv head h % Hkv
    ("interleaved") instead of h // group, other lengths (tokens ``starts[b]`` to ``lens[b]``),
    block-table entries shifted by ``page_shift``, scores times ``score_factor``, the LSE
    times ``lse_factor``."""
    q, kc, vc, bt = inp["q"], inp["k_cache"], inp["v_cache"], inp["block_table"]
    lens = inp["seq_lens"] if lens is None else lens
    B, hq, d = q.shape
    hkv = kc.shape[2]
    heads = torch.arange(hq) // (hq // hkv) if head_map == "group" else torch.arange(hq) % hkv
    # what a kernel indexing bt_ptr + b * width + j reads: past a row's end, the next row
    flat = bt.flatten()
    flat = torch.cat([flat[page_shift:], flat[:page_shift], flat[:1]])
    bt = torch.stack([flat[b * bt.shape[1]:(b + 1) * bt.shape[1] + 1] for b in range(B)])
    outs, lses = [], []
    for b in range(B):
        k, v = gather_kv(kc, vc, bt, int(lens[b]), b)
        if starts is not None:
            k, v = k[int(starts[b]):], v[int(starts[b]):]
        if k.shape[0] == 0:
            outs.append(torch.zeros((hq, d), dtype=torch.float64))
            lses.append(torch.full((hq,), -math.inf, dtype=torch.float64))
            continue
        # one matmul per kv head with the query heads that read it (copying the keys out to
        # every query head costs a gigabyte for a sequence of 20 000 tokens)
        qb, k, v = q[b].double().cpu(), k.double().cpu(), v.double().cpu()
        o, lse = torch.empty((hq, d), dtype=torch.float64), torch.empty(hq, dtype=torch.float64)
        for j in range(hkv):
            rows = (heads == j).nonzero().flatten()
            sc = qb[rows] @ k[:, j].T * (d ** -0.5 * score_factor)               # [heads, N]
            lse[rows] = torch.logsumexp(sc, dim=-1)
            o[rows] = torch.exp(sc - lse[rows, None]) @ v[:, j]
        outs.append(o)
        lses.append(lse * lse_factor)
    return {"o": torch.stack(outs), "lse": torch.stack(lses)}


def _lengths(inp, change):
    capacity = inp["block_table"].shape[1] * inp["k_cache"].shape[1]
    lens = inp["seq_lens"].long().cpu()
    return (change(lens)).clamp(0, capacity)


def _clamped_lengths(inp, output, got, tries=3):
    """Every sequence cut at one length c: tokens past a planned coverage dropped. Trying
    every c recomputes the whole batch once per token (hours for a sequence of 20 000), so c
    is read off the wrong output first: the longest sequence's heads that read kv head 0, cut
    at every c at once (cumulative sums over its tokens), against what the kernel wrote
    there; only the ``tries`` closest cuts are recomputed whole."""
    lens = inp["seq_lens"].long().cpu()
    q = inp["q"]
    if output not in ("o", "lse") or got.shape[:2] != q.shape[:2] or lens.numel() == 0:
        return
    b = int(lens.argmax())
    n = int(lens[b])
    if n < 2:
        return
    k, v = gather_kv(inp["k_cache"], inp["v_cache"], inp["block_table"], n, b)
    # the query heads that read kv head 0 (several: one head's bfloat16 rounding blurs the cut)
    far = torch.zeros(n - 1, dtype=torch.float64)
    for h in range(q.shape[1] // k.shape[1]):
        s = (k[:, 0].double() @ q[b, h].double()) * q.shape[-1] ** -0.5
        if output == "lse":
            cut = torch.logcumsumexp(s, 0)[:-1]                               # cut after 1 .. n-1 tokens
            far += (cut - got[b, h].double()).square()
        else:
            w = torch.exp(s - s.max())
            cut = (w[:, None] * v[:, 0].double()).cumsum(0)[:-1] / w.cumsum(0)[:-1, None]
            far += (cut - got[b, h].double()).square().sum(-1)
    for c in torch.nan_to_num(far, nan=math.inf).argsort()[:tries].tolist():
        yield decode_variant(inp, lens=lens.clamp(max=c + 1))


def _rounded_lengths(inp):
    """Every length rounded up to a multiple of m (a tile or partition past seq_len read)."""
    for m in (2, 4, 8, 16, 32, 64, 128):
        yield decode_variant(inp, lens=_lengths(inp, lambda n: -(-n // m) * m))


DECODE_HYPOTHESES = (
    Hypothesis("query head h read kv head h % num_kv_heads: with grouped-query attention the query heads "
               "sharing a kv head are consecutive, head h reads kv head h // (num_qo_heads / num_kv_heads).",
               lambda inp: decode_variant(inp, head_map="interleaved")),
    Hypothesis("the pages are off by one: token t lies in page block_table[b, t // page_size], slot "
               "t % page_size (no +1 on the block-table index).", lambda inp: decode_variant(inp, page_shift=1)),
    Hypothesis("the scores are scaled by ln 2: exp2 needs the scale multiplied by log2(e) (2^(s · log2 e) = e^s); "
               "the LSE then comes back to natural log with × ln 2.",
               lambda inp: decode_variant(inp, score_factor=math.log(2.0)), outputs=("o",)),
    Hypothesis("the LSE is in base 2 (m + log2(l) with scores scaled by log2 e): gpulab's LSE is the natural "
               "log, multiply by ln 2.", lambda inp: decode_variant(inp, lse_factor=1 / math.log(2.0)),
               outputs=("lse",)),
    Hypothesis("each sequence attends one token too many (t ≤ seq_len): the mask is t < seq_len.",
               lambda inp: decode_variant(inp, lens=_lengths(inp, lambda n: n + 1))),
    Hypothesis("each sequence leaves out its last token: the keys are t = 0 .. seq_len - 1 (t < seq_len).",
               lambda inp: decode_variant(inp, lens=_lengths(inp, lambda n: n - 1))),
    Hypothesis("tokens past seq_len are attended: the last tile (or partition) runs to its end; mask every "
               "token with t < seq_len (and end partitions at min(seq_len, start + part_len)).",
               _rounded_lengths),
    Hypothesis("every sequence is cut at one length: the tokens past a fixed coverage are never visited; the "
               "partitions must cover the block table's capacity (width × page_size), whatever the lengths.",
               _clamped_lengths, sees_output=True),
)
DECODE_HINT = hypotheses_hint(*DECODE_HYPOTHESES)


def reduce_variant(o_part, lse_part, *, base2=False, average=False, add_max=True, keep=None, lse_max=False):
    """split_reduce_reference with one mistake (see SPLIT_REDUCE_HINT)."""
    o_part, lse_part = o_part.double().cpu(), lse_part.double().cpu()
    if keep is not None:
        o_part, lse_part = o_part[..., :keep, :], lse_part[..., :keep]
    ref = merge_states_reference(o_part, lse_part)
    if average:
        return {"o": o_part.mean(-2)}
    if lse_max:
        return {"lse": lse_part.max(-1).values}
    if base2:
        m = lse_part.max(-1, keepdim=True).values
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        w = torch.exp2(lse_part - m)
        total = w.sum(-1)
        has = total > 0
        o = (w[..., None] * o_part).sum(-2) / torch.where(has, total, 1.0)[..., None]
        return {"o": o, "lse": torch.where(has, m[..., 0] + torch.log2(torch.where(has, total, 1.0)), -math.inf)}
    if not add_max:
        m = lse_part.max(-1).values
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        return {"lse": ref["lse"] - m}
    return ref


def _first_splits(inp):
    s = inp["o_part"].shape[-2]
    for keep in (1, 2, 4, 8, 16, 32, 64):
        if keep < s:
            yield reduce_variant(inp["o_part"], inp["lse_part"], keep=keep)


def _no_max_subtracted(inp):
    """The merge with weights e^(lse_p) (no max subtracted), in float32 as a kernel runs it."""
    lse, o_part = inp["lse_part"].float(), inp["o_part"].float()
    w = torch.exp(lse)
    total = w.sum(-1)
    return {"o": ((w[..., None] * o_part).sum(-2) / torch.where(total > 0, total, 1.0)[..., None]).double()}


SPLIT_REDUCE_HINT = hypotheses_hint(
    Hypothesis("the weights are e^(lse_p) without subtracting M = the largest lse_p: in float32 they "
               "overflow to inf, or underflow towards 0 and lose digits (an arithmetic error, not a "
               "wrong formula). Use w_p = e^(lse_p - M).", _no_max_subtracted, outputs=("o",)),
    Hypothesis("o is the plain average of the partial outputs: each partition counts with its weight "
               "w_p = e^(lse_p - M) / Σ w (M = the largest lse_p), its share of the softmax sum.",
               lambda inp: reduce_variant(inp["o_part"], inp["lse_part"], average=True), outputs=("o",)),
    Hypothesis("the merge works in base 2 (exp2/log2 of a natural-log LSE): gpulab's LSE is the natural log, "
               "w_p = exp(lse_p - M) and lse = M + ln Σ w.",
               lambda inp: reduce_variant(inp["o_part"], inp["lse_part"], base2=True)),
    Hypothesis("lse is ln Σ w without the max: the weights were taken relative to M = max lse_p, so "
               "lse = M + ln Σ w.",
               lambda inp: reduce_variant(inp["o_part"], inp["lse_part"], add_max=False), outputs=("lse",)),
    Hypothesis("lse is the largest partial lse: the merged LSE is the log-sum-exp of the partial ones, "
               "M + ln Σ exp(lse_p - M).",
               lambda inp: reduce_variant(inp["o_part"], inp["lse_part"], lse_max=True), outputs=("lse",)),
    Hypothesis("only the first partitions are merged: the block over partitions is narrower than their "
               "number (BLOCK_S = triton.next_power_of_2(num_splits), masked with s < num_splits).",
               _first_splits),
)


def _split_variants(inp):
    """The split decode when the partitions do not cover the capacity (part_len rounded down)."""
    capacity = inp["block_table"].shape[1] * inp["k_cache"].shape[1]
    splits = inp.get("num_splits", 1)
    covered = splits * (capacity // splits)
    yield decode_variant(inp, lens=inp["seq_lens"].long().cpu().clamp(max=covered))


def split_partials(inp):
    """The partial states (o [B, H, S, D], lse [B, H, S]) of the aligned partitions
    (paged.fixed_splits) of a split decode."""
    capacity = inp["block_table"].shape[1] * inp["k_cache"].shape[1]
    splits, part = fixed_splits(capacity, inp.get("num_splits", 1))
    lens = inp["seq_lens"].long().cpu()
    states = [decode_variant(inp, starts=torch.full_like(lens, p * part).clamp(max=lens),
                             lens=lens.clamp(max=(p + 1) * part)) for p in range(splits)]
    return torch.stack([st["o"] for st in states], 2), torch.stack([st["lse"] for st in states], 2)


def _split_partials_variant(kind):
    def answer(inp):
        o, lse = split_partials(inp)
        if kind == "first":
            return {"o": o[:, :, 0], "lse": lse[:, :, 0]}
        if kind == "mean":
            return {"o": o.mean(2)}
        return {"lse": lse.max(2).values}
    return answer


SPLIT_DECODE_HINT = hypotheses_hint(
    Hypothesis("lse is the largest partial LSE: the merged LSE is the log-sum-exp of the partial ones, "
               "M + ln Σ exp(lse_p - M).", _split_partials_variant("max"), outputs=("lse",)),
    Hypothesis("the result is the first partition's state alone: the partial states (o_p, lse_p) of all "
               "partitions must be merged (the reduce).", _split_partials_variant("first")),
    Hypothesis("o is the plain mean of the partial outputs: each partition counts with its weight "
               "w_p = e^(lse_p - M) / Σ w, its share of the softmax sum (empty partitions weigh 0).",
               _split_partials_variant("mean"), outputs=("o",)),
    Hypothesis("tokens past num_splits · (capacity // num_splits) are missing: part_len rounded down, so the "
               "partitions stop short of the capacity when it does not divide; use part_len = "
               "cdiv(capacity, num_splits) (paged.fixed_splits rounds it to an aligned length).",
               _split_variants),
    *DECODE_HYPOTHESES,
)


# =========================================================================================
# Benchmark rows beyond the baselines: as called, replayed in a CUDA graph, FlashInfer
# =========================================================================================
def paged_decode_planned(inp):
    """plan() for a benchmark input dict; returns run() with its arguments bound."""
    q, kc = inp["q"], inp["k_cache"]
    decode = PagedDecodeWrapper()
    decode.plan(inp["block_table"], inp["seq_lens"], q.shape[1], kc.shape[2], q.shape[2], kc.shape[1],
                kc.shape[0], q.dtype)
    return lambda: decode.run(q, kc, inp["v_cache"])


def flashinfer_decode_baseline(use_tensor_cores: bool = True):
    """FlashInfer's BatchDecodeWithPagedKVCacheWrapper on the same cache (its NHD layout is
    gpulab's [pages, page_size, Hkv, D]): plan() once per input dict, run() timed."""
    state = {}

    def run(inp):
        if state.get("key") != id(inp):
            fi = flashinfer_module()
            q, kc = inp["q"], inp["k_cache"]
            indptr, indices, last = to_flashinfer(inp["block_table"], inp["seq_lens"], kc.shape[1])
            workspace = torch.empty(128 << 20, dtype=torch.uint8, device=q.device)
            wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=use_tensor_cores)
            wrapper.plan(indptr, indices, last, q.shape[1], kc.shape[2], q.shape[2], kc.shape[1],
                         q_data_type=q.dtype, kv_data_type=kc.dtype)
            state.update(key=id(inp), wrapper=wrapper, workspace=workspace)
        return state["wrapper"].run(inp["q"], (inp["k_cache"], inp["v_cache"]))
    return run


def _decode_as_called(inp):
    return paged_decode_attention(inp["q"], inp["k_cache"], inp["v_cache"], inp["block_table"], inp["seq_lens"])


def _decode_validated(inp):
    return paged_decode_attention(inp["q"], inp["k_cache"], inp["v_cache"], inp["block_table"], inp["seq_lens"],
                                  validate=True)


GRAPH_ROW = "gpulab run(), CUDA graph"          # names fit the 26 columns of bench tables
VALIDATED_ROW = "gpulab, validate=True"
FLASHINFER_DECODE_ROW = "FlashInfer decode run()"   # use_tensor_cores=True, its faster path
SDPA_ROW = "SDPA, contiguous KV"


def make_page_pool(lens: list[int], p: dict, dtype, device, gen):
    """K and V pages for sequences of ``lens`` tokens (``p``: page, hkv, d; optional spare
    pages and block-table padding), each sequence's pages in shuffled order, and its
    block-table row; entries past a sequence's pages hold other sequences' pages, so
    reading them is a bug a check sees."""
    ps, hkv, d = p["page"], p["hkv"], p["d"]
    n_pages = [-(-n // ps) for n in lens]
    total = sum(n_pages) + p.get("spare", 3)
    width = max(n_pages + [1]) + p.get("pad", 1)
    perm = torch.randperm(total, generator=gen, device=device).to(torch.int32)
    bt = torch.randint(0, total, (len(lens), width), generator=gen, device=device, dtype=torch.int32)
    pos = 0
    for b, n in enumerate(n_pages):
        bt[b, :n] = perm[pos:pos + n]
        pos += n
    k = randn((total, ps, hkv, d), dtype, device, gen)
    v = randn((total, ps, hkv, d), dtype, device, gen, offset=0.3)
    return k, v, bt


def make_paged_inputs(p, dtype, device, gen):
    """A paged cache with the given sequence lengths, its pages in shuffled order, spare
    pages full of other data, and block-table padding past each sequence's pages."""
    lens = list(p["lens"])
    k, v, bt = make_page_pool(lens, p, dtype, device, gen)
    q = randn((len(lens), p["hq"], p["d"]), dtype, device, gen, scale=1.5)
    inputs = {"q": q, "k_cache": k, "v_cache": v, "block_table": bt,
              "seq_lens": torch.tensor(lens, dtype=torch.int32, device=device)}
    if "splits" in p:
        inputs["num_splits"] = p["splits"]
    return inputs


def sdpa_contiguous_baseline():
    """SDPA on the same KV stored contiguously [B, Hkv, L, D] (built once per input dict,
    outside the timing): what a paged kernel has to match."""
    cache = {}

    def run(inp):
        key = id(inp)
        if key not in cache:
            cache.clear()
            B = inp["q"].shape[0]
            L = int(inp["seq_lens"].max())
            ks, vs = [], []
            for b in range(B):
                k, v = gather_kv(inp["k_cache"], inp["v_cache"], inp["block_table"], L, b)
                ks.append(k.transpose(0, 1))
                vs.append(v.transpose(0, 1))
            cache[key] = (torch.stack(ks).contiguous(), torch.stack(vs).contiguous())
        kc, vc = cache[key]
        return torch.nn.functional.scaled_dot_product_attention(
            inp["q"][:, :, None, :], kc, vc, enable_gqa=True)
    return run


def decode_bytes(p, dtype):
    B, L = len(p["lens"]), sum(p["lens"])
    return (2 * L * p["hkv"] * p["d"] + 2 * B * p["hq"] * p["d"]) * bytes_of(dtype) + 4 * B * p["hq"]


def decode_flops(p, dtype):
    return 4 * sum(p["lens"]) * p["hq"] * p["d"]


def decode_outputs(inp, dtype):
    B, hq, d = inp["q"].shape
    return {"o": ((B, hq, d), dtype), "lse": ((B, hq), torch.float32)}


DECODE_AXES = {"o": ("sequence", "head", "dim"), "lse": ("sequence", "head")}

# float32: one program that sums a 16K-token context in 512 sequential steps (the
# notebooks' kernels do not split) is off by up to ~4e-5 relative: rounding, not a bug.
DECODE_TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 5e-3), torch.bfloat16: (1.5e-2, 2e-2)}
LSE_TOLERANCES = {torch.float32: (2e-5, 1e-5), torch.float16: (2e-3, 1e-3), torch.bfloat16: (1e-2, 5e-3)}

_CPU_DECODE = [
    Case("one token", dict(lens=[1], page=16, hq=4, hkv=2, d=16)),
    Case("ragged: 1, page, page+1, long", dict(lens=[1, 16, 17, 75], page=16, hq=4, hkv=2, d=16)),
    Case("GQA 6/2, D=24, page 5", dict(lens=[13, 5, 31], page=5, hq=6, hkv=2, d=24)),
    Case("MHA, empty sequence", dict(lens=[0, 9, 40], page=8, hq=3, hkv=3, d=32)),
    # a sequence filling its block table exactly (no padding entry after it)
    Case("a full block table, capacity 35", dict(lens=[35, 3], page=7, hq=2, hkv=1, d=16, pad=0)),
]
_GPU_DECODE = [
    Case("one token", dict(lens=[1], page=16, hq=32, hkv=8, d=128)),
    Case("ragged", dict(lens=[1, 16, 17, 1000, 4099], page=16, hq=32, hkv=8, d=128)),
    Case("GQA 6/2, D=24, page 5", dict(lens=[13, 5, 310], page=5, hq=6, hkv=2, d=24)),
    Case("MHA, empty sequence", dict(lens=[0, 9, 4000], page=8, hq=12, hkv=12, d=64)),
    Case("few long", dict(lens=[20000, 777], page=16, hq=32, hkv=8, d=128)),
    Case("a full block table, capacity 70", dict(lens=[70, 3], page=7, hq=8, hkv=2, d=64, pad=0)),
]

PAGED_DECODE_ATTENTION = KernelSpec(
    name="paged_decode_attention",
    summary="decode attention through a block table (GQA, split-KV planned from the batch)",
    args=("q", "k_cache", "v_cache", "block_table", "seq_lens", "o", "lse"),
    make_inputs=make_paged_inputs,
    reference=paged_decode_reference,
    outputs=decode_outputs,
    implementation=paged_decode_into,
    cases={
        "cpu": _CPU_DECODE,
        "gpu": _GPU_DECODE,
        "bench": [Case("B64 L4096", dict(lens=[4096] * 64, page=16, hq=32, hkv=8, d=128, spare=0, pad=0)),
                  Case("B4 L32768", dict(lens=[32768] * 4, page=16, hq=32, hkv=8, d=128, spare=0, pad=0)),
                  Case("B128 L1024", dict(lens=[1024] * 128, page=16, hq=32, hkv=8, d=128, spare=0, pad=0))],
    },
    dtypes={"cpu": [torch.float32, torch.float16], "gpu": [torch.float32, torch.bfloat16, torch.float16]},
    tolerances=DECODE_TOLERANCES,
    output_tolerances={"lse": LSE_TOLERANCES},
    bytes_moved=decode_bytes,
    flops=decode_flops,
    # Benchmarks lead with the public function as a user calls it; then run() of a plan
    # replayed in a CUDA graph, the validating call, SDPA and, when installed, FlashInfer.
    bench_impl=_decode_as_called,
    baselines={GRAPH_ROW: cuda_graph_replay(paged_decode_planned), VALIDATED_ROW: _decode_validated,
               SDPA_ROW: sdpa_contiguous_baseline(),
               **({FLASHINFER_DECODE_ROW: flashinfer_decode_baseline()} if FLASHINFER_INSTALLED else {})},
    compile_baselines=(SDPA_ROW,),
    read_inputs=("q", "k_cache", "v_cache"),
    hint=DECODE_HINT,
    axes=DECODE_AXES,
    strided=("q", "o", "lse"),     # the launcher passes their strides
    bench_dtypes=[torch.bfloat16],
    notes="gpulab = paged_decode_attention as called; SDPA on the same KV copied into a contiguous "
          "[B, Hkv, L, D] tensor" + (f"; {PEER_NOTE}" if PEER_NOTE else ""),
)


def _split_cases(cases, splits):
    return [Case(c.label, {**c.params, "splits": s}) for c, s in zip(cases, splits)]


PAGED_DECODE_SPLIT = KernelSpec(
    name="paged_decode_split",
    expected_fp_warnings=("divide",),   # a learner's log(0) in tl.where (interpreter)
    summary="paged decode with a forced number of KV partitions and a reduce",
    args=("q", "k_cache", "v_cache", "block_table", "seq_lens", "num_splits", "o", "lse"),
    make_inputs=make_paged_inputs,
    reference=paged_decode_reference,
    outputs=decode_outputs,
    implementation=paged_decode_split_into,
    cases={
        # the last: splits that do not divide a block table the longest sequence fills, by
        # enough that part_len rounded down drops 8 of its 35 tokens (with 3 splits, 2
        # tokens: about one seed in 150 gave them too little softmax weight to see)
        "cpu": _split_cases(_CPU_DECODE, [1, 3, 2, 4, 9]),
        "gpu": _split_cases(_GPU_DECODE, [1, 7, 2, 5, 16, 8]),
    },
    # float16 inputs are checked by paged_decode_attention; the partitions and the reduce
    # work in float32 whatever the input dtype, so the interpreter runs float32 only here.
    dtypes={"cpu": [torch.float32], "gpu": [torch.float32, torch.bfloat16]},
    tolerances=DECODE_TOLERANCES,
    output_tolerances={"lse": LSE_TOLERANCES},
    read_inputs=("q", "k_cache", "v_cache"),
    hint=SPLIT_DECODE_HINT,
    axes=DECODE_AXES,
)


def make_partials(p, dtype, device, gen):
    """Partial states of a split-KV decode: normalised outputs and LSEs with a wide
    spread (an exp without the max subtracted overflows) and empty states (-inf)."""
    B, h, s, d = p["b"], p["h"], p["s"], p["d"]
    o = randn((B, h, s, d), torch.float32, device, gen)
    lse = randn((B, h, s), torch.float32, device, gen, scale=p.get("spread", 30.0), offset=40.0)
    empty = torch.rand((B, h, s), generator=gen, device=device) < p.get("empty", 0.25)
    if p.get("all_empty_row", False):
        empty[0, 0, :] = True
    lse = torch.where(empty, -math.inf, lse)
    o = torch.where(empty[..., None], 0.0, o)
    return {"o_part": o.contiguous(), "lse_part": lse.contiguous()}


def _tied_partials(inputs, params, dtype, gen):
    """partitions 0 and 1 with equal LSEs (each weighs half: lse = M + ln 2)"""
    lse = inputs["lse_part"].clone()
    if lse.shape[-1] >= 2:
        lse[..., 1] = lse[..., 0]
    o = torch.where(torch.isinf(lse)[..., None], 0.0, inputs["o_part"])
    return {"o_part": o.contiguous(), "lse_part": lse.contiguous()}


SPLIT_KV_REDUCE = KernelSpec(
    name="split_kv_reduce",
    expected_fp_warnings=("divide",),   # a learner's log(0) in tl.where (interpreter)
    summary="merge split-KV partial states (o_p, lse_p) into (o, lse)",
    args=("o_part", "lse_part", "o", "lse"),
    make_inputs=make_partials,
    reference=split_reduce_reference,
    outputs=lambda inp, dtype: {"o": (inp["o_part"].shape[:2] + inp["o_part"].shape[3:], torch.float32),
                                "lse": (inp["lse_part"].shape[:2], torch.float32)},
    implementation=split_reduce_into,
    cases={
        "cpu": [Case("one split", dict(b=1, h=1, s=1, d=16, empty=0.0)),
                Case("ragged, empty states", dict(b=3, h=5, s=7, d=24, all_empty_row=True)),
                Case("many splits", dict(b=2, h=4, s=33, d=128, spread=60.0))],
        "gpu": [Case("one split", dict(b=1, h=1, s=1, d=16, empty=0.0)),
                Case("ragged, empty states", dict(b=33, h=32, s=7, d=24, all_empty_row=True)),
                Case("many splits", dict(b=4, h=32, s=64, d=128, spread=60.0))],
    },
    dtypes={"cpu": [torch.float32], "gpu": [torch.float32]},
    tolerances={torch.float32: (1e-5, 1e-5)},
    read_inputs=("o_part", "lse_part"),
    hint=SPLIT_REDUCE_HINT,
    edge_data=_tied_partials,
    axes={"o": ("batch", "head", "dim"), "lse": ("batch", "head")},
)


_PLAN_RUN_CPU = [Case("ragged, an empty sequence", dict(lens=[0, 1, 17, 40], page=8, hq=4, hkv=2, d=16))]
PAGED_DECODE_PLAN_RUN = KernelSpec(
    name="paged_decode_plan_run",
    expected_fp_warnings=("divide",),   # a learner's log(0) in tl.where (interpreter)
    summary="paged decode split into plan() and a run() without host syncs, lengths growing after plan",
    args=("q", "k_cache", "v_cache", "block_table", "seq_lens", "o", "lse"),
    make_inputs=make_paged_inputs,
    reference=paged_decode_reference,
    outputs=decode_outputs,
    implementation=plan_run_launcher(PagedDecodeWrapper),
    adapt=adapt_plan_run,
    hint=lambda *a: plan_run_hint(*a) or DECODE_HINT(*a),
    axes=DECODE_AXES,
    cases={"cpu": _PLAN_RUN_CPU, "gpu": [_GPU_DECODE[1], _GPU_DECODE[3], _GPU_DECODE[4]]},
    dtypes={"cpu": [torch.float32], "gpu": [torch.bfloat16]},
    tolerances=DECODE_TOLERANCES,
    output_tolerances={"lse": LSE_TOLERANCES},
    read_inputs=("q", "k_cache", "v_cache"),
)
