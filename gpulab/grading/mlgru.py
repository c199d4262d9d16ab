"""Grading of notebook 03 (:mod:`gpulab.mlgru`): inputs, cases, baselines and the specs
of the scan kernels (forward and backward, recurrent and chunked), of the scan the rule
picks, and of forward + backward through autograd. The references are
:func:`gpulab.mlgru.scan_reference` and :func:`gpulab.mlgru.scan_backward_reference`
(float64 loops over time)."""
from __future__ import annotations

import torch

from ..harness.spec import Case, KernelSpec, bytes_of, randn
from ..mlgru import (mlgru_scan, scan_backward_chunked_into, scan_backward_recurrent_into,
                     scan_backward_reference, scan_chunked_into, scan_into, scan_recurrent_into,
                     scan_reference, scan_torch)
from ..validate import FLOAT_DTYPES


# -- references (float64) -----------------------------------------------------------------
def mlgru_scan_train_reference(f, i, h0, dh, dh_last):
    out = scan_reference(f, i, h0)
    grads = scan_backward_reference(f, h0, out["h"].to(f.dtype), dh, dh_last)
    return {**out, "df": grads["df"], "di": grads["di"], "dh0": grads["dh0"]}


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


_BASELINES = {"torch eager loop": lambda inp: scan_eager_loop(inp["f"], inp["i"], inp["h0"]),
              "torch log-step scan": lambda inp: scan_torch(inp["f"], inp["i"], inp["h0"])}
_TRAIN_BASELINES = {"torch eager loop": lambda inp: _fwd_bwd(scan_eager_loop)(**inp),
                    "torch log-step scan": lambda inp: _fwd_bwd(scan_torch)(**inp)}
_COMPILED = ("torch log-step scan",)    # the eager loop: Dynamo would unroll 8192 steps


# -- specs --------------------------------------------------------------------------------
def _fwd_spec(name, summary, impl, cpu_cases, baselines=None):
    return KernelSpec(
        name=name, summary=summary, args=("f", "i", "h0", "h", "h_last"),
        make_inputs=_scan_inputs, reference=scan_reference, outputs=_scan_outputs,
        implementation=impl, cases={"cpu": cpu_cases, "gpu": _GPU, "bench": _BENCH},
        dtypes=_DTYPES, tolerances=_TOLERANCES, output_tolerances={"h_last": _STATE_TOLERANCES},
        bytes_moved=_fwd_bytes, flops=lambda p, d: 2 * p["B"] * p["T"] * p["D"],
        baselines=baselines or {}, compile_baselines=_COMPILED,
        read_inputs=("f", "i", "h0"), bench_dtypes=[torch.bfloat16])


def _bwd_spec(name, summary, impl, cpu_cases):
    return KernelSpec(
        name=name, summary=summary, args=("f", "h0", "h", "dh", "dh_last", "df", "di", "dh0"),
        make_inputs=_backward_inputs, reference=scan_backward_reference, outputs=_backward_outputs,
        implementation=impl, cases={"cpu": cpu_cases, "gpu": _GPU, "bench": _BENCH},
        dtypes=_DTYPES, tolerances=_TOLERANCES, output_tolerances={"dh0": _STATE_TOLERANCES},
        bytes_moved=_bwd_bytes, flops=lambda p, d: 4 * p["B"] * p["T"] * p["D"],
        read_inputs=("f", "h0", "h", "dh", "dh_last"), bench_dtypes=[torch.bfloat16])


MLGRU_SCAN_RECURRENT = _fwd_spec("mlgru_scan_recurrent", "h_t = f_t h_{t-1} + i_t, a loop over time",
                                 scan_recurrent_into, _CPU_RECURRENT)
MLGRU_SCAN_CHUNKED = _fwd_spec("mlgru_scan_chunked", "the scan in chunks: parallel inside, carried across",
                               scan_chunked_into, _CPU_CHUNKED)
MLGRU_SCAN_BACKWARD_RECURRENT = _bwd_spec("mlgru_scan_backward_recurrent", "scan gradients, a reverse-time loop",
                                          scan_backward_recurrent_into, _CPU_RECURRENT)
MLGRU_SCAN_BACKWARD_CHUNKED = _bwd_spec("mlgru_scan_backward_chunked",
                                        "scan gradients in chunks, walking time backwards",
                                        scan_backward_chunked_into, _CPU_CHUNKED)
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
