"""Ternary weights: quantization, exact 2-bit packing, the int8 × ternary kernels, the
BitLinear layer in both modes, input validation, and checks that reject wrong kernels."""
import json
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

import gpulab
from gpulab import bitlinear as bl
from gpulab import normquant as nq
from gpulab.harness.checking import rejects

from helpers import few, on_gpu


# -- quantize / pack -----------------------------------------------------------------------
def test_ternary_quantize_values_and_scale():
    w = torch.tensor([[0.3, -0.05, -2.0, 0.1]])
    w_t, s = bl.ternary_quantize(w)
    assert w_t.dtype == torch.int8 and s.dtype == torch.float32
    assert abs(float(s) - 1 / 0.6125) < 1e-6
    assert w_t.tolist() == [[0, 0, -1, 0]]      # 0.3·1.63 = 0.49 rounds to 0
    w_t, _ = bl.ternary_quantize(torch.zeros(3, 3))
    assert int(w_t.abs().max()) == 0              # the scale's floor avoids 0/0


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 7, 8, 33, 1001])
def test_pack_unpack_are_exact_inverses(device, k):
    w_t = torch.randint(-1, 2, (5, k), dtype=torch.int8, device=device)
    packed = bl.pack_ternary(w_t)
    assert packed.dtype == torch.uint8 and packed.shape == (5, triton.cdiv(k, 4))
    assert torch.equal(bl.unpack_ternary(packed, k), w_t)


def test_pack_layout_is_the_documented_one():
    # K = 8: quarters of 2 weights; byte j holds weights j, 2+j, 4+j, 6+j in bits 0-1, 2-3, 4-5, 6-7
    w_t = torch.tensor([[-1, 0, 1, 1, 0, -1, 1, 0]], dtype=torch.int8)
    codes = (w_t + 1).tolist()[0]
    expected = [codes[j] | codes[2 + j] << 2 | codes[4 + j] << 4 | codes[6 + j] << 6 for j in range(2)]
    assert bl.pack_ternary(w_t).tolist() == [expected]
    # padding weights are 0 (code 1): K = 1 -> quarters of 1, only the first holds data
    assert bl.pack_ternary(torch.tensor([[1]], dtype=torch.int8)).tolist() == [[2 | 1 << 2 | 1 << 4 | 1 << 6]]


def test_pack_and_unpack_reject_bad_input(device):
    with pytest.raises(ValueError, match="must be -1, 0 or 1"):
        bl.pack_ternary(torch.tensor([[0, 2]], dtype=torch.int8, device=device))
    with pytest.raises(TypeError, match="int8"):
        bl.pack_ternary(torch.zeros(2, 2, device=device))
    with pytest.raises(ValueError, match="2 dimensions"):
        bl.pack_ternary(torch.zeros(4, dtype=torch.int8, device=device))
    packed = bl.pack_ternary(torch.zeros(2, 9, dtype=torch.int8, device=device))
    with pytest.raises(ValueError, match="ceil"):
        bl.unpack_ternary(packed, 13)
    with pytest.raises(TypeError, match="float32"):
        bl.ternary_quantize(torch.zeros(2, 2, dtype=torch.int8, device=device))


def test_quantize_and_pack_pass_their_checks():
    gpulab.check("ternary_quantize", bl.ternary_quantize)
    gpulab.check("pack_ternary", bl.pack_ternary)


# -- kernels -------------------------------------------------------------------------------------
def test_gemv_passes_its_check():
    gpulab.check("ternary_gemv", bl.ternary_gemv_into)


def test_matmul_passes_its_check():
    gpulab.check("ternary_matmul", bl.ternary_matmul_into)


def test_tensor_core_path_passes_its_check():
    gpulab.check("ternary_mm", bl.ternary_mm_into)


def test_few_rows_path_passes_its_check():
    gpulab.check("ternary_mm_small", bl.ternary_mm_small_into)


@pytest.mark.parametrize("m, k, n", [(2, 13, 9), (16, 1030, 65), (37, 301, 70)])
def test_few_rows_unpacking_in_ptx_equals_its_portable_twin(m, k, n):
    """The four-at-a-time unpacking (inline PTX) against the byte-by-byte twin: the same
    integer sums, so the same bits; the interpreter refuses asm=True with a reason."""
    x_q, x_scale, w_t, w_scale = _x16_problem(m, k, n, seed=m + k)
    w_packed = bl.pack_ternary(w_t)
    ys = [torch.full((m, n), float("nan"), device=x_q.device) for _ in range(2)]
    bl.ternary_mm_small_into(x_q, x_scale, w_packed, w_scale, ys[0], asm=False)
    torch.testing.assert_close(ys[0].double(), bl.ternary_matmul_ref(x_q, x_scale, w_t, w_scale),
                               atol=1e-4, rtol=1e-5)
    if not on_gpu():
        with pytest.raises(ValueError, match="interpreter cannot run inline PTX"):
            bl.ternary_mm_small_into(x_q, x_scale, w_packed, w_scale, ys[1], asm=True)
        return
    bl.ternary_mm_small_into(x_q, x_scale, w_packed, w_scale, ys[1], asm=True)
    assert torch.equal(ys[0], ys[1])


