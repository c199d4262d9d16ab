r"""Tensor-parallel ternary BitLinear layers whose TP=n output is bit-identical to TP=1.

A BitLinear computes y = (x_q · W_tᵀ) / (s_x · s_w): an *integer* matmul (int8
activations × ternary weights, summed exactly in int32) and one scale per output.
Split it over n GPUs the Megatron way:

* **column-parallel** (split W's rows, the output features): rank r computes outputs
  [r·N/n, (r+1)·N/n) from the whole input. Nothing to reduce; each output element is
  computed exactly as on one GPU. A layer that stacks several matrices ([gate; up] in
  the GLU, [q; k; v] in attention) is split *per part* (``parts``), so rank r holds the
  matching slice of each.
* **row-parallel** (split W's columns, the input features): rank r computes the
  partial sums over its K/n inputs, and an all-reduce adds the n partial sums.

Where the all-reduce sits decides exactness. The partial sums are integers: summing
them in int32 gives exactly the one-GPU integer, and scaling it once gives exactly the
one-GPU output (:func:`row_parallel_matmul`). Scaling first and all-reducing floats
(:func:`row_parallel_matmul_float`, what a plain float layer does) rounds each partial
result and their sum: the output then differs from TP=1 by a few ulps in float32 and
visibly in bf16.

The GLU MLP, down(SiLU(gate) ⊙ up):

    x (replicated) -> gate_up column-parallel -> all-gather -> SiLU(gate) ⊙ up
                   -> down row-parallel: partial int32 sums -> all-reduce (int32) -> scale

BitLinear normalises its own input (RMSNorm, then int8 absmax per row): the row-parallel
layer needs the statistics of the *whole* row. Gathering the column-parallel outputs
(M × 2I/n values per rank, a few KB per token) lets every rank quantize the full row
with the same kernel as TP=1, so the int8 values and the scale are the same bits. Sharing
only the row's sum of squares would be smaller, but a float sum split over ranks rounds
differently from the one-GPU sum and breaks bit-identity. Per layer: one all-gather of
activations and one all-reduce of int32 partial sums.

The final scale runs in a Triton kernel with the same expression as gpulab.bitlinear's
matmul epilogue, ``acc.to(float32) / (s_x · s_w)``: Triton divides with ``div.full.f32``
on NVIDIA GPUs, PyTorch with IEEE division, and bit-identity needs the same one.

Every layer also has a PyTorch path (``forward(x, reference=True)``): the same split
and int32 all-reduce around the PyTorch arithmetic of the serving engine's
``linear="torch"`` mode (``gpulab.engine.model.packed_bitlinear_reference``), so a
tensor-parallel model on CPU ranks is bit-identical to that mode at TP=1.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import triton
import triton.language as tl

from .. import runtime
from ..bitlinear import BitLinear, pack_ternary, ternary_matmul, unpack_ternary
from ..normquant import rmsnorm_quant, rmsnorm_quant_ref
from ..validate import require_tensor
from .bandwidth import local_time_per_call, time_per_call

# |Σ_k x_q w_t| <= 127·K: float32 holds every integer below 2^24 exactly.
EXACT_MAX_K = (1 << 24) // 127


# -- splitting ------------------------------------------------------------------------------
def shard_range(size: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, stop) of rank's equal share of ``size`` (TP needs size % world_size == 0)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if size % world_size:
        raise ValueError(f"a dimension of {size} cannot be split evenly over {world_size} ranks: "
                         f"tensor parallelism needs sizes divisible by the TP degree")
    share = size // world_size
    return rank * share, (rank + 1) * share


def split_parts(w: torch.Tensor, parts: tuple[int, ...], rank: int, world_size: int) -> torch.Tensor:
    """Rows of rank's shard of a matrix that stacks several parts along dim 0 (e.g. [gate;
    up] with parts (I, I)): rank r takes its slice of every part, parts kept in order."""
    if sum(parts) != w.shape[0]:
        raise ValueError(f"parts {tuple(parts)} add up to {sum(parts)}, but the matrix has {w.shape[0]} rows")
    pieces, start = [], 0
    for p in parts:
        a, b = shard_range(p, rank, world_size)
        pieces.append(w[start + a:start + b])
        start += p
    return torch.cat(pieces, dim=0)


def glu_shards(w_gate_up: torch.Tensor, w_down: torch.Tensor, rank: int, world_size: int):
    """Rank's weights of a GLU MLP: w_gate_up [2I, d] (gate rows, then up rows) split by
    rows *per half*, so hidden unit j keeps its gate and up rows together; w_down [d, I]
    split by columns, the same hidden units. Returns ([2I/n, d], [d, I/n])."""
    hidden = w_down.shape[1]
    if w_gate_up.shape[0] != 2 * hidden:
        raise ValueError(f"w_gate_up has {w_gate_up.shape[0]} rows; a GLU with hidden size {hidden} "
                         f"(w_down's columns) needs 2 × {hidden}")
    a, b = shard_range(hidden, rank, world_size)
    return split_parts(w_gate_up, (hidden, hidden), rank, world_size), w_down[:, a:b]


# -- exact partial sums, one scale ----------------------------------------------------------
def ternary_partial_sums(x_q: torch.Tensor, w_packed: torch.Tensor) -> torch.Tensor:
    """Σ_k x_q[m, k] · W_t[n, k] as int32 [M, N], with gpulab's ternary matmul: with both
    scales 1 its float32 output *is* the integer sum, exact below 2^24."""
    require_tensor("x_q", x_q, dtype=torch.int8)
    k = x_q.shape[-1]
    if k > EXACT_MAX_K:
        raise ValueError(f"K={k} inputs per rank can sum past 2^24, where float32 stops holding every "
                         f"integer: keep K <= {EXACT_MAX_K} per rank (split over more ranks)")
    lead = x_q.shape[:-1]
    x2 = x_q.reshape(-1, k)
    ones = torch.ones(x2.shape[0], dtype=torch.float32, device=x_q.device)
    unit = torch.ones(1, dtype=torch.float32, device=x_q.device)
    acc = ternary_matmul(x2, ones, w_packed, unit, out_dtype=torch.float32)
    # round(): the kernels' division by 1.0 is exact, but a GPU's approximate division
    # (div.full) is allowed 2 ulp; an integer below 2^24 survives that only when rounded
    return acc.round().to(torch.int32).view(*lead, w_packed.shape[0])


@triton.jit
def _scale_partial_sums_kernel(acc_ptr, xs_ptr, ws_ptr, y_ptr, N, stride_am, stride_ym,
                               BLOCK_N: tl.constexpr):
    """y[m, n] = acc[m, n] / (s_x[m] · s_w): the epilogue of gpulab.bitlinear's kernels."""
    m = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = n < N
    acc = tl.load(acc_ptr + m.to(tl.int64) * stride_am + n, mask=mask, other=0)
    scale = tl.load(xs_ptr + m) * tl.load(ws_ptr)
    y = acc.to(tl.float32) / scale
    tl.store(y_ptr + m.to(tl.int64) * stride_ym + n, y.to(y_ptr.dtype.element_ty), mask=mask)


