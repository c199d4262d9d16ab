"""Grading of notebook 03 (:mod:`gpulab.mlgru`): inputs, cases, baselines and the specs
of the scan kernels (forward and backward: recurrent, chunked and two-phase), of the scan the rule
picks, and of forward + backward through autograd. The references are
:func:`gpulab.mlgru.scan_reference` and :func:`gpulab.mlgru.scan_backward_reference`
(float64 loops over time)."""
from __future__ import annotations

import importlib.util

import torch

from ..harness.bench import cuda_graph_replay
from ..harness.checking import Hypothesis, hypotheses_hint, narrowed_hint
from ..harness.spec import Case, KernelSpec, bytes_of, randn
from ..mlgru import (mlgru_scan, scan_backward_chunked_into, scan_backward_recurrent_into,
                     scan_backward_reference, scan_backward_two_phase_into, scan_chunked_into, scan_into,
                     scan_recurrent_into, scan_reference, scan_torch, scan_two_phase_into)
from ..validate import FLOAT_DTYPES


# -- references (float64) -----------------------------------------------------------------
def mlgru_scan_train_reference(f, i, h0, dh, dh_last):
    out = scan_reference(f, i, h0)
    grads = scan_backward_reference(f, h0, out["h"].to(f.dtype), dh, dh_last)
    return {**out, "df": grads["df"], "di": grads["di"], "dh0": grads["dh0"]}


# -- diagnoses: the scan recomputed under plausible mistakes -----------------------------
def _scan_variant(f, i, h0, *, step=None, store_before=False, reverse=False):
    """scan_reference with one mistake: ``step(f, h, i)`` for the update; states stored
    before the update; time reversed."""
    f64, i64 = f.double(), i.double()
    if reverse:
        f64, i64 = f64.flip(1), i64.flip(1)
    h = h0.double()
    out = torch.empty_like(f64)
    for t in range(f.shape[1]):
        prev = h
        h = step(f64[:, t], h, i64[:, t]) if step else f64[:, t] * h + i64[:, t]
        out[:, t] = prev if store_before else h
    if reverse:
        out = out.flip(1)
    return {"h": out, "h_last": h}