@pytest.mark.parametrize("m, k, n, split_k", [(5, 1030, 70, 2), (37, 2100, 33, 3)])
def test_few_rows_split_k_gives_the_bits_of_one_pass(m, k, n, split_k):
    """Split-K (int32 partial sums, then the reduce) against one pass: exact integers, so
    the same bits; the last split is shorter than the others."""
    x_q, x_scale, w_t, w_scale = _x16_problem(m, k, n, seed=m * k)
    w_packed = bl.pack_ternary(w_t)
    ys = [torch.full((m, n), float("nan"), device=x_q.device) for _ in range(2)]
    bl.ternary_mm_small_into(x_q, x_scale, w_packed, w_scale, ys[0], config={"BLOCK_Q": 128})
    bl.ternary_mm_small_into(x_q, x_scale, w_packed, w_scale, ys[1], config={"BLOCK_Q": 128, "SPLIT_K": split_k})
    assert torch.equal(ys[0], ys[1])
    torch.testing.assert_close(ys[1].double(), bl.ternary_matmul_ref(x_q, x_scale, w_t, w_scale),
                               atol=1e-4, rtol=1e-5)


def test_few_rows_tile_follows_the_h200_sweeps():
    """small_mm_tile on an H200 (132 SMs, sm_90): the K = N = 8192 tile of the first
    sweep kept; 32-row tiles for 17-32 rows; K split where few tiles meet a long K."""
    def h200(m, n, k):
        return bl.small_mm_tile(m, n, k, 132, (9, 0))
    assert h200(16, 8192, 8192) == {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_Q": 256, "num_warps": 4, "num_stages": 4}
    assert h200(32, 11264, 2048)["BLOCK_M"] == 32
    assert h200(64, 2048, 5632)["SPLIT_K"] == 4
    assert "SPLIT_K" not in h200(64, 2048, 2048)                     # short K: narrower tiles instead
    assert h200(64, 11264, 2048)["num_stages"] == 2                  # 352 tiles: one wave of three an SM
    assert h200(64, 8192, 8192)["num_stages"] == 3                   # 256 tiles: two an SM fit
    assert bl.small_mm_tile(64, 11264, 2048, 40, (7, 5))["num_stages"] == 2      # a T4: 64 KiB of shared memory
    # past 64 rows: a large layer in 128-row tiles (each weight read once), K split while few
    assert h200(128, 8192, 8192) == {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_Q": 64, "num_warps": 4,
                                     "num_stages": 3, "SPLIT_K": 2}
    assert "SPLIT_K" not in h200(128, 14336, 4096)                   # 224 tiles: more than a wave
    assert h200(128, 11264, 2048)["BLOCK_M"] == 64                   # a 5.8 MB layer is not large
    assert h200(128, 2048, 5632)["SPLIT_K"] == 2
    assert h200(256, 11264, 2048)["BLOCK_M"] == 128
    t4 = bl.small_mm_tile(256, 8192, 8192, 40, (7, 5))
    assert t4["BLOCK_M"] == 64 and t4["num_stages"] == 2


@pytest.mark.parametrize("sweep, shapes", [("few_rows_split_probe.json", 12), ("many_rows_probe.json", 16)])
def test_few_rows_tiles_shipped_sweep_agrees_with_the_rule(sweep, shapes):
    """The sweeps saved with the package (H200; 16 to 64 rows on the engine model's layers,
    128 and 256 rows on those and on larger ones): for every (M, layer) the tile the rule
    picks was measured, bit-equal, and within 5% of the best."""
    saved = json.loads((Path(bl.__file__).parent / "results" / "bitlinear" / sweep).read_text())
    key = ("BLOCK_M", "BLOCK_N", "BLOCK_Q", "num_stages")
    timed = {}
    for r in saved["rows"]:
        if r["impl"] == "small" and r["us"] == r["us"]:
            c = r["config"]
            timed[(r["m"], r["n"], r["k"], *(c[x] for x in key), c.get("SPLIT_K", 1))] = r["us"]
    measured = {(r["m"], r["n"], r["k"]) for r in saved["rows"]}
    assert len(measured) == shapes
    for m, n, k in measured:
        pick = bl.small_mm_tile(m, n, k, 132, (9, 0))
        us = timed[(m, n, k, *(pick[x] for x in key), pick.get("SPLIT_K", 1))]
        best = min(v for (mm, nn, kk, *_), v in timed.items() if (mm, nn, kk) == (m, n, k))
        assert us <= 1.05 * best, (m, n, k, pick, us, best)


def test_dispatcher_sends_two_to_256_rows_to_the_few_rows_kernel(device, monkeypatch):
    calls = []
    monkeypatch.setattr(bl, "ternary_mm_small_into", lambda *a: calls.append(a[0].shape[0]))
    monkeypatch.setattr(bl, "ternary_mm_into", lambda *a: calls.append(-a[0].shape[0]))
    monkeypatch.setattr(bl, "ternary_gemv_into", lambda *a: None)
    monkeypatch.setattr(bl, "unpack_min_m", lambda: None)
    w_packed = bl.pack_ternary(torch.ones(5, 12, dtype=torch.int8, device=device))
    for m in (1, 2, bl.SMALL_MM_MAX_M, bl.SMALL_MM_MAX_M + 1):
        x = torch.ones(m, 12, dtype=torch.int8, device=device)
        bl.ternary_matmul_into(x, torch.ones(m, device=device), w_packed, torch.ones(1, device=device),
                               torch.empty(m, 5, device=device))
    assert calls == [2, bl.SMALL_MM_MAX_M, -(bl.SMALL_MM_MAX_M + 1)]


def test_unpacked_prefill_path_passes_its_check():
    gpulab.check("ternary_mm_unpacked", bl.ternary_mm_unpacked_into)


@pytest.mark.parametrize("n, k", [(1, 1), (3, 7), (5, 16), (33, 130), (2, 1001)])
def test_unpack_to_int8_is_exact_and_stays_in_its_buffer(device, n, k):
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w_t = (torch.randint(0, 3, (n, k), generator=gen) - 1).to(torch.int8).to(device)
    w_t[0, -1] = 1                                        # a weight in the last column
    out = torch.full((n, k + 5), 77, dtype=torch.int8, device=device)
    bl.unpack_ternary_int8_into(bl.pack_ternary(w_t), out[:, :k])
    assert torch.equal(out[:, :k], w_t)
    assert (out[:, k:] == 77).all()                       # the padding weights are not written


def test_dispatcher_takes_the_unpacked_path_from_its_threshold(device, monkeypatch):
    calls = []
    monkeypatch.setattr(bl, "ternary_mm_unpacked_into", lambda *a: calls.append(a[0].shape[0]))
    threshold = bl.SMALL_MM_MAX_M + 2
    monkeypatch.setattr(bl, "unpack_min_m", lambda: threshold)
    w_packed = bl.pack_ternary(torch.ones(5, 12, dtype=torch.int8, device=device))
    for m in (threshold - 1, threshold):
        x = torch.ones(m, 12, dtype=torch.int8, device=device)
        bl.ternary_matmul_into(x, torch.ones(m, device=device), w_packed, torch.ones(1, device=device),
                               torch.empty(m, 5, device=device))
    assert calls == [threshold]


def test_unpacked_and_per_tile_prefill_agree_exactly(device):
    gen = torch.Generator().manual_seed(3)
    m, k, n = 70, 257, 45
    x_q = torch.randint(-127, 128, (m, k), generator=gen, dtype=torch.int8).to(device)
    x_scale = (torch.rand(m, generator=gen) + 0.5).to(device)
    w_t = (torch.randint(0, 3, (n, k), generator=gen) - 1).to(torch.int8).to(device)
    w_packed, w_scale = bl.pack_ternary(w_t), torch.tensor([0.7], device=device)
    ys = [torch.empty(m, n, device=device) for _ in range(2)]
    bl.ternary_mm_into(x_q, x_scale, w_packed, w_scale, ys[0])
    bl.ternary_mm_unpacked_into(x_q, x_scale, w_packed, w_scale, ys[1])
    assert torch.equal(ys[0], ys[1])         # the same integer sums, the same scaling


@pytest.mark.parametrize("m, k, n, split", [(3, 2100, 20, 2), (16, 4099, 33, 5), (2, 1030, 7, 3)])
def test_tensor_core_split_k_is_bit_identical_to_one_pass(m, k, n, split):
    """Split-K for a few rows: exact int32 partial sums, added in order and scaled once,
    give the same bits as one pass (the last split shorter than the others, K not /4)."""
    x_q, x_scale, w_t, w_scale = _x16_problem(m, k, n, seed=m * 100 + k)
    w_packed = bl.pack_ternary(w_t)
    ys = [torch.full((m, n), float("nan"), device=x_q.device) for _ in range(2)]
    bl.ternary_mm_into(x_q, x_scale, w_packed, w_scale, ys[0], split_k=1)
    bl.ternary_mm_into(x_q, x_scale, w_packed, w_scale, ys[1], split_k=split)
    assert torch.equal(ys[0], ys[1])
    ref = bl.ternary_matmul_ref(x_q, x_scale, w_t, w_scale)
    torch.testing.assert_close(ys[1].double(), ref, atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="split_k"):
        bl.ternary_mm_into(x_q, x_scale, w_packed, w_scale, ys[1], split_k=0)


@pytest.mark.parametrize("lead, k, n", [((1,), 5, 3), ((2, 3), 301, 40), ((20,), 130, 17)]
                         + ([((4, 1000), 4099, 3001)] if on_gpu() else []))
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_ternary_matmul_public(device, lead, k, n, out_dtype):
    x = torch.randn(*lead, k, device=device)
    x_q, x_s = nq.absmax_quantize(x)
    w_t, w_s = bl.ternary_quantize(torch.randn(n, k, device=device))
    y = bl.ternary_matmul(x_q, x_s.float(), bl.pack_ternary(w_t), w_s, out_dtype=out_dtype)
    assert y.shape == (*lead, n) and y.dtype == out_dtype
    ref = bl.ternary_matmul_ref(x_q.reshape(-1, k), x_s.reshape(-1), w_t, w_s).reshape(*lead, n)
    tol = 1e-5 if out_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y.double(), ref, atol=tol, rtol=tol)
    # a python float scale works too
    y2 = bl.ternary_matmul(x_q, x_s.float(), bl.pack_ternary(w_t), float(w_s), out_dtype=out_dtype)
    torch.testing.assert_close(y2, y)