def scale_partial_sums_into(acc, x_scale, w_scale, y):
    """Launcher (check calling convention): acc int32 [M, N], x_scale float32 [M],
    w_scale float32 [1] -> y [M, N]."""
    m, n = acc.shape
    block = min(1024, runtime.next_power_of_2(max(n, 1)))
    _scale_partial_sums_kernel[(m, runtime.cdiv(n, block))](acc, x_scale, w_scale, y, n, acc.stride(0),
                                                           y.stride(0), BLOCK_N=block)


def scale_partial_sums(acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                       out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """y = acc / (x_scale[..., None] · w_scale) in out_dtype, bit for bit what the ternary
    matmul's own epilogue computes from the same integers."""
    require_tensor("acc", acc, dtype=torch.int32)
    if acc.dim() < 1:
        raise ValueError("acc must be [..., N]")
    lead, n = acc.shape[:-1], acc.shape[-1]
    require_tensor("x_scale", x_scale, shape=lead, dtype=torch.float32)
    require_tensor("w_scale", w_scale, dtype=torch.float32)
    if w_scale.numel() != 1:
        raise ValueError(f"w_scale must hold one number, got shape {tuple(w_scale.shape)}")
    if out_dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"out_dtype must be float32, float16 or bfloat16, got {out_dtype}")
    a2 = acc.reshape(-1, n)
    y = torch.empty(a2.shape, dtype=out_dtype, device=acc.device)
    if a2.numel():
        scale_partial_sums_into(a2, x_scale.reshape(-1), w_scale.reshape(1), y)
    return y.view(*lead, n)