def _chunk_variant(f, i, h0, tile, *, carry="decayed", combine="right"):
    """The scan in chunks of ``tile`` steps with one mistake: the carried state enters as
    ``carry`` ("none": lost, every chunk starts from 0, the first one too; "plain": added
    without its decay), or the combine is ``"swapped"``. All chunks at once: a loop over
    the ``tile`` steps of a chunk, then one over the chunks."""
    B, T, D = f.shape
    n = -(-T // tile)
    pad = (0, 0, 0, n * tile - T)      # padded steps (f = 1, i = 0) leave every state unchanged
    f64 = torch.nn.functional.pad(f.double(), pad, value=1.0).view(B, n, tile, D)
    i64 = torch.nn.functional.pad(i.double(), pad).view(B, n, tile, D)
    local, decay = torch.zeros(B, n, D, dtype=torch.float64), torch.ones(B, n, D, dtype=torch.float64)
    locals_, decays = torch.empty_like(f64), torch.empty_like(f64)
    for t in range(tile):
        if combine == "swapped":     # (a1·a2, a1·b2 + b1): the affine maps composed the other way
            local = local + decay * i64[:, :, t]
        else:
            local = f64[:, :, t] * local + i64[:, :, t]
        decay = decay * f64[:, :, t]
        locals_[:, :, t], decays[:, :, t] = local, decay
    out = torch.empty_like(f64)
    h = h0.double()
    for c in range(n):
        carried = torch.zeros_like(h) if carry == "none" else h
        out[:, c] = locals_[:, c] + (carried[:, None] if carry == "plain" else decays[:, c] * carried[:, None])
        h = out[:, c, -1]
    return {"h": out.view(B, n * tile, D)[:, :T], "h_last": h}


def _tiles(T: int, whole: bool = False):
    """The chunk lengths a kernel may have used: every power of two from 2 below T (a
    BLOCK_T of the chunked kernel's configs, the two-phase chunk, 8 in the interpreter and
    256 on a GPU, or the learner's own), and with ``whole`` the first one that is not."""
    tile = 2
    while tile < T:
        yield tile
        tile *= 2
    if whole:
        yield tile


def _tiled(**kw):
    def answer(inp):
        for tile in _tiles(inp["f"].shape[1], whole="combine" in kw):
            yield _chunk_variant(inp["f"], inp["i"], inp["h0"], tile, **kw)
    return answer


def _h_last_lost(inp):
    T = inp["f"].shape[1]
    ref = scan_reference(**inp)
    if any(T % tile for tile in _tiles(T, whole=True)):
        yield {"h_last": torch.zeros_like(ref["h_last"])}


# Compared as closely as a bfloat16 output allows (its rounding alone is up to 0.4%).
_CHUNK_TOL = dict(atol=1e-3, rtol=1e-2)


def _first_channels(t: torch.Tensor) -> torch.Tensor:
    """The first 16 channels: each channel runs the same scan, so a mistake shows there as
    on all 512 of a GPU case, whose every mistake recomputed whole takes over a minute."""
    return t[..., :16]


SCAN_HINT = narrowed_hint(hypotheses_hint(
    Hypothesis("h follows h_t = f_t·h_(t-1) + (1 - f_t)·i_t, a GRU-style mix: here i_t already carries "
               "its gate, the recurrence is h_t = f_t·h_(t-1) + i_t.",
               lambda inp: _scan_variant(inp["f"], inp["i"], inp["h0"], step=lambda f, h, i: f * h + (1 - f) * i),
               outputs=("h",)),
    Hypothesis("each h_t holds the state before step t (h_(t-1)): store h after the update h = f·h + i.",
               lambda inp: _scan_variant(inp["f"], inp["i"], inp["h0"], store_before=True), outputs=("h",)),
    Hypothesis("the scan runs backwards in time (from t = T-1 down to 0): walk t upwards, starting from h0.",
               lambda inp: _scan_variant(inp["f"], inp["i"], inp["h0"], reverse=True)),
    Hypothesis("every chunk of time steps starts from 0: the state carried from the previous chunk (h0 for "
               "the first) is lost; add A·h_carried to the chunk's local scan (A = the product of its f).",
               _tiled(carry="none"), **_CHUNK_TOL),
    Hypothesis("the carried state is added without its decay: inside a chunk h_t = h_local,t + A_t·h_carried, "
               "with A_t the product of f up to t (the scan's first component), not h_local,t + h_carried.",
               _tiled(carry="plain"), **_CHUNK_TOL),
    Hypothesis("the combine function composes the two steps in the wrong order: for (a1, b1) then (a2, b2) "
               "the result is (a1·a2, a2·b1 + b2) (apply the first step, then the second), not a1·b2 + b1.",
               _tiled(combine="swapped"), **_CHUNK_TOL),
    Hypothesis("h_last is zero: the masked time steps past T in the last chunk wiped the state; load f with "
               "other=1.0 (and i with 0.0) so padded steps leave h unchanged, and carry the chunk's last "
               "valid state.", _h_last_lost, outputs=("h_last",), zeros_count=True),
), _first_channels)


def _bwd_variant(f, h0, h, dh, dh_last, *, h_for_df="prev", carry_f="next", dh0_f=True, lost_at=None):
    """scan_backward_reference with one mistake; ``lost_at(t)``: the gradient carried into
    step t from above is dropped there (a chunk's walk that starts from 0)."""
    f64, h64, dh64 = f.double(), h.double(), dh.double()
    T = f.shape[1]
    g = dh_last.double()
    f_next = torch.ones_like(g)
    df, di = torch.empty_like(f64), torch.empty_like(f64)
    for t in range(T - 1, -1, -1):
        if lost_at is not None and lost_at(t):
            g = torch.zeros_like(g)
        mul = {"next": f_next, "none": torch.ones_like(g), "same": f64[:, t]}[carry_f]
        g = dh64[:, t] + mul * g
        di[:, t] = g
        if h_for_df == "same":
            df[:, t] = g * h64[:, t]
        else:
            df[:, t] = g * (h64[:, t - 1] if t > 0 else h0.double())
        f_next = f64[:, t]
    return {"df": df, "di": di, "dh0": (f_next * g if dh0_f else g) if T else g}


def _bwd(**kw):
    return lambda inp: _bwd_variant(inp["f"], inp["h0"], inp["h"], inp["dh"], inp["dh_last"], **kw)


def _bwd_carry_lost(inp):
    """Every chunk walked down from 0, for each chunk length a kernel may have used, with
    chunks counted from t = 0 (the two-phase kernel) or from T - 1 (the chunked one). At
    least two chunks: with one, only dh_last is lost, a mistake of its own."""
    T = inp["f"].shape[1]
    for tile in _tiles(T):
        for lost_at in (lambda t, tile=tile: (t + 1) % tile == 0 or t == T - 1,
                        lambda t, tile=tile: (T - 1 - t) % tile == 0):
            yield _bwd_variant(inp["f"], inp["h0"], inp["h"], inp["dh"], inp["dh_last"], lost_at=lost_at)


SCAN_BACKWARD_HINT = narrowed_hint(hypotheses_hint(
    Hypothesis("df_t uses h_t: h_t = f_t·h_(t-1) + i_t, so df_t = g_t · h_(t-1) (h0 at t = 0).",
               _bwd(h_for_df="same"), outputs=("df",)),
    Hypothesis("the gradient is carried back without the forget gate: g_t = dh_t + f_(t+1)·g_(t+1).",
               _bwd(carry_f="none")),
    Hypothesis("the carried gradient is multiplied by f_t, not f_(t+1): h_(t+1) = f_(t+1)·h_t + i_(t+1), so "
               "g_t = dh_t + f_(t+1)·g_(t+1) (keep the f of the step after).", _bwd(carry_f="same")),
    Hypothesis("dh0 misses the first forget gate: h_0 = f_0·h0 + i_0, so dh0 = f_0·g_0.",
               _bwd(dh0_f=False), outputs=("dh0",)),
    Hypothesis("every chunk of time steps starts its walk down from 0: the gradient carried in from the "
               "chunk after it (dh_last for the last chunk) is lost; add A·g_carried to the chunk's local "
               "scan (A = the product of its f_(t+1)).", _bwd_carry_lost, **_CHUNK_TOL),
), _first_channels)


# -- inputs -------------------------------------------------------------------------------
def _gates(shape, dtype, device, gen):
    # Forget gates in (0, 1), mostly near 1 (long memory), differing per row.
    z = randn(shape, torch.float32, device, gen, scale=1.5, offset=1.5)
    return torch.sigmoid(z).to(dtype)


def _scan_inputs(p, dtype, device, gen):
    B, T, D = p["B"], p["T"], p["D"]
    return {"f": _gates((B, T, D), dtype, device, gen),
            "i": randn((B, T, D), dtype, device, gen),
            "h0": randn((B, D), torch.float32, device, gen, scale=2.0)}


def _scan_outputs(inp, dtype):
    B, T, D = inp["f"].shape
    return {"h": ((B, T, D), dtype), "h_last": ((B, D), torch.float32)}


def _backward_inputs(p, dtype, device, gen):
    fwd = _scan_inputs(p, dtype, device, gen)
    h = scan_reference(**fwd)["h"].to(dtype)
    B, T, D = h.shape
    return {"f": fwd["f"], "h0": fwd["h0"], "h": h,
            "dh": randn((B, T, D), dtype, device, gen),
            "dh_last": randn((B, D), torch.float32, device, gen)}


def _backward_outputs(inp, dtype):
    B, T, D = inp["f"].shape
    return {"df": ((B, T, D), dtype), "di": ((B, T, D), dtype), "dh0": ((B, D), torch.float32)}


def _train_inputs(p, dtype, device, gen):
    fwd = _scan_inputs(p, dtype, device, gen)
    B, T, D = p["B"], p["T"], p["D"]
    return {**fwd, "dh": randn((B, T, D), dtype, device, gen),
            "dh_last": randn((B, D), torch.float32, device, gen)}


def _fwd_bytes(p, dtype):
    B, T, D = p["B"], p["T"], p["D"]
    return 3 * B * T * D * bytes_of(dtype) + 2 * B * D * 4      # read f, i; write h; h0, h_last


def _bwd_bytes(p, dtype):
    B, T, D = p["B"], p["T"], p["D"]
    return 5 * B * T * D * bytes_of(dtype) + 3 * B * D * 4      # read f, h, dh; write df, di


# -- cases --------------------------------------------------------------------------------
_TOLERANCES = {torch.float32: (2e-5, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1e-2, 1e-2)}
_STATE_TOLERANCES = {d: (2e-5, 1e-4) for d in FLOAT_DTYPES}    # float32 state, for every input dtype

_CPU_RECURRENT = [Case("one step", dict(B=1, T=1, D=1)), Case("odd widths", dict(B=2, T=37, D=50)),
                  Case("blocks + tails", dict(B=3, T=21, D=70))]
_CPU_CHUNKED = [Case("one step", dict(B=1, T=1, D=1)), Case("odd widths", dict(B=2, T=37, D=5)),
                Case("blocks + tails", dict(B=1, T=20, D=70))]
# The interpreter's chunk is 8 steps (mlgru.TWO_PHASE_CHUNK_INTERPRETED): one chunk, one
# chunk and one step, several chunks with a ragged last one; channel tails.
_CPU_TWO_PHASE = [Case("one step", dict(B=1, T=1, D=1)), Case("one chunk + 1", dict(B=1, T=9, D=5)),
                  Case("ragged chunks", dict(B=3, T=19, D=18))]
_CPU_EITHER = [Case("one step", dict(B=1, T=1, D=1)), Case("chunked", dict(B=2, T=40, D=3))]
_GPU = [Case("one step", dict(B=1, T=1, D=1)), Case("short, odd", dict(B=3, T=31, D=130)),
        Case("ragged chunks", dict(B=2, T=1000, D=333)), Case("long", dict(B=4, T=4099, D=512))]
_BENCH = [Case("B16 T8192 D512", dict(B=16, T=8192, D=512))]
_DTYPES = {"cpu": [torch.float32, torch.float16], "gpu": [torch.float32, torch.bfloat16, torch.float16]}


# -- baselines ----------------------------------------------------------------------------
@torch.compiler.disable
def scan_eager_loop(f, i, h0):
    """The eager PyTorch loop: T tiny kernels for the multiply-add and T for the copy.
    (Kept out of torch.compile: tracing thousands of steps takes longer than it saves.)"""
    h = h0.float()
    out = torch.empty_like(f)
    for t in range(f.shape[1]):
        h = torch.addcmul(i[:, t].float(), f[:, t].float(), h)
        out[:, t] = h
    return out, h


def _fwd_bwd(scan):
    """Forward and backward through ``scan(f, i, h0)``: returns h, h_last, df, di, dh0."""
    def run(f, i, h0, dh, dh_last):
        f = f.detach().requires_grad_()
        i = i.detach().requires_grad_()
        h0 = h0.detach().requires_grad_()
        h, h_last = scan(f, i, h0)
        torch.autograd.backward((h, h_last), (dh, dh_last))
        return h.detach(), h_last.detach(), f.grad, i.grad, h0.grad
    return run


def mlgru_scan_train(f, i, h0, dh, dh_last):
    """Forward and backward through ``mlgru_scan``: returns h, h_last, df, di, dh0."""
    return _fwd_bwd(mlgru_scan)(f, i, h0, dh, dh_last)


# flash-linear-attention's HGRN scan is the peer (pip install gpulab[peers]): the same
# recurrence with log-space gates, h_t = exp(g_t)·h_{t-1} + x_t. Its rows are added where it
# is installed; g = log f is computed once per input dict, outside the timing (a model
# feeding it would produce log-space gates directly).
FLA_INSTALLED = importlib.util.find_spec("fla") is not None
FLA_ROW = "flash-linear-attention chunk_hgrn (peer; g = log f given)"
FLA_TRAIN_ROW = "flash-linear-attention chunk_hgrn (peer; g = log f given; backward without dh_last, dh0)"


_LOG_GATES: dict = {}     # the last f and its log (not kept in the input dict: specs call **inp)


def _log_gates(inp):
    if _LOG_GATES.get("f") is not inp["f"]:
        _LOG_GATES.update(f=inp["f"], g=torch.log(inp["f"]))
    return _LOG_GATES["g"]


def chunk_hgrn_forward(inp):
    """The peer's forward on the same tensors: h, h_last."""
    from fla.ops.hgrn import chunk_hgrn
    return chunk_hgrn(inp["i"], _log_gates(inp), inp["h0"], True)


def chunk_hgrn_train(inp):
    """The peer's forward + backward through autograd, as ``mlgru_scan_train`` runs ours:
    h, h_last, dg, di, dh0 (dg = df·f: its gradient is for the log-space gate). Its
    backward does less than ours: it ignores dh_last and returns no dh0 (None)."""
    from fla.ops.hgrn import chunk_hgrn
    g = _log_gates(inp).detach().requires_grad_()
    i = inp["i"].detach().requires_grad_()
    h0 = inp["h0"].detach().requires_grad_()
    h, h_last = chunk_hgrn(i, g, h0, True)
    torch.autograd.backward((h, h_last), (inp["dh"], inp["dh_last"]))
    return h.detach(), h_last.detach(), g.grad, i.grad, h0.grad


_BASELINES = {"torch eager loop": lambda inp: scan_eager_loop(inp["f"], inp["i"], inp["h0"]),
              "torch log-step scan": lambda inp: scan_torch(inp["f"], inp["i"], inp["h0"]),
              **({FLA_ROW: chunk_hgrn_forward} if FLA_INSTALLED else {})}
# The step replayed from a CUDA graph: the GPU's time alone. As called, a step's host work
# (autograd, six launches) took longer than its kernels on the H200's host (2026-12-04).
TRAIN_GRAPH_ROW = "gpulab, CUDA graph replay"
_TRAIN_BASELINES = {TRAIN_GRAPH_ROW: cuda_graph_replay(lambda inp: lambda: mlgru_scan_train(**inp)),
                    "torch eager loop": lambda inp: _fwd_bwd(scan_eager_loop)(**inp),
                    "torch log-step scan": lambda inp: _fwd_bwd(scan_torch)(**inp),
                    **({FLA_TRAIN_ROW: chunk_hgrn_train} if FLA_INSTALLED else {})}
_COMPILED = ("torch log-step scan",)    # the eager loop: Dynamo would unroll 8192 steps


_SCAN_AXES = {k: ("batch", "time", "channel") for k in ("h", "df", "di")} | \
    {k: ("batch", "channel") for k in ("h_last", "dh0")}


# -- specs --------------------------------------------------------------------------------
def _fwd_spec(name, summary, impl, cpu_cases, baselines=None):
    return KernelSpec(
        name=name, summary=summary, args=("f", "i", "h0", "h", "h_last"),
        make_inputs=_scan_inputs, reference=scan_reference, outputs=_scan_outputs,
        implementation=impl, cases={"cpu": cpu_cases, "gpu": _GPU, "bench": _BENCH},
        dtypes=_DTYPES, tolerances=_TOLERANCES, output_tolerances={"h_last": _STATE_TOLERANCES},
        bytes_moved=_fwd_bytes, flops=lambda p, d: 2 * p["B"] * p["T"] * p["D"],
        baselines=baselines or {}, compile_baselines=_COMPILED,
        read_inputs=("f", "i", "h0"), bench_dtypes=[torch.bfloat16], hint=SCAN_HINT, axes=_SCAN_AXES)


def _bwd_spec(name, summary, impl, cpu_cases):
    return KernelSpec(
        name=name, summary=summary, args=("f", "h0", "h", "dh", "dh_last", "df", "di", "dh0"),
        make_inputs=_backward_inputs, reference=scan_backward_reference, outputs=_backward_outputs,
        implementation=impl, cases={"cpu": cpu_cases, "gpu": _GPU, "bench": _BENCH},
        dtypes=_DTYPES, tolerances=_TOLERANCES, output_tolerances={"dh0": _STATE_TOLERANCES},
        bytes_moved=_bwd_bytes, flops=lambda p, d: 4 * p["B"] * p["T"] * p["D"],
        read_inputs=("f", "h0", "h", "dh", "dh_last"), bench_dtypes=[torch.bfloat16], hint=SCAN_BACKWARD_HINT,
        axes=_SCAN_AXES)


MLGRU_SCAN_RECURRENT = _fwd_spec("mlgru_scan_recurrent", "h_t = f_t h_{t-1} + i_t, a loop over time",
                                 scan_recurrent_into, _CPU_RECURRENT)
MLGRU_SCAN_CHUNKED = _fwd_spec("mlgru_scan_chunked", "the scan in chunks: parallel inside, carried across",
                               scan_chunked_into, _CPU_CHUNKED)
MLGRU_SCAN_TWO_PHASE = _fwd_spec("mlgru_scan_two_phase",
                                 "the scan parallel over time: chunk maps, their carries, then a rescan",
                                 scan_two_phase_into, _CPU_TWO_PHASE)
MLGRU_SCAN_BACKWARD_RECURRENT = _bwd_spec("mlgru_scan_backward_recurrent", "scan gradients, a reverse-time loop",
                                          scan_backward_recurrent_into, _CPU_RECURRENT)
MLGRU_SCAN_BACKWARD_CHUNKED = _bwd_spec("mlgru_scan_backward_chunked",
                                        "scan gradients in chunks, walking time backwards",
                                        scan_backward_chunked_into, _CPU_CHUNKED)
MLGRU_SCAN_BACKWARD_TWO_PHASE = _bwd_spec("mlgru_scan_backward_two_phase",
                                          "scan gradients parallel over time: chunk maps walked backwards, "
                                          "their carries, then a rescan", scan_backward_two_phase_into,
                                          _CPU_TWO_PHASE)
MLGRU_SCAN = _fwd_spec("mlgru_scan", "MLGRU scan forward (the kernel the rule picks)", scan_into,
                       _CPU_EITHER, baselines=_BASELINES)

MLGRU_SCAN_TRAIN = KernelSpec(
    name="mlgru_scan_train", summary="MLGRU scan forward + backward through autograd",
    args=("f", "i", "h0", "dh", "dh_last"), make_inputs=_train_inputs, reference=mlgru_scan_train_reference,
    returns=("h", "h_last", "df", "di", "dh0"), implementation=mlgru_scan_train,
    cases={"cpu": _CPU_EITHER, "gpu": _GPU, "bench": _BENCH},
    dtypes=_DTYPES, tolerances=_TOLERANCES,
    output_tolerances={"h_last": _STATE_TOLERANCES, "dh0": _STATE_TOLERANCES},
    bytes_moved=lambda p, d: _fwd_bytes(p, d) + _bwd_bytes(p, d),
    flops=lambda p, d: 6 * p["B"] * p["T"] * p["D"],
    baselines=_TRAIN_BASELINES, bench_impl=lambda inp: mlgru_scan_train(**inp),
    read_inputs=("f", "i", "h0"), bench_dtypes=[torch.bfloat16], compile_baselines=_COMPILED)