def test_ternary_matmul_rejects_bad_input(device):
    x_q = torch.zeros(2, 10, dtype=torch.int8, device=device)
    x_s = torch.ones(2, device=device)
    w = bl.pack_ternary(torch.zeros(4, 10, dtype=torch.int8, device=device))
    s = torch.ones(1, device=device)
    with pytest.raises(TypeError, match="x_q must be int8"):
        bl.ternary_matmul(x_q.float(), x_s, w, s)
    with pytest.raises(ValueError, match=r"x_scale must have shape \(2,\)"):
        bl.ternary_matmul(x_q, torch.ones(3, device=device), w, s)
    with pytest.raises(ValueError, match="ceil"):
        bl.ternary_matmul(x_q, x_s, bl.pack_ternary(torch.zeros(4, 20, dtype=torch.int8, device=device)), s)
    with pytest.raises(TypeError, match="uint8"):
        bl.ternary_matmul(x_q, x_s, w.to(torch.int8), s)
    with pytest.raises(ValueError, match="one number"):
        bl.ternary_matmul(x_q, x_s, w, torch.ones(4, device=device))
    with pytest.raises(TypeError, match="out_dtype"):
        bl.ternary_matmul(x_q, x_s, w, s, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="contiguous"):
        bl.ternary_matmul(torch.zeros(10, 2, dtype=torch.int8, device=device).t(), x_s, w, s)