def row_parallel_matmul(x_q, x_scale, w_packed, w_scale, out_dtype=torch.float32, group=None):
    """One rank's share of a row-parallel ternary matmul: x_q int8 [M, K/n] (this rank's
    inputs), w_packed its [N, K/n] packed weights. Partial int32 sums, all-reduced as
    integers (exact), then one scale: the TP=1 result, bit for bit."""
    acc = ternary_partial_sums(x_q, w_packed)
    dist.all_reduce(acc, group=group)
    return scale_partial_sums(acc, x_scale, w_scale, out_dtype)


def ternary_partial_sums_reference(x_q: torch.Tensor, w_packed: torch.Tensor) -> torch.Tensor:
    """The same int32 sums [..., N] in PyTorch ops (a float32 matmul of integers below
    2^24 is exact in any summation order), as the engine's ``linear="torch"`` path."""
    require_tensor("x_q", x_q, dtype=torch.int8, any_device=True)
    k = x_q.shape[-1]
    if k > EXACT_MAX_K:
        raise ValueError(f"K={k} inputs per rank can sum past 2^24, where float32 stops holding every "
                         f"integer: keep K <= {EXACT_MAX_K} per rank (split over more ranks)")
    w_t = unpack_ternary(w_packed, k).float()
    return (x_q.float() @ w_t.t()).round().to(torch.int32)


