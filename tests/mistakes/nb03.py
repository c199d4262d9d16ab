"""Notebook 03: the MLGRU scan, recurrent forward and backward, and the chunked scan."""
import triton
import triton.language as tl

from . import Mistake


# -- ex1: the recurrent scan --------------------------------------------------------------
@triton.jit
def _rec(f_ptr, i_ptr, h0_ptr, h_ptr, hlast_ptr, T, D, BLOCK_D: tl.constexpr, MUT: tl.constexpr):
    pid_d = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    if MUT == 1:                                  # h0 forgotten
        h = tl.zeros([BLOCK_D], tl.float32)
    else:
        h = tl.load(h0_ptr + b * D + cols, mask=mask, other=0.0).to(tl.float32)
    if MUT == 2:                                  # batch offset b·D, not b·T·D
        offs = b * D + cols
    elif MUT == 3:                                # walks time backwards
        offs = b * T * D + (T - 1) * D + cols
    else:
        offs = b * T * D + cols
    for t in range(T):
        if MUT == 4:                              # no mask on the loads
            f = tl.load(f_ptr + offs).to(tl.float32)
            x = tl.load(i_ptr + offs).to(tl.float32)
        else:
            f = tl.load(f_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            x = tl.load(i_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if MUT == 5:                              # stores h_(t-1)
            tl.store(h_ptr + offs, h.to(h_ptr.dtype.element_ty), mask=mask)
        if MUT == 6:                              # GRU-style convex mix
            h = f * h + (1.0 - f) * x
        else:
            h = f * h + x
        if MUT != 5:
            tl.store(h_ptr + offs, h.to(h_ptr.dtype.element_ty), mask=mask)
        if MUT == 3:
            offs -= D
        else:
            offs += D
    if MUT != 7:                                  # MUT 7: h_last never stored
        tl.store(hlast_ptr + b * D + cols, h, mask=mask)


def _rec_launcher(mut):
    def scan_recurrent(f, i, h0, h, h_last, BLOCK_D=64):
        B, T, D = f.shape
        _rec[(triton.cdiv(D, BLOCK_D), B)](f, i, h0, h, h_last, T, D, BLOCK_D=BLOCK_D, MUT=mut)
    return scan_recurrent


# -- ex2: the backward scan ---------------------------------------------------------------
@triton.jit
def _bwd(f_ptr, h0_ptr, h_ptr, dh_ptr, dhlast_ptr, df_ptr, di_ptr, dh0_ptr, T, D,
         BLOCK_D: tl.constexpr, MUT: tl.constexpr):
    pid_d = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    if MUT == 1:                                  # dh_last ignored
        g = tl.zeros([BLOCK_D], tl.float32)
    else:
        g = tl.load(dhlast_ptr + b * D + cols, mask=mask, other=0.0).to(tl.float32)
    h0 = tl.load(h0_ptr + b * D + cols, mask=mask, other=0.0).to(tl.float32)
    f_next = tl.full([BLOCK_D], 1.0, tl.float32)
    offs = b * T * D + (T - 1) * D + cols
    for t in range(T - 1, -1, -1):
        f_t = tl.load(f_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if MUT == 2:                              # carried without the forget gate
            g = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32) + g
        elif MUT == 3:                            # f_t, not f_(t+1)
            g = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32) + f_t * g
        else:
            g = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32) + f_next * g
        tl.store(di_ptr + offs, g.to(di_ptr.dtype.element_ty), mask=mask)
        if MUT == 4:                              # df_t = g_t · h_t
            h_prev = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        elif t > 0:
            h_prev = tl.load(h_ptr + offs - D, mask=mask, other=0.0).to(tl.float32)
        else:
            h_prev = h0
        tl.store(df_ptr + offs, (g * h_prev).to(df_ptr.dtype.element_ty), mask=mask)
        f_next = f_t
        offs -= D
    if MUT == 5:                                  # dh0 = g_0
        tl.store(dh0_ptr + b * D + cols, g, mask=mask)
    else:
        tl.store(dh0_ptr + b * D + cols, f_next * g, mask=mask)


def _bwd_launcher(mut):
    def scan_backward(f, h0, h, dh, dh_last, df, di, dh0, BLOCK_D=64):
        B, T, D = f.shape
        _bwd[(triton.cdiv(D, BLOCK_D), B)](f, h0, h, dh, dh_last, df, di, dh0, T, D, BLOCK_D=BLOCK_D, MUT=mut)
    return scan_backward


# -- ex3: the chunked scan ----------------------------------------------------------------
@triton.jit
def _combine(a1, b1, a2, b2):
    return a1 * a2, a2 * b1 + b2


@triton.jit
def _combine_swapped(a1, b1, a2, b2):
    return a1 * a2, a1 * b2 + b1