def test_the_fast_argument_check_accepts_nothing_the_full_checks_reject(device):
    """ternary_matmul tests its arguments with a few attribute reads first and runs the
    full checks (which explain the error) only when that fails: every call the full
    checks reject must fail the fast test too, and the usual calls must pass it."""
    x_q = torch.zeros(2, 10, dtype=torch.int8, device=device)
    x_s, s = torch.ones(2, device=device), torch.ones(1, device=device)
    w = bl.pack_ternary(torch.zeros(4, 10, dtype=torch.int8, device=device))
    w32 = bl.pack_ternary_x16(torch.zeros(4, 10, dtype=torch.int8, device=device))
    good = [(x_q, x_s, w, s, torch.bfloat16), (x_q, x_s, w32, s, torch.float32),
            (x_q[None], x_s[None], w, s.reshape(()), torch.float16)]
    bad = [(x_q.float(), x_s, w, s, torch.bfloat16), (x_q, torch.ones(3, device=device), w, s, torch.bfloat16),
           (x_q, x_s.double(), w, s, torch.bfloat16), (x_q, x_s, w[:, :2], s, torch.bfloat16),
           (x_q, x_s, w.to(torch.int8), s, torch.bfloat16), (x_q, x_s, w, torch.ones(4, device=device), torch.bfloat16),
           (x_q, x_s, w, s, torch.int32), (torch.zeros(10, 2, dtype=torch.int8, device=device).t(), x_s, w, s,
                                           torch.bfloat16),
           (x_q, torch.ones(2, 2, device=device)[:, 0], w, s, torch.bfloat16),
           (x_q, x_s, bl.pack_ternary(torch.zeros(10, 4, dtype=torch.int8, device=device)).t(), s, torch.bfloat16),
           (x_q, x_s, w, s.double(), torch.bfloat16), (x_q, x_s, w, 0.5, torch.bfloat16),
           (torch.zeros((), dtype=torch.int8, device=device), torch.ones((), device=device), w, s, torch.bfloat16),
           (torch.zeros(2, 0, dtype=torch.int8, device=device), x_s, w[:, :0], s, torch.bfloat16),
           (x_q.cpu() if device.type != "cpu" else x_q.to("meta"), x_s, w, s, torch.bfloat16),
           (x_q.numpy() if device.type == "cpu" else x_q.cpu().numpy(), x_s, w, s, torch.bfloat16)]
    for args in good:
        assert bl.plainly_valid_matmul_args(*args), args
    for i, args in enumerate(bad):
        assert not bl.plainly_valid_matmul_args(*args), f"bad call {i} passes the fast check"
        if i != 11:            # a Python float scale is valid: it takes the full path
            with pytest.raises((TypeError, ValueError)):
                bl.ternary_matmul(*args[:4], out_dtype=args[4])