def scale_partial_sums_reference(acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                                 out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """acc / (x_scale[..., None] · w_scale) with PyTorch's division: the expression of
    ``gpulab.engine.model.packed_bitlinear_reference``, so equal integers give equal bits."""
    return (acc.float() / (x_scale[..., None] * w_scale.float())).to(out_dtype)


def row_parallel_matmul_reference(x_q, x_scale, w_packed, w_scale, out_dtype=torch.float32, group=None):
    """:func:`row_parallel_matmul` in PyTorch ops: partial int32 sums, an int32
    all-reduce, one scale; bit for bit the engine's ``linear="torch"`` layer at TP=1."""
    acc = ternary_partial_sums_reference(x_q, w_packed)
    dist.all_reduce(acc, group=group)
    return scale_partial_sums_reference(acc, x_scale, w_scale, out_dtype)


def row_parallel_matmul_float(x_q, x_scale, w_packed, w_scale, out_dtype=torch.float32, group=None):
    """The same split with the reduction in floating point, as for a float layer: each rank
    scales its partial result, then the all-reduce adds rounded floats. Close to TP=1, not
    equal."""
    y = ternary_matmul(x_q, x_scale, w_packed, w_scale, out_dtype=out_dtype)
    dist.all_reduce(y, group=group)
    return y


# -- layers ---------------------------------------------------------------------------------
def _ternary_of(layer: BitLinear) -> torch.Tensor:
    if not isinstance(layer, BitLinear):
        raise TypeError(f"expected a gpulab.bitlinear.BitLinear, got {type(layer).__name__}")
    if not layer.packed:
        raise ValueError("pack the BitLinear first (layer.pack()): tensor parallelism splits its "
                         "ternary inference weights")
    return unpack_ternary(layer.w_packed, layer.in_features)


def _group_info(group):
    return dist.get_rank(group), dist.get_world_size(group)


class ColumnParallelBitLinear(nn.Module):
    """Rank's output features of a BitLinear (``parts``: sizes of stacked matrices, each
    split separately). ``forward(x)`` gives the local outputs [..., out/n];
    ``forward_gathered(x)`` all-gathers them into the one-GPU layout [..., out].
    ``reference=True``: the PyTorch arithmetic instead of gpulab's kernels."""

    def __init__(self, w_t_shard: torch.Tensor, w_scale: torch.Tensor, norm_weight: torch.Tensor,
                 eps: float, parts: tuple[int, ...], bias_shard: torch.Tensor | None = None, group=None):
        super().__init__()
        self.parts, self.eps, self.group = tuple(parts), eps, group
        self.register_buffer("w_packed", pack_ternary(w_t_shard.contiguous()))
        self.register_buffer("w_scale", w_scale.detach().reshape(1).float().clone())
        self.register_buffer("norm_weight", norm_weight.detach().clone())
        self.register_buffer("bias", None if bias_shard is None else bias_shard.detach().clone())

    @classmethod
    def from_bitlinear(cls, layer: BitLinear, parts: tuple[int, ...] | None = None, group=None,
                       rank: int | None = None, world_size: int | None = None):
        """This rank's shard of a packed BitLinear (rank/world_size default to the group's)."""
        w_t = _ternary_of(layer)
        if rank is None or world_size is None:
            rank, world_size = _group_info(group)
        parts = tuple(parts or (layer.out_features,))
        bias = None if layer.bias is None else split_parts(layer.bias.detach()[:, None], parts, rank,
                                                           world_size)[:, 0]
        return cls(split_parts(w_t, parts, rank, world_size), layer.w_scale, layer.norm_weight, layer.eps,
                   parts, bias, group)

    def forward(self, x: torch.Tensor, reference: bool = False) -> torch.Tensor:
        if reference:
            x_q, x_s = rmsnorm_quant_ref(x, self.norm_weight, self.eps)
            y = scale_partial_sums_reference(ternary_partial_sums_reference(x_q, self.w_packed), x_s,
                                             self.w_scale, x.dtype)
        else:
            x_q, x_s = rmsnorm_quant(x.contiguous(), self.norm_weight, self.eps)
            y = ternary_matmul(x_q, x_s, self.w_packed, self.w_scale.float(), out_dtype=x.dtype)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def forward_gathered(self, x: torch.Tensor, reference: bool = False) -> torch.Tensor:
        return gather_parts(self(x, reference), self.parts, self.group)


def gather_parts(y_local: torch.Tensor, parts: tuple[int, ...], group=None) -> torch.Tensor:
    """All-gather column-parallel outputs [..., Σparts/n] into the one-GPU layout
    [..., Σparts]: part by part, rank by rank."""
    n = dist.get_world_size(group)
    y_local = y_local.contiguous()
    staged = y_local.is_cuda and dist.get_backend(group) == "gloo"     # gloo gathers CPU tensors only
    src = y_local.cpu() if staged else y_local
    chunks = [torch.empty_like(src) for _ in range(n)]
    dist.all_gather(chunks, src, group=group)
    if staged:
        chunks = [c.to(y_local.device) for c in chunks]
    pieces, start = [], 0
    for p in parts:
        share = p // n
        pieces += [c[..., start:start + share] for c in chunks]
        start += share
    return torch.cat(pieces, dim=-1)


class RowParallelBitLinear(nn.Module):
    """Rank's input features of a BitLinear. ``forward(x)`` takes the whole input row
    (replicated), quantizes it like TP=1 and multiplies this rank's K/n inputs;
    ``matmul`` (default :func:`row_parallel_matmul`) reduces the partial results;
    ``forward(x, reference=True)`` runs :func:`row_parallel_matmul_reference` instead."""

    def __init__(self, w_t_shard: torch.Tensor, w_scale: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                 k_range: tuple[int, int], bias: torch.Tensor | None = None, group=None, matmul=None):
        super().__init__()
        self.k_range, self.eps, self.group = tuple(k_range), eps, group
        self.matmul = matmul or row_parallel_matmul
        self.register_buffer("w_packed", pack_ternary(w_t_shard.contiguous()))
        self.register_buffer("w_scale", w_scale.detach().reshape(1).float().clone())
        self.register_buffer("norm_weight", norm_weight.detach().clone())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @classmethod
    def from_bitlinear(cls, layer: BitLinear, group=None, rank: int | None = None,
                       world_size: int | None = None, matmul=None):
        w_t = _ternary_of(layer)
        if rank is None or world_size is None:
            rank, world_size = _group_info(group)
        a, b = shard_range(layer.in_features, rank, world_size)
        return cls(w_t[:, a:b], layer.w_scale, layer.norm_weight, layer.eps, (a, b),
                   None if layer.bias is None else layer.bias, group, matmul)

    def forward(self, x: torch.Tensor, reference: bool = False) -> torch.Tensor:
        norm_quant, matmul = (rmsnorm_quant_ref, row_parallel_matmul_reference) if reference else \
            (rmsnorm_quant, self.matmul)
        x_q, x_s = norm_quant(x.contiguous(), self.norm_weight, self.eps)
        a, b = self.k_range
        y = matmul(x_q[..., a:b].contiguous(), x_s, self.w_packed, self.w_scale.float(), x.dtype, self.group)
        return y if self.bias is None else y + self.bias.to(y.dtype)


class TensorParallelGLU(nn.Module):
    """down(SiLU(gate) ⊙ up) over the ranks of ``group``: gate_up column-parallel (its
    outputs all-gathered), down row-parallel with one int32 all-reduce.

    ``shard`` (default :func:`glu_shards`) and ``matmul`` (default
    :func:`row_parallel_matmul`) can be replaced, e.g. by a learner's versions."""

    def __init__(self, gate_up: BitLinear, down: BitLinear, group=None, shard=None, matmul=None,
                 rank: int | None = None, world_size: int | None = None):
        super().__init__()
        if rank is None or world_size is None:
            rank, world_size = _group_info(group)
        hidden = down.in_features
        if gate_up.out_features != 2 * hidden:
            raise ValueError(f"gate_up has {gate_up.out_features} outputs; down expects {hidden} inputs, "
                             f"so gate_up needs 2 × {hidden}")
        if gate_up.bias is not None:
            raise ValueError("gate_up with a bias is not supported here")
        w_gu, w_down = (shard or glu_shards)(_ternary_of(gate_up), _ternary_of(down), rank, world_size)
        share = hidden // world_size
        if tuple(w_gu.shape) != (2 * share, gate_up.in_features) or tuple(w_down.shape) != (down.out_features, share):
            raise ValueError(f"the shard function returned shapes {tuple(w_gu.shape)} and {tuple(w_down.shape)}; "
                             f"rank {rank} of {world_size} needs {(2 * share, gate_up.in_features)} and "
                             f"{(down.out_features, share)}")
        a, b = rank * share, (rank + 1) * share
        self.gate_up = ColumnParallelBitLinear(w_gu, gate_up.w_scale, gate_up.norm_weight, gate_up.eps,
                                               (hidden, hidden), None, group)
        self.down = RowParallelBitLinear(w_down, down.w_scale, down.norm_weight, down.eps, (a, b),
                                         down.bias, group, matmul)

    def forward(self, x: torch.Tensor, reference: bool = False) -> torch.Tensor:
        gate, up = self.gate_up.forward_gathered(x, reference).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up, reference)


