"""Notebook 01: ternary quantization, 2-bit packing, the decode GEMV."""
import torch
import triton
import triton.language as tl

from gpulab import bitlinear as bl

from . import Mistake


# -- ex1: absmean ternary quantization ----------------------------------------------------
def _quantize(kind):
    def ternary_quantize(w):
        wf = w.float()
        if kind == "absmax":
            scale = 1.0 / wf.abs().max().clamp_min(1e-5)
        elif kind == "no floor":
            scale = 1.0 / wf.abs().mean()
        elif kind == "inverted scale":
            scale = wf.abs().mean().clamp_min(1e-5)
        elif kind == "per-row scale":
            scale = 1.0 / wf.abs().mean(dim=1, keepdim=True).clamp_min(1e-5)
        else:
            scale = 1.0 / wf.abs().mean().clamp_min(1e-5)
        v = wf * scale
        if kind == "truncates":
            w_t = v.clamp(-1, 1).to(torch.int8)
        elif kind == "no clamp":
            w_t = bl.round_half_away(v).to(torch.int8)
        else:
            w_t = bl.round_half_away(v).clamp(-1, 1).to(torch.int8)
        if kind == "int64":
            w_t = w_t.long()
        if kind == "python float":
            return w_t, float(scale)
        return w_t, scale
    return ternary_quantize


# -- ex2: 2-bit packing -------------------------------------------------------------------
def _pack(kind):
    def pack_ternary(w_t):
        n, k = w_t.shape
        q = triton.cdiv(k, 4)
        pad = 0 if kind == "pads with code 0" else 1
        codes = torch.full((n, 4 * q), pad, dtype=torch.uint8, device=w_t.device)
        codes[:, :k] = (w_t if kind == "codes without +1" else w_t + 1).to(torch.uint8)
        if kind == "consecutive layout":
            c = codes.view(n, q, 4).transpose(1, 2)
        else:
            c = codes.view(n, 4, q)
        if kind == "quarter 0 in the high bits":
            packed = (c[:, 0] << 6) | (c[:, 1] << 4) | (c[:, 2] << 2) | c[:, 3]
        else:
            packed = c[:, 0] | (c[:, 1] << 2) | (c[:, 2] << 4) | (c[:, 3] << 6)
        return packed.long() if kind == "int64" else packed
    return pack_ternary


# -- ex3: the GEMV on packed weights ------------------------------------------------------
@triton.jit
def _gemv(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, N, K, Q,
          BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr, MUT: tl.constexpr):
    m = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    acc = tl.zeros([BLOCK_N], dtype=tl.int32)
    for j0 in range(0, Q, BLOCK_Q):
        j = j0 + tl.arange(0, BLOCK_Q)
        j_mask = j < Q
        if MUT == 6:                         # weight rows indexed with K, not Q
            w_off = n[:, None] * K + j[None, :]
        else:
            w_off = n[:, None] * Q + j[None, :]
        b = tl.load(w_ptr + w_off, mask=n_mask[:, None] & j_mask[None, :], other=0).to(tl.int32)
        for i in tl.static_range(4):
            k = i * Q + j
            if MUT == 1:                     # no mask on x
                xi = tl.load(x_ptr + m * K + k).to(tl.int32)
            else:
                xi = tl.load(x_ptr + m * K + k, mask=j_mask & (k < K), other=0).to(tl.int32)
            if MUT == 2:                     # shift by i, not 2i
                wi = ((b >> i) & 3) - 1
            elif MUT == 3:                   # forgets the -1
                wi = (b >> (2 * i)) & 3
            else:
                wi = ((b >> (2 * i)) & 3) - 1
            acc += tl.sum(wi * xi[None, :], axis=1)
    if MUT == 4:                             # multiplies by the scales
        y = acc.to(tl.float32) * (tl.load(xs_ptr + m) * tl.load(ws_ptr))
    else:
        y = acc.to(tl.float32) / (tl.load(xs_ptr + m) * tl.load(ws_ptr))
    if MUT == 5:                             # no mask on the store
        tl.store(y_ptr + m * N + n, y.to(y_ptr.dtype.element_ty))
    else:
        tl.store(y_ptr + m * N + n, y.to(y_ptr.dtype.element_ty), mask=n_mask)