# -- the layer ------------------------------------------------------------------------------------
def test_bitlinear_train_and_packed_modes_agree(device):
    torch.manual_seed(0)
    layer = bl.BitLinear(67, 45).to(device)
    x = torch.randn(2, 3, 67, device=device)
    y = layer(x)
    assert y.shape == (2, 3, 45) and y.dtype == torch.float32
    y.square().mean().backward()
    assert layer.weight.grad.abs().sum() > 0 and layer.norm_weight.grad.abs().sum() > 0
    with torch.no_grad():
        y_train = layer(x)
    layer.pack()
    assert layer.weight is None and layer.w_packed.dtype == torch.uint8 and "packed" in repr(layer)
    y_packed = layer(x)
    torch.testing.assert_close(y_packed, y_train, atol=1e-4, rtol=1e-4)
    # decode-sized and prefill-sized inputs take the two kernel paths
    x_long = torch.randn(40, 67, device=device)
    with torch.no_grad():
        assert layer(x_long).shape == (40, 45)


def test_bitlinear_fused_training_path_matches_reference(device):
    torch.manual_seed(1)
    a = bl.BitLinear(33, 8, fused=True).to(device)
    b = bl.BitLinear(33, 8, fused=False).to(device)
    b.load_state_dict(a.state_dict())
    x = torch.randn(5, 33, device=device)
    ya, yb = a(x), b(x)
    torch.testing.assert_close(ya, yb, atol=1e-4, rtol=1e-4)
    ya.sum().backward()
    yb.sum().backward()
    torch.testing.assert_close(a.weight.grad, b.weight.grad, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(a.norm_weight.grad, b.norm_weight.grad, atol=1e-3, rtol=1e-3)


def test_bitlinear_keeps_dtype_and_bias(device):
    dtype = torch.bfloat16
    layer = bl.BitLinear(16, 4, bias=True).to(device=device, dtype=dtype)
    x = torch.randn(3, 16, device=device, dtype=dtype)
    assert layer(x).dtype == dtype
    layer.pack()
    assert layer(x).dtype == dtype and layer(x).shape == (3, 4)
    layer.to(torch.float16)            # converts the scale buffer too: forward must still work
    assert layer(x.half()).dtype == torch.float16


def test_bitlinear_rejects_bad_input(device):
    layer = bl.BitLinear(8, 4).to(device)
    with pytest.raises(ValueError, match=r"\[\.\.\., 8\]"):
        layer(torch.randn(3, 7, device=device))
    with pytest.raises(TypeError, match="float32"):
        layer(torch.zeros(3, 8, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match=">= 1"):
        bl.BitLinear(0, 4)


def test_model_bytes():
    assert bl.model_bytes(8, 2) == 2 and bl.model_bytes(10, 16) == 20


# -- wrong kernels the checks must reject --------------------------------------------------------------
@triton.jit
def _gemv_bug(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, N, K, Q, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr,
              BUG: tl.constexpr):
    m = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    acc = tl.zeros([BLOCK_N], dtype=tl.int32)
    for j0 in range(0, Q, BLOCK_Q):
        j = j0 + tl.arange(0, BLOCK_Q)
        j_mask = j < Q
        b = tl.load(w_ptr + n[:, None] * Q + j[None, :], mask=n_mask[:, None] & j_mask[None, :],
                    other=0).to(tl.int32)
        for i in tl.static_range(4):
            k = i * Q + j
            if BUG == 1:     # no mask on x: past the row, x meets the masked (code 0 = -1) bytes
                xi = tl.load(x_ptr + m * K + k).to(tl.int32)
            elif BUG == 5:   # masks k < K but not j < Q: the next quarter's x leaks in
                xi = tl.load(x_ptr + m * K + k, mask=k < K, other=0).to(tl.int32)
            else:
                xi = tl.load(x_ptr + m * K + k, mask=j_mask & (k < K), other=0).to(tl.int32)
            if BUG == 6:     # quarters in the wrong order
                wi = ((b >> (6 - 2 * i)) & 3) - 1
            elif BUG == 7:   # forgets the code offset
                wi = (b >> (2 * i)) & 3
            else:
                wi = ((b >> (2 * i)) & 3) - 1
            acc += tl.sum(wi * xi[None, :], axis=1)
    xs = tl.load(xs_ptr + m)
    if BUG == 4:         # x_scale never read
        xs = 1.0
    y = acc.to(tl.float32) / (xs * tl.load(ws_ptr))
    if BUG == 2:         # multiplies by the scales instead of dividing
        y = acc.to(tl.float32) * (xs * tl.load(ws_ptr))
    if BUG == 3:
        tl.store(y_ptr + m * N + n, y.to(y_ptr.dtype.element_ty))
    else:
        tl.store(y_ptr + m * N + n, y.to(y_ptr.dtype.element_ty), mask=n_mask)


def _gemv_launcher(bug):
    def fn(x_q, x_scale, w_packed, w_scale, y):
        m, k = x_q.shape
        n, q = w_packed.shape
        _gemv_bug[(m, triton.cdiv(n, 64))](x_q, x_scale, w_packed, w_scale, y, n, k, q,
                                           BLOCK_N=64, BLOCK_Q=256, BUG=bug)
    return fn


def test_gemv_reference_launcher_is_right():
    gpulab.check("ternary_gemv", _gemv_launcher(0), **few("ternary_gemv", ("K not /4", "ragged")))


@pytest.mark.parametrize("bug, words", [
    (1, "past the end of"), (2, "is wrong"), (3, "past the end of output `y`"), (4, "own constant factor"),
    (5, "is wrong"), (6, "is wrong"), (7, "is wrong"),
])
def test_gemv_check_rejects(bug, words):
    msg = rejects("ternary_gemv", _gemv_launcher(bug), **few("ternary_gemv", ("K not /4", "ragged")))
    assert words in msg, msg


def _quantize_truncating(w):
    s = 1.0 / w.float().abs().mean().clamp_min(1e-5)
    return (w.float() * s).trunc().clamp(-1, 1).to(torch.int8), s


def _quantize_no_clamp(w):
    s = 1.0 / w.float().abs().mean().clamp_min(1e-5)
    return nq.round_half_away(w.float() * s).to(torch.int8), s


def _quantize_absmax(w):
    s = 1.0 / w.float().abs().max()
    return nq.round_half_away(w.float() * s).clamp(-1, 1).to(torch.int8), s


@pytest.mark.parametrize("fn, words", [
    (_quantize_truncating, "`w_t` is wrong"), (_quantize_no_clamp, "`w_t` is wrong"),
    (_quantize_absmax, "`w_scale` is wrong"),
])
def test_quantize_check_rejects(fn, words):
    msg = rejects("ternary_quantize", fn, **few("ternary_quantize", ("odd", "wide", "big")))
    assert words in msg, msg


def _pack_bits_reversed(w_t):
    n, k = w_t.shape
    q = triton.cdiv(k, 4)
    codes = torch.ones((n, 4 * q), dtype=torch.uint8, device=w_t.device)
    codes[:, :k] = (w_t + 1).to(torch.uint8)
    c = codes.view(n, 4, q)
    return (c[:, 0] << 6) | (c[:, 1] << 4) | (c[:, 2] << 2) | c[:, 3]


def _pack_zero_padding(w_t):
    n, k = w_t.shape
    q = triton.cdiv(k, 4)
    codes = torch.zeros((n, 4 * q), dtype=torch.uint8, device=w_t.device)   # code 0 = weight -1!
    codes[:, :k] = (w_t + 1).to(torch.uint8)
    c = codes.view(n, 4, q)
    return c[:, 0] | (c[:, 1] << 2) | (c[:, 2] << 4) | (c[:, 3] << 6)


def _pack_consecutive(w_t):
    """Four consecutive weights per byte: a valid layout, but not the documented one."""
    n, k = w_t.shape
    q = triton.cdiv(k, 4)
    codes = torch.ones((n, 4 * q), dtype=torch.uint8, device=w_t.device)
    codes[:, :k] = (w_t + 1).to(torch.uint8)
    c = codes.view(n, q, 4)
    return c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)


@pytest.mark.parametrize("fn", [_pack_bits_reversed, _pack_zero_padding, _pack_consecutive])
def test_pack_check_rejects(fn):
    msg = rejects("pack_ternary", fn)
    assert "`packed` is wrong" in msg, msg


# -- the int32x16 decode layout and its GEMV ------------------------------------------------------
@pytest.mark.parametrize("n, k", [(1, 1), (3, 15), (5, 16), (4, 17), (7, 33), (5, 1001), (2, 4096)])
def test_pack_x16_unpack_are_exact_inverses(device, n, k):
    w_t = torch.randint(-1, 2, (n, k), dtype=torch.int8, device=device)
    packed = bl.pack_ternary_x16(w_t)
    assert packed.dtype == torch.int32 and packed.shape == (n, triton.cdiv(k, 16))
    assert torch.equal(bl.unpack_ternary_x16(packed, k), w_t)


@pytest.mark.parametrize("value", [-1, 0, 1])
def test_pack_x16_constant_matrices(value):
    # K = 48: every 2-bit field is a real weight, so every word is one code repeated
    # (all -1: code 0, all 0: code 1, all +1: code 2)
    w_t = torch.full((3, 48), value, dtype=torch.int8)
    packed = bl.pack_ternary_x16(w_t)
    assert torch.equal(bl.unpack_ternary_x16(packed, 48), w_t)
    assert (packed == {-1: 0, 0: 0x55555555, 1: 0xAAAAAAAA - 2 ** 32}[value]).all()
    # K = 37: G = 3 words, quarters of 12; fields with k >= 37 hold padding (weight 0)
    w_t = torch.full((2, 37), value, dtype=torch.int8)
    packed = bl.pack_ternary_x16(w_t)
    assert torch.equal(bl.unpack_ternary_x16(packed, 37), w_t)
    padded = bl.unpack_ternary_x16(packed, 48)
    assert (padded[:, :37] == value).all() and (padded[:, 37:] == 0).all()


def test_pack_x16_layout_is_the_documented_one():
    # K = 32: G = 2 words, quarters of 8 weights; word g, quarter i, lane t holds
    # weight 4(iG + g) + t in bits 8t + 2i
    torch.manual_seed(3)
    w_t = torch.randint(-1, 2, (1, 32), dtype=torch.int8)
    codes = (w_t[0] + 1).tolist()
    expected = []
    for g in range(2):
        word = sum(codes[4 * (i * 2 + g) + t] << (8 * t + 2 * i) for i in range(4) for t in range(4))
        expected.append(word - 2 ** 32 if word >= 2 ** 31 else word)
    assert bl.pack_ternary_x16(w_t).tolist() == [expected]


def test_pack_x16_rejects_bad_input(device):
    with pytest.raises(ValueError, match="must be -1, 0 or 1"):
        bl.pack_ternary_x16(torch.tensor([[0, 2]], dtype=torch.int8, device=device))
    packed = bl.pack_ternary_x16(torch.zeros(2, 17, dtype=torch.int8, device=device))
    with pytest.raises(ValueError, match=r"ceil\(k/16\) == 2"):
        bl.unpack_ternary_x16(packed, 33)
    with pytest.raises(TypeError, match="int32"):
        bl.unpack_ternary_x16(packed.to(torch.int64), 17)


def test_gemv_x16_passes_its_check():
    gpulab.check("ternary_gemv_x16", bl.ternary_gemv_x16_into)


def test_mm_x16_passes_its_check():
    gpulab.check("ternary_mm_x16", bl.ternary_mm_x16_into)


def _x16_problem(m, k, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x_q, x_s = nq.absmax_quantize(torch.randn(m, k, generator=g))
    w = torch.randn(n, k, generator=g) * (torch.rand(n, k, generator=g) > 0.3)
    w_t, w_s = bl.ternary_quantize(w)
    dev = gpulab.device()
    return (x_q.to(dev), x_s.float().to(dev), w_t.to(dev), w_s.reshape(1).float().to(dev))


@pytest.mark.parametrize("m, k, n, split", [
    (1, 4096, 64, 1),        # EVEN: no masks
    (1, 4096, 64, 3),        # split-K, EVEN
    (2, 2050, 70, 2),        # split-K with every mask (K not /16, N not /BLOCK_N)
    (1, 1030, 5, 5),         # K % 4 != 0: x is copied with zero padding
])
def test_gemv_x16_split_k_is_bit_identical_to_the_byte_gemv(m, k, n, split):
    x_q, x_s, w_t, w_s = _x16_problem(m, k, n)
    y_new = torch.empty(m, n, device=x_q.device)
    y_old = torch.empty(m, n, device=x_q.device)
    bl.ternary_gemv_x16_into(x_q, x_s, bl.pack_ternary_x16(w_t), w_s, y_new, split_k=split)
    bl.ternary_gemv_into(x_q, x_s, bl.pack_ternary(w_t), w_s, y_old)
    assert torch.equal(y_new, y_old)       # exact int32 sums, one scaling: the same bits


@pytest.mark.skipif(not on_gpu(), reason="dp4a inline PTX runs only compiled on a GPU")
@pytest.mark.parametrize("m, k, n, split", [(1, 8192, 1024, None), (3, 4099, 1000, 1), (1, 4096, 512, 4)])
def test_gemv_x16_dp4a_and_portable_twin_agree_on_gpu(m, k, n, split):
    x_q, x_s, w_t, w_s = _x16_problem(m, k, n, seed=5)
    w32 = bl.pack_ternary_x16(w_t)
    ys = []
    for asm in (True, False):
        ys.append(torch.empty(m, n, device=x_q.device))
        bl.ternary_gemv_x16_into(x_q, x_s, w32, w_s, ys[-1], split_k=split, asm=asm)
    assert torch.equal(ys[0], ys[1])


def test_gemv_x16_strided_x_rows():
    # rows padded to 4100 bytes (4-byte aligned, not K): the int32 view still applies
    x_q, x_s, w_t, w_s = _x16_problem(2, 4096, 64, seed=1)
    x_pad = torch.zeros(2, 4100, dtype=torch.int8, device=x_q.device)
    x_pad[:, :4096] = x_q
    y_a = torch.empty(2, 64, device=x_q.device)
    y_b = torch.empty(2, 64, device=x_q.device)
    bl.ternary_gemv_x16_into(x_pad[:, :4096], x_s, bl.pack_ternary_x16(w_t), w_s, y_a)
    bl.ternary_gemv_x16_into(x_q, x_s, bl.pack_ternary_x16(w_t), w_s, y_b)
    assert torch.equal(y_a, y_b)


def test_dot4_portable_twin_matches_dp4a_semantics():
    """dp4a.u32.s32: a's bytes unsigned, b's signed; the twin must agree on extremes."""
    @triton.jit
    def k(a_ptr, b_ptr, c_ptr, o_ptr, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(o_ptr + i, bl.dot4_u8s8(tl.load(a_ptr + i), tl.load(b_ptr + i), tl.load(c_ptr + i), False))

    g = torch.Generator().manual_seed(0)
    a = torch.randint(-2 ** 31, 2 ** 31 - 1, (64,), generator=g, dtype=torch.int64)
    b = torch.randint(-2 ** 31, 2 ** 31 - 1, (64,), generator=g, dtype=torch.int64)
    a[:4] = torch.tensor([-1, 0x80808080 - 2 ** 32, 0x7F7F7F7F, 0])
    b[:4] = torch.tensor([0x80808080 - 2 ** 32, -1, 0x7F7F7F7F, 0x01020304])
    c = torch.randint(-2 ** 20, 2 ** 20, (64,), generator=g, dtype=torch.int64)
    out = torch.empty(64, dtype=torch.int32)
    if gpulab.mode() == "compiled":
        pytest.skip("interpreter check of the portable twin (the GPU runs the spec check on dp4a)")
    k[(1,)](a.to(torch.int32), b.to(torch.int32), c.to(torch.int32), out, BLOCK=64)
    au = a & 0xFFFFFFFF
    bu = b & 0xFFFFFFFF
    want = c.clone()
    for t in range(4):
        ab = (au >> (8 * t)) & 0xFF
        bb = (bu >> (8 * t)) & 0xFF
        want += ab * torch.where(bb >= 128, bb - 256, bb)
    assert torch.equal(out.to(torch.int64), want)


def test_gemv_x16_rejects_bad_calls():
    x_q, x_s, w_t, w_s = _x16_problem(1, 64, 8)
    y = torch.empty(1, 8, device=x_q.device)
    with pytest.raises(ValueError, match="split_k"):
        bl.ternary_gemv_x16_into(x_q, x_s, bl.pack_ternary_x16(w_t), w_s, y, split_k=0)
    if gpulab.mode() == "interpreter":
        with pytest.raises(ValueError, match="inline PTX"):
            bl.ternary_gemv_x16_into(x_q, x_s, bl.pack_ternary_x16(w_t), w_s, y, asm=True)


def test_ternary_matmul_takes_either_layout(device):
    x_q, x_s, w_t, w_s = _x16_problem(3, 100, 20, seed=2)
    y8 = bl.ternary_matmul(x_q, x_s, bl.pack_ternary(w_t), w_s, out_dtype=torch.float32)
    y32 = bl.ternary_matmul(x_q, x_s, bl.pack_ternary_x16(w_t), w_s, out_dtype=torch.float32)
    torch.testing.assert_close(y32, y8, atol=1e-5, rtol=1e-5)
    assert bl.ternary_layout(bl.pack_ternary_x16(w_t), 100) == "int32x16"
    assert bl.ternary_layout(bl.pack_ternary(w_t), 100) == "uint8x4"
    with pytest.raises(ValueError, match=r"int32x16.*ceil\(K/16\) = 7"):
        bl.ternary_matmul(x_q, x_s, bl.pack_ternary_x16(w_t[:, :90].contiguous()), w_s)
    with pytest.raises(TypeError, match="uint8 .*int32"):
        bl.ternary_matmul(x_q, x_s, bl.pack_ternary_x16(w_t).to(torch.int64), w_s)


def test_bitlinear_pack_int32x16(device):
    torch.manual_seed(4)
    a = bl.BitLinear(67, 45).to(device)
    b = bl.BitLinear(67, 45).to(device)
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 67, device=device)
    a.pack()
    b.pack(layout="int32x16")
    assert a.layout == "uint8x4" and b.layout == "int32x16" and "int32x16" in repr(b)
    assert b.w_packed.dtype == torch.int32 and b.w_packed.shape == (45, 5)
    torch.testing.assert_close(b(x), a(x), atol=1e-5, rtol=1e-5)
    x_long = torch.randn(40, 67, device=device)                 # prefill: the tensor-core kernel
    torch.testing.assert_close(b(x_long), a(x_long), atol=1e-5, rtol=1e-5)
    assert b.pack(layout="int32x16") is b                      # packing twice the same way: no-op
    with pytest.raises(ValueError, match="one-way"):
        b.pack(layout="uint8x4")
    with pytest.raises(ValueError, match="layout must be one of 'uint8x4', 'int32x16'"):
        bl.BitLinear(8, 4).pack(layout="int4")


def test_a_t4_takes_the_one_x16_prefill_tile_that_compiles_in_seconds(monkeypatch):
    """Turing has no int8 dots; its float16 path took ptxas minutes at the tuned tiles, so
    an sm_75 GPU launches the int32x16 prefill with TURING_X16_TILE, untuned; sm_80 on
    tunes with int8 dots as before."""
    calls = []
    monkeypatch.setattr(bl.runtime, "interpreting", lambda: False)
    monkeypatch.setattr(bl.runtime, "launch", lambda fn, grid, config, *a, **kw: calls.append((fn, config, kw)))
    monkeypatch.setattr(bl.runtime, "launch_tuned", lambda kernel, grid, key, *a, **kw: calls.append((kernel, None, kw)))
    x_q, x_scale = torch.zeros((40, 64), dtype=torch.int8), torch.ones(40)
    w_packed, w_scale, y = torch.zeros((32, 4), dtype=torch.int32), torch.ones(1), torch.empty((40, 32))
    for cc in ((7, 5), (8, 0)):
        monkeypatch.setattr(bl.runtime, "compute_capability", lambda cc=cc: cc)
        bl.ternary_mm_x16_into(x_q, x_scale, w_packed, w_scale, y)
    assert calls == [(bl.ternary_mm_x16_kernel, bl.TURING_X16_TILE, {"DOT_INT8": False}),
                     (bl._ternary_mm_x16_tuned, None, {"DOT_INT8": True})]