@triton.jit
def _chunked(f_ptr, i_ptr, h0_ptr, h_ptr, hlast_ptr, T, D,
             BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, MUT: tl.constexpr):
    pid_d = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    rows = tl.arange(0, BLOCK_T)
    is_last_row = (rows == BLOCK_T - 1)[:, None]
    if MUT == 1:                                  # h0 forgotten
        h = tl.zeros([BLOCK_D], tl.float32)
    else:
        h = tl.load(h0_ptr + b * D + cols, mask=cmask, other=0.0).to(tl.float32)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + rows
        m = (t < T)[:, None] & cmask[None, :]
        offs = b * T * D + t[:, None] * D + cols[None, :]
        if MUT == 2:                              # padded steps get f = 0
            f = tl.load(f_ptr + offs, mask=m, other=0.0).to(tl.float32)
        else:
            f = tl.load(f_ptr + offs, mask=m, other=1.0).to(tl.float32)
        x = tl.load(i_ptr + offs, mask=m, other=0.0).to(tl.float32)
        if MUT == 3:
            a, h_local = tl.associative_scan((f, x), 0, _combine_swapped)
        else:
            a, h_local = tl.associative_scan((f, x), 0, _combine)
        if MUT == 4:                              # carry lost
            h_tile = h_local
        elif MUT == 5:                            # carry added without its decay
            h_tile = h_local + h[None, :]
        else:
            h_tile = h_local + a * h[None, :]
        if MUT == 6:                              # store without the time mask
            tl.store(h_ptr + offs, h_tile.to(h_ptr.dtype.element_ty), mask=cmask[None, :])
        else:
            tl.store(h_ptr + offs, h_tile.to(h_ptr.dtype.element_ty), mask=m)
        h = tl.sum(tl.where(is_last_row, h_tile, 0.0), axis=0)
    tl.store(hlast_ptr + b * D + cols, h, mask=cmask)


def _chunked_launcher(mut):
    def scan_chunked(f, i, h0, h, h_last, BLOCK_T=8, BLOCK_D=16):
        B, T, D = f.shape
        _chunked[(triton.cdiv(D, BLOCK_D), B)](f, i, h0, h, h_last, T, D, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D,
                                               MUT=mut)
    return scan_chunked


_REC, _BWD, _CH = "mlgru_scan_recurrent", "mlgru_scan_backward_recurrent", "mlgru_scan_chunked"
MISTAKES = [
    Mistake("03/check-recurrent", _REC, "h0 forgotten (starts at 0)", _rec_launcher(1), ("h0 set to zero",)),
    Mistake("03/check-recurrent", _REC, "batch offset b·D, not b·T·D", _rec_launcher(2), ("batch 1",)),
    Mistake("03/check-recurrent", _REC, "walks time backwards", _rec_launcher(3), ("backwards in time",)),
    Mistake("03/check-recurrent", _REC, "no mask on the loads", _rec_launcher(4), ("a load past the end of input",),
            interpreter_only="the stray lanes (columns past D) are loaded but never stored: each lane's "
                             "recurrence stays in its own lane"),
    Mistake("03/check-recurrent", _REC, "stores h before the update", _rec_launcher(5), ("before step t",)),
    Mistake("03/check-recurrent", _REC, "GRU-style (1 - f)·i", _rec_launcher(6), ("GRU-style",)),
    Mistake("03/check-recurrent", _REC, "h_last never stored", _rec_launcher(7), ("nothing was written",)),

    Mistake("03/check-backward", _BWD, "dh_last ignored", _bwd_launcher(1), ("dh_last set to zero",)),
    Mistake("03/check-backward", _BWD, "gradient carried without f", _bwd_launcher(2), ("without the forget gate",)),
    Mistake("03/check-backward", _BWD, "f_t instead of f_(t+1)", _bwd_launcher(3), ("not f_(t+1)",)),
    Mistake("03/check-backward", _BWD, "df_t from h_t", _bwd_launcher(4), ("df_t uses h_t",)),
    Mistake("03/check-backward", _BWD, "dh0 without f_0", _bwd_launcher(5), ("dh0 misses the first forget gate",)),

    Mistake("03/check-chunked", _CH, "h0 forgotten", _chunked_launcher(1), ("h0 set to zero",)),
    Mistake("03/check-chunked", _CH, "padded steps get f = 0", _chunked_launcher(2), ("other=1.0",)),
    Mistake("03/check-chunked", _CH, "combine in the wrong order", _chunked_launcher(3), ("wrong order",)),
    Mistake("03/check-chunked", _CH, "carry between chunks lost", _chunked_launcher(4), ("starts from 0",)),
    Mistake("03/check-chunked", _CH, "carry added without its decay", _chunked_launcher(5), ("without its decay",)),
    Mistake("03/check-chunked", _CH, "store without the time mask", _chunked_launcher(6),
            ("past the end of output `h`",)),
]