def _gemv_launcher(mut=0, q_floor=False):
    def gemv(x_q, x_scale, w_packed, w_scale, y):
        m, k = x_q.shape
        n, q = w_packed.shape
        if q_floor:                          # Q from K // 4: the last partial byte is dropped
            q = k // 4
        _gemv[(m, triton.cdiv(n, 64))](x_q, x_scale, w_packed, w_scale, y, n, k, q,
                                       BLOCK_N=64, BLOCK_Q=256, MUT=mut)
    return gemv


MISTAKES = [
    Mistake("01/check-ternary-quantize", "ternary_quantize", "w_t as int64", _quantize("int64"),
            ("dtype int64, expected int8",)),
    Mistake("01/check-ternary-quantize", "ternary_quantize", "truncates instead of rounding", _quantize("truncates"),
            ("round",)),
    Mistake("01/check-ternary-quantize", "ternary_quantize", "scale = mean|w| (not its inverse)",
            _quantize("inverted scale"), ("reciprocal",)),
    Mistake("01/check-ternary-quantize", "ternary_quantize", "one scale per row", _quantize("per-row scale"),
            ("has shape",)),
    Mistake("01/check-ternary-quantize", "ternary_quantize", "no clamp to [-1, 1]", _quantize("no clamp"),
            ("clamp",)),
    Mistake("01/check-ternary-quantize", "ternary_quantize", "absmax instead of absmean", _quantize("absmax"),
            ("factor",)),
    Mistake("01/check-ternary-quantize", "ternary_quantize", "w_scale as a Python float", _quantize("python float"),
            ("should be a tensor",)),
    Mistake("01/check-ternary-quantize", "ternary_quantize", "no floor on mean|w| (all-zero weights)",
            _quantize("no floor"), ("floor the mean",)),

    Mistake("01/check-pack-ternary", "pack_ternary", "returns int64", _pack("int64"), ("dtype int64, expected uint8",)),
    Mistake("01/check-pack-ternary", "pack_ternary", "pads with code 0 (weight -1)", _pack("pads with code 0"),
            ("columns",)),
    Mistake("01/check-pack-ternary", "pack_ternary", "codes without +1", _pack("codes without +1"),
            ("code",)),
    Mistake("01/check-pack-ternary", "pack_ternary", "four consecutive weights per byte", _pack("consecutive layout"),
            ("layout",)),
    Mistake("01/check-pack-ternary", "pack_ternary", "quarter 0 in the high bits", _pack("quarter 0 in the high bits"),
            ("bit",)),

    Mistake("01/check-gemv", "ternary_gemv", "no mask on x", _gemv_launcher(1), ("a load past the end of input `x_q`",)),
    Mistake("01/check-gemv", "ternary_gemv", "shift by i, not 2i", _gemv_launcher(2),
            ("shift",)),
    Mistake("01/check-gemv", "ternary_gemv", "code not mapped back (no -1)", _gemv_launcher(3),
            ("- 1", "-1")),
    Mistake("01/check-gemv", "ternary_gemv", "multiplies by the scales", _gemv_launcher(4), ("factor",)),
    Mistake("01/check-gemv", "ternary_gemv", "no mask on the store", _gemv_launcher(5), ("past the end of output `y`",)),
    Mistake("01/check-gemv", "ternary_gemv", "weight rows strided by K", _gemv_launcher(6),
            ("a load past the end of input `w_packed`", "went far outside every buffer"),
            faults_compiled="rows strided by K, not K/4, read up to 48 MB past w_packed on the 8192 x "
                            "8192 case: an illegal address on the H200 in one run of two (2026-12-01)"),
    Mistake("01/check-gemv", "ternary_gemv", "Q = K // 4", _gemv_launcher(q_floor=True),
            ("Q",)),
]
