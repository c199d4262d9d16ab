"""Notebook 04: the online softmax kernel, the merge of two attention states, attention v1,
causal GQA attention, exp2 from a cubic."""
import torch
import triton
import triton.language as tl

from gpulab.attention_state import online_update, state_epilogue

from . import Mistake


@triton.jit
def _online(x_ptr, y_ptr, n_cols, sx, sy, BLOCK: tl.constexpr, MUT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
    d = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
    for start in range(0, n_cols, BLOCK):
        mask = start + cols < n_cols
        if MUT == 1:                        # no mask on the load
            x = tl.load(x_ptr + row * sx + start + cols).to(tl.float32)
        elif MUT == 2:                      # masked lanes read 0
            x = tl.load(x_ptr + row * sx + start + cols, mask=mask, other=0.0).to(tl.float32)
        else:
            x = tl.load(x_ptr + row * sx + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        if MUT == 3:                        # d not rescaled when the max moves
            d = d + tl.sum(tl.exp(x - m_new), axis=0)
        elif MUT == 4:                      # base 2 without log2(e)
            d = d * tl.exp2(m - m_new) + tl.sum(tl.exp2(x - m_new), axis=0)
        else:
            d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    for start in range(0, n_cols, BLOCK):
        mask = start + cols < n_cols
        x = tl.load(x_ptr + row * sx + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
        if MUT == 4:
            y = tl.exp2(x - m) / d
        elif MUT == 5:                      # forgets to divide by d
            y = tl.exp(x - m)
        else:
            y = tl.exp(x - m) / d
        if MUT == 6:                        # store without its mask
            tl.store(y_ptr + row * sy + start + cols, y.to(y_ptr.dtype.element_ty))
        else:
            tl.store(y_ptr + row * sy + start + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def _online_launcher(mut, stride="own"):
    def online_softmax(x, y):
        n_rows, n_cols = x.shape
        block = min(1024, triton.next_power_of_2(n_cols))
        sx, sy = x.stride(0), y.stride(0)
        if stride == "x for y":
            sy = sx
        elif stride == "row length":
            sx = sy = n_cols
        _online[(n_rows,)](x, y, n_cols, sx, sy, BLOCK=block, MUT=mut)
    return online_softmax


def _merge(kind):
    def merge_states(o_a, lse_a, o_b, lse_b):
        m = torch.maximum(lse_a, lse_b)
        if kind == "no empty-state guard":
            m_safe = m
        else:
            m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
        wa, wb = torch.exp(lse_a - m_safe), torch.exp(lse_b - m_safe)
        total = wa + wb
        safe_total = torch.where(total > 0, total, torch.ones_like(total))
        if kind == "swapped weights":
            wa, wb = wb, wa
        o = (wa / safe_total)[..., None] * o_a.float() + (wb / safe_total)[..., None] * o_b.float()
        if kind == "average":
            o = (o_a.float() + o_b.float()) / 2
        if kind == "base-2 lse":
            lse = torch.where(total > 0, m_safe + torch.log2(safe_total), m)
        else:
            lse = torch.where(total > 0, m_safe + torch.log(safe_total), m)
        if kind == "o stays float32":
            return o, lse
        if kind == "lse in o's dtype":
            return o.to(o_a.dtype), lse.to(o_a.dtype)
        return o.to(o_a.dtype), lse
    return merge_states


MISTAKES = [
    Mistake("04/check-online-softmax", "online_softmax", "no mask on the load", _online_launcher(1),
            ("a load past the end of input `x`",)),
    Mistake("04/check-online-softmax", "online_softmax", "masked lanes read 0", _online_launcher(2),
            ("own constant factor",)),
    Mistake("04/check-online-softmax", "online_softmax", "running sum not rescaled", _online_launcher(3),
            ("own constant factor",)),
    Mistake("04/check-online-softmax", "online_softmax", "exp2 without log2(e)", _online_launcher(4),
            ("exp2", "base")),
    Mistake("04/check-online-softmax", "online_softmax", "never divides by the sum", _online_launcher(5),
            ("own constant factor",)),
    Mistake("04/check-online-softmax", "online_softmax", "store without its mask", _online_launcher(6),
            ("past the end of output `y`",)),
    Mistake("04/check-online-softmax", "online_softmax", "x's row stride used for y", _online_launcher(0, "x for y"),
            ("between the rows",)),
    Mistake("04/check-online-softmax", "online_softmax", "row length as row stride",
            _online_launcher(0, "row length"), ("between the rows",)),

    Mistake("04/check-merge-states", "merge_state_torch", "no guard for two empty states",
            _merge("no empty-state guard"), ("arithmetic",)),
    Mistake("04/check-merge-states", "merge_state_torch", "weights swapped", _merge("swapped weights"),
            ("`lse_a` and `lse_b` swapped", "`o_a` and `o_b` swapped")),
    Mistake("04/check-merge-states", "merge_state_torch", "plain average of o", _merge("average"),
            ("weight",)),
    Mistake("04/check-merge-states", "merge_state_torch", "base-2 log-sum-exp", _merge("base-2 lse"),
            ("base 2", "ln 2", "log2")),
    Mistake("04/check-merge-states", "merge_state_torch", "o returned in float32", _merge("o stays float32"),
            ("dtype float32, expected float16", "dtype float32, expected bfloat16")),
    Mistake("04/check-merge-states", "merge_state_torch", "lse in o's dtype", _merge("lse in o's dtype"),
            ("dtype float16, expected float32", "dtype bfloat16, expected float32")),
]


# -- ex3: attention v1 (non-causal, Hq = Hkv) ----------------------------------------------
LOG2E = 1.4426950408889634


@triton.jit
def _attn_v1(Q, K, V, O, LSE, H, S_q, S_kv, qk_scale,
             HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MUT: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q_rows = bh * S_q + offs_m
    kv_rows = bh * S_kv
    q = tl.load(Q + q_rows[:, None] * HEAD_DIM + offs_d[None, :], mask=offs_m[:, None] < S_q, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start_n in range(0, S_kv, BLOCK_N):
        cols = start_n + offs_n
        in_range = cols < S_kv
        if MUT == 1:                                # K and V loaded without the key mask
            k = tl.load(K + (kv_rows + cols[:, None]) * HEAD_DIM + offs_d[None, :])
            v = tl.load(V + (kv_rows + cols[:, None]) * HEAD_DIM + offs_d[None, :])
        else:
            k = tl.load(K + (kv_rows + cols[:, None]) * HEAD_DIM + offs_d[None, :], mask=in_range[:, None], other=0.0)
            v = tl.load(V + (kv_rows + cols[:, None]) * HEAD_DIM + offs_d[None, :], mask=in_range[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        if MUT != 2:                                # 2: scores of keys past S_kv not set to -inf
            s = tl.where(in_range[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if MUT == 3:                                # exp, though qk_scale carries log2(e)
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
        else:
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MUT == 4:                                # acc not rescaled when the max moves
            acc = tl.dot(p.to(v.dtype), v, acc)
        else:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    if MUT == 5:                                    # never divided by l
        o = acc
    else:
        o = acc / l_i[:, None]
    if MUT == 6:                                    # lse left in base 2
        lse = m_i + tl.log2(l_i)
    else:
        lse = (m_i + tl.log2(l_i)) * 0.6931471805599453
    row_ok = offs_m < S_q
    if MUT == 7:                                    # o stored without the row mask
        tl.store(O + q_rows[:, None] * HEAD_DIM + offs_d[None, :], o.to(O.dtype.element_ty))
    else:
        tl.store(O + q_rows[:, None] * HEAD_DIM + offs_d[None, :], o.to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + q_rows, lse, mask=row_ok)


def _v1_launcher(mut=0, log2e=LOG2E):
    def attention_v1(q, k, v, causal, o, lse):
        B, H, S_q, D = q.shape
        _attn_v1[(triton.cdiv(S_q, 32), B * H)](q, k, v, o, lse, H, S_q, k.shape[2], D ** -0.5 * log2e,
                                                 HEAD_DIM=D, BLOCK_M=32, BLOCK_N=32, MUT=mut)
    return attention_v1


# -- ex4: causal + GQA ---------------------------------------------------------------------
@triton.jit
def _attn(Q, K, V, O, LSE, H, GROUP, S_q, S_kv, qk_scale, HEAD_DIM: tl.constexpr,
          CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MUT: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    H_kv = H // GROUP
    if MUT == 1:                                    # kv head h % H_kv
        hk = h % H_kv
    else:
        hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q_rows = bh * S_q + offs_m
    kv_rows = (b * H_kv + hk) * S_kv
    q = tl.load(Q + q_rows[:, None] * HEAD_DIM + offs_d[None, :], mask=offs_m[:, None] < S_q, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if CAUSAL and MUT != 5:
        if MUT == 6:                                # loop end without the S_kv - S_q shift
            end = tl.minimum(S_kv, (pid_m + 1) * BLOCK_M)
        else:
            end = tl.minimum(S_kv, (pid_m + 1) * BLOCK_M + S_kv - S_q)
    else:
        end = S_kv
    for start_n in range(0, end, BLOCK_N):
        cols = start_n + offs_n
        k = tl.load(K + (kv_rows + cols[:, None]) * HEAD_DIM + offs_d[None, :], mask=cols[:, None] < S_kv, other=0.0)
        v = tl.load(V + (kv_rows + cols[:, None]) * HEAD_DIM + offs_d[None, :], mask=cols[:, None] < S_kv, other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        if MUT == 4:                                # the causal mask replaces the key-range mask
            valid = cols[None, :] < 2147483647
        else:
            valid = cols[None, :] < S_kv
        if CAUSAL and MUT != 5:                     # 5: the causal flag ignored
            if MUT == 2:                            # the diagonal excluded (< instead of <=)
                valid = valid & (cols[None, :] < offs_m[:, None] + (S_kv - S_q))
            elif MUT == 3:                          # aligned top-left
                valid = valid & (cols[None, :] <= offs_m[:, None])
            else:
                valid = valid & (cols[None, :] <= offs_m[:, None] + (S_kv - S_q))
        s = tl.where(valid, s, float("-inf"))
        m_i, l_i, acc = online_update(m_i, l_i, acc, s, v, True, False, 0.0, False)
    o, lse = state_epilogue(m_i, l_i, acc)
    row_ok = offs_m < S_q
    tl.store(O + q_rows[:, None] * HEAD_DIM + offs_d[None, :], o.to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + q_rows, lse, mask=row_ok)


def _attn_launcher(mut=0):
    def my_attention(q, k, v, causal, o, lse):
        B, H, S_q, D = q.shape
        _attn[(triton.cdiv(S_q, 32), B * H)](q, k, v, o, lse, H, H // k.shape[1], S_q, k.shape[2], D ** -0.5 * LOG2E,
                                              HEAD_DIM=D, CAUSAL=bool(causal), BLOCK_M=32, BLOCK_N=32, MUT=mut)
    return my_attention


# -- ex5: exp2 from a cubic ----------------------------------------------------------------
@triton.jit
def _exp2_poly3(x, MUT: tl.constexpr):
    if MUT != 1:                                    # 1: no clamp at -127
        x = tl.maximum(x, -127.0)
    if MUT == 2:                                    # truncation toward zero instead of floor
        j = x.to(tl.int32).to(tl.float32)
    else:
        j = tl.floor(x)
    f = x - j
    if MUT == 3:                                    # Taylor coefficients of 2^f at 0
        p = 1.0 + f * (0.693147181 + f * (0.240226507 + f * 0.0555041087))
    elif MUT == 4:                                  # a coefficient typo
        p = 1.0 + f * (0.695146143 + f * (0.277564394 + f * 0.0771190897))
    else:
        p = 1.0 + f * (0.695146143 + f * (0.227564394 + f * 0.0771190897))
    if MUT == 5:                                    # the integer part never scales the result
        return p
    elif MUT == 6:                                  # the integer part added without << 23
        return (p.to(tl.int32, bitcast=True) + j.to(tl.int32)).to(tl.float32, bitcast=True)
    return (p.to(tl.int32, bitcast=True) + (j.to(tl.int32) << 23)).to(tl.float32, bitcast=True)


@triton.jit
def _exp2_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, MUT: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, _exp2_poly3(tl.load(x_ptr + offs, mask=mask, other=0.0), MUT), mask=mask)


def _exp2_launcher(mut):
    def my_exp2(x, y):
        _exp2_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024, MUT=mut)
    return my_exp2


MISTAKES += [
    Mistake("04/check-attention-v1", "flash_attention_noncausal", "K and V loaded without the key mask",
            _v1_launcher(1), ("a load past the end of input `k`", "a load past the end of input `v`")),
    Mistake("04/check-attention-v1", "flash_attention_noncausal", "scores past S_kv not masked", _v1_launcher(2),
            ("keys past S_kv in the last key tile",)),
    Mistake("04/check-attention-v1", "flash_attention_noncausal", "exp where qk_scale carries log2(e)",
            _v1_launcher(3), ("fed to exp",)),
    Mistake("04/check-attention-v1", "flash_attention_noncausal", "acc not rescaled when the max moves",
            _v1_launcher(4), ("acc rescaled by alpha",)),
    Mistake("04/check-attention-v1", "flash_attention_noncausal", "o never divided by l", _v1_launcher(5),
            ("unnormalised sum acc",)),
    Mistake("04/check-attention-v1", "flash_attention_noncausal", "lse left in base 2", _v1_launcher(6),
            ("LSE is in base 2",)),
    Mistake("04/check-attention-v1", "flash_attention_noncausal", "o stored without the row mask", _v1_launcher(7),
            ("past the end of output `o`",)),
    Mistake("04/check-attention-v1", "flash_attention_noncausal", "qk_scale without log2(e)",
            _v1_launcher(0, log2e=1.0), ("scale × ln 2",)),

    Mistake("04/check-attention", "flash_attention", "kv head h % Hkv", _attn_launcher(1), ("h % Hkv",)),
    Mistake("04/check-attention", "flash_attention", "causal mask excludes the diagonal", _attn_launcher(2),
            ("excludes the diagonal",)),
    Mistake("04/check-attention", "flash_attention", "causal mask aligned top-left", _attn_launcher(3),
            ("top-left",)),
    Mistake("04/check-attention", "flash_attention", "key-range mask dropped", _attn_launcher(4),
            ("keys past S_kv in the last key tile",)),
    Mistake("04/check-attention", "flash_attention", "causal flag ignored", _attn_launcher(5),
            ("causal mask the wrong way round",)),
    Mistake("04/check-attention", "flash_attention", "causal loop end without S_kv - S_q", _attn_launcher(6),
            ("causal key loop that stops too early",)),

    Mistake("04/check-exp2-poly3", "exp2_poly3", "no clamp at -127", _exp2_launcher(1), ("not clamped at -127",)),
    Mistake("04/check-exp2-poly3", "exp2_poly3", "truncation instead of floor", _exp2_launcher(2),
            ("truncation toward zero",)),
    Mistake("04/check-exp2-poly3", "exp2_poly3", "Taylor coefficients", _exp2_launcher(3), ("Taylor's coefficients",)),
    Mistake("04/check-exp2-poly3", "exp2_poly3", "a coefficient typo", _exp2_launcher(4), ("check each coefficient",)),
    Mistake("04/check-exp2-poly3", "exp2_poly3", "integer part never applied", _exp2_launcher(5),
            ("cubic of the fraction alone",)),
    Mistake("04/check-exp2-poly3", "exp2_poly3", "integer part added without << 23", _exp2_launcher(6),
            ("added to the bits without << 23",)),
]