def glu_forward(gate_up: BitLinear, down: BitLinear, x: torch.Tensor) -> torch.Tensor:
    """TP=1: the GLU on one device, as gpulab.model.GLU and the engine compute it."""
    gate, up = gate_up(x).chunk(2, dim=-1)
    return down(F.silu(gate) * up)


def random_glu(d_model: int, hidden: int, seed: int = 0, dtype=torch.float32, device=None):
    """A packed GLU (gate_up: d -> 2·hidden, down: hidden -> d) with random weights and
    norm weights, built on ``device`` (the same seed gives the same layers on every rank)."""
    device = torch.device(device or "cpu")
    gen = torch.Generator(device=device).manual_seed(seed)
    gate_up = BitLinear(d_model, 2 * hidden, device=device)
    down = BitLinear(hidden, d_model, device=device)
    with torch.no_grad():
        for layer in (gate_up, down):
            layer.weight.normal_(generator=gen)
            layer.norm_weight.copy_(1 + 0.3 * torch.randn(layer.norm_weight.shape, generator=gen, device=device))
            layer.pack()
    return gate_up.to(dtype=dtype), down.to(dtype=dtype)


# -- TP=n against TP=1 ----------------------------------------------------------------------
def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable values apart a and b are, elementwise (same float dtype)."""
    if a.dtype != b.dtype or not a.dtype.is_floating_point:
        raise TypeError("ulp_distance needs two tensors of one float dtype")
    ints = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
            torch.float64: torch.int64}[a.dtype]

    def ordered(t):     # map float bits to integers that increase with the value
        i = t.contiguous().view(ints).long()
        top = 1 << (torch.iinfo(ints).bits - 1)
        return torch.where(i < 0, -(i + top), i)
    return (ordered(a) - ordered(b)).abs()


def compare_outputs(tp1: torch.Tensor, tpn: torch.Tensor) -> dict:
    """Bit-identity statistics of a TP=n output against TP=1."""
    same = tp1.view(-1) == tpn.view(-1)
    ulps = ulp_distance(tp1, tpn)
    return {"identical": bool(same.all()), "elements": tp1.numel(), "different": int((~same).sum()),
            "max_abs_diff": float((tp1.double() - tpn.double()).abs().max()) if tp1.numel() else 0.0,
            "max_ulps": int(ulps.max()) if tp1.numel() else 0}


def tp_glu_rank(d_model: int, hidden: int, rows: int, dtype: torch.dtype, seed: int = 0,
                shard=None, matmul=None) -> dict:
    """Rank function: the same random GLU and input on every rank; TP=1 (the plain
    layers), TP=n with the int32 reduction (or ``matmul``) and with a float reduction."""
    dev = runtime.device()
    gate_up, down = random_glu(d_model, hidden, seed, dtype, dev)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(rows, d_model, generator=gen).to(device=dev, dtype=dtype)
    exact = TensorParallelGLU(gate_up, down, shard=shard, matmul=matmul)
    rounded = TensorParallelGLU(gate_up, down, matmul=row_parallel_matmul_float)
    with torch.no_grad():
        return {"tp1": glu_forward(gate_up, down, x), "int32": exact(x), "float": rounded(x)}


def tp_latency_rank(d_model: int, hidden: int, rows_list=(1, 16, 128), dtypes=(torch.bfloat16,),
                    seed: int = 0, budget_s: float = 0.3) -> list[dict]:
    """Rank function for GPUs: per row count, TP=n against TP=1 (bit-identity with the
    int32 reduction and with a float one) and time per forward of the GLU: TP=1 on one
    GPU, TP=n, and the TP=n collectives alone (all-gather + int32 all-reduce)."""
    out = []
    for dtype in dtypes:
        out += _tp_latency_rows(d_model, hidden, rows_list, dtype, seed, budget_s)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()        # this dtype's layers are gone: make room for the next
    return out


def _tp_latency_rows(d_model, hidden, rows_list, dtype, seed, budget_s) -> list[dict]:
    dev = runtime.device()
    n = dist.get_world_size()
    gate_up, down = random_glu(d_model, hidden, seed, dtype, dev)
    exact = TensorParallelGLU(gate_up, down)
    rounded = TensorParallelGLU(gate_up, down, matmul=row_parallel_matmul_float)
    out = []
    for rows in rows_list:
        x = torch.randn(rows, d_model, generator=torch.Generator().manual_seed(seed + rows)).to(dev, dtype)
        y_local = torch.zeros(rows, 2 * hidden // n, dtype=dtype, device=dev)
        acc = torch.zeros(rows, d_model, dtype=torch.int32, device=dev)

        def comms():
            gather_parts(y_local, (hidden, hidden))
            dist.all_reduce(acc)
        with torch.no_grad():
            tp1 = glu_forward(gate_up, down, x)
            row = {"d_model": d_model, "hidden": hidden, "rows": rows, "dtype": str(dtype).replace("torch.", ""),
                   "world_size": n, "int32": compare_outputs(tp1, exact(x)),
                   "float": compare_outputs(tp1, rounded(x))}
            row["tp1_us"] = local_time_per_call(lambda: glu_forward(gate_up, down, x), budget_s) * 1e6
            row["tpn_us"] = time_per_call(lambda: exact(x), budget_s) * 1e6
            row["tpn_float_us"] = time_per_call(lambda: rounded(x), budget_s) * 1e6
            row["tpn_comms_us"] = time_per_call(comms, budget_s) * 1e6
        out.append(row)
    return out
