"""Grading of :mod:`gpulab.block_step` (a MatMul-free block's decode step in one kernel):
inputs, cases and the spec ``block_step``, which feeds its check, its compile check for
sm_75/80/90 and its benchmark.

The step quantizes six times to int8 on the way, so a float32 kernel and the float64
reference may round one code differently now and then (a value within float32's error of
a .5); one such flip moves an output by about 1/127 of its row's largest BitLinear input.
The tolerances leave room for that and no more: a missing state, gate or projection, or a
wrong scale, moves the outputs by far more (``tests/test_block_step.py`` checks it).

A flip can cascade: it moves the next quantization's inputs a little, some of their codes
flip, and so on down the row. Evaluated in float32, the reference itself missed the
tolerance in one row of a 64-row case in 5 of 60 seeds (by up to 0.37; a correct kernel
missed it by 0.53 on the H200, 2026-12-04): so a row in 32 may miss it by up to 1.0
(``row_slack``; never in the one-row case, and a wrong kernel moves most rows)."""
from __future__ import annotations

import torch

from ..block_step import BlockStepWeights, block_step_into, block_step_ref
from ..harness.spec import Case, KernelSpec, bytes_of, randn

EPS_NORM, EPS_BIT = 1e-6, 1e-8        # nn.RMSNorm's and BitLinear's, as MatMulFreeLM builds them
WEIGHTS = ("norms", "down_norm", "scales", "w_f", "w_c", "w_g", "w_o", "w_gate", "w_down")


def block_step_inputs(p: dict, dtype: torch.dtype, device, gen: torch.Generator) -> dict:
    """B rows of the residual stream and the state, and a block's weights: non-uniform
    norm weights, ternary weights with about a third zeros, per-projection scales."""
    b, d, h = p["B"], p["D"], p["H"]

    def ternary(k, n):
        return (torch.randint(-1, 2, (k, n), generator=gen, device=device)).to(torch.float16)

    return {"x": randn((b, d), dtype, device, gen, scale=2.0),
            "h": randn((b, d), torch.float32, device, gen),
            "norms": 0.5 + torch.rand((7, d), generator=gen, device=device),
            "down_norm": 0.5 + torch.rand((h,), generator=gen, device=device),
            "scales": 2.0 + 4.0 * torch.rand((6,), generator=gen, device=device),
            "w_f": ternary(d, d), "w_c": ternary(d, d), "w_g": ternary(d, d), "w_o": ternary(d, d),
            "w_gate": ternary(d, 2 * h), "w_down": ternary(h, d)}


def block_step_reference(x, h, **weights) -> dict:
    """The step in float64 (:func:`gpulab.block_step.block_step_ref`)."""
    w = BlockStepWeights(**weights, eps_norm=EPS_NORM, eps_bit=EPS_BIT)
    x_out, h_out = block_step_ref(x.double(), h.double(), w)
    return {"x_out": x_out, "h_out": h_out.double()}


def block_step_launch(x, h, norms, down_norm, scales, w_f, w_c, w_g, w_o, w_gate, w_down, x_out, h_out):
    """:func:`gpulab.block_step.block_step_into` in the check's calling convention (one
    argument per tensor)."""
    block_step_into(x, h, BlockStepWeights(norms, down_norm, scales, w_f, w_c, w_g, w_o, w_gate, w_down,
                                           EPS_NORM, EPS_BIT), x_out, h_out)


def _bytes(p, dtype):
    d, h = p["D"], p["H"]
    weights = 2 * (4 * d * d + 3 * d * h) + 4 * (8 * d + h + 6)
    return weights + p["B"] * d * (2 * bytes_of(dtype) + 8)


BLOCK_STEP = KernelSpec(
    name="block_step",
    summary="a MatMul-free block's decode step (MLGRU + GLU, six BitLinears) in one kernel",
    args=("x", "h") + WEIGHTS + ("x_out", "h_out"),
    make_inputs=block_step_inputs,
    reference=block_step_reference,
    outputs=lambda inp, dtype: {"x_out": (inp["x"].shape, dtype), "h_out": (inp["h"].shape, torch.float32)},
    implementation=block_step_launch,
    cases={"cpu": [Case("one row", dict(B=1, D=32, H=64)), Case("17 rows", dict(B=17, D=64, H=256))],
           "gpu": [Case("draft, batch 1", dict(B=1, D=128, H=512)), Case("33 rows", dict(B=33, D=64, H=256)),
                   Case("draft, batch 64", dict(B=64, D=128, H=512))],
           "bench": [Case("draft B1", dict(B=1, D=128, H=512)), Case("draft B64", dict(B=64, D=128, H=512))]},
    dtypes={"cpu": [torch.float32], "gpu": [torch.float32, torch.bfloat16]},
    tolerances={torch.float32: (2e-2, 1e-2), torch.bfloat16: (5e-2, 2e-2)},
    row_slack=(1 / 32, 1.0),
    bytes_moved=_bytes,
    flops=lambda p, dtype: 2 * p["B"] * (4 * p["D"] ** 2 + 3 * p["D"] * p["H"]),
    graph_timing=True,
    bench_dtypes=[torch.bfloat16],
    read_inputs=("x", "h", "w_f", "w_down"),
    notes="gpulab = block_step_into (one launch); its purpose is the speculative draft's step, "
          "timed there as draft_ms (tools/speculative_bench.py).",
)
