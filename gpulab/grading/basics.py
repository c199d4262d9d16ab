"""Grading of notebook 00 (:mod:`gpulab.basics`): float64 references, inputs, cases,
baselines and the specs ``vector_add``, ``row_sum`` and ``softmax``."""
from __future__ import annotations

import torch

from ..basics import ADD_BLOCK, ROW_SUM_BLOCK_M, ROW_SUM_BLOCK_N, add_into, row_sum_into, safe_softmax_unfused, softmax_into
from ..harness.checking import Hypothesis, hypotheses_hint
from ..harness.spec import Case, KernelSpec, bytes_of, randn


# -- references (float64) -----------------------------------------------------------------
def vector_add_reference(x, y):
    return {"out": x.double() + y.double()}


def softmax_reference(x):
    return {"y": torch.softmax(x.double(), dim=-1)}


# -- inputs -------------------------------------------------------------------------------
def _vector_add_inputs(p, dtype, device, gen):
    return {"x": randn((p["n"],), dtype, device, gen),
            "y": randn((p["n"],), dtype, device, gen, offset=0.5)}


def _softmax_inputs(p, dtype, device, gen):
    # Scores with a large, row-dependent offset: an unsafe softmax (no max) overflows.
    x = randn((p["rows"], p["cols"]), torch.float32, device, gen, scale=3.0)
    x = x + torch.linspace(120, -60, p["rows"], device=device)[:, None]
    return {"x": x.to(dtype)}


def _softmax_wide_rows(inputs, params, dtype, gen):
    """rows spanning more than 88 (every other column 100 lower): exp(x - min) overflows, exp(x - max) cannot"""
    x = inputs["x"].clone()
    x[:, ::2] -= 100
    return {**inputs, "x": x}


def _draw(gen, lo, hi) -> int:
    return int(torch.randint(lo, hi, (1,), generator=gen))


def _vector_add_fresh(gen):
    # more than 4 blocks of 1024 and not a multiple of it: a grid or block fixed to the
    # listed sizes does not cover it
    return Case("random size", dict(n=_draw(gen, 4200, 9000)))


def _softmax_fresh(gen):
    # rows wider than the listed cases' 1024-column block
    return Case("random size", dict(rows=_draw(gen, 2, 6), cols=_draw(gen, 1100, 3000)))


# -- specs --------------------------------------------------------------------------------
VECTOR_ADD = KernelSpec(
    name="vector_add",
    summary="out = x + y, elementwise",
    args=("x", "y", "out"),
    make_inputs=_vector_add_inputs,
    reference=vector_add_reference,
    outputs=lambda inp, dtype: {"out": (inp["x"].shape, dtype)},
    implementation=add_into,
    cases={
        "cpu": [Case("one element", dict(n=1)), Case("tail", dict(n=1000)),
                Case("one block", dict(n=ADD_BLOCK)), Case("blocks + tail", dict(n=3 * ADD_BLOCK + 77))],
        "gpu": [Case("one element", dict(n=1)), Case("tail", dict(n=1000)),
                Case("many blocks + tail", dict(n=(1 << 20) + 3))],
        "bench": [Case(f"n=2^{k}", dict(n=1 << k)) for k in (20, 24, 28)],
    },
    dtypes={"cpu": [torch.float32, torch.float16], "gpu": [torch.float32, torch.bfloat16]},
    tolerances={torch.float32: (1e-6, 1e-6), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1e-2, 1e-2)},
    bytes_moved=lambda p, dtype: 3 * p["n"] * bytes_of(dtype),
    flops=lambda p, dtype: p["n"],
    baselines={"torch": lambda inp: inp["x"] + inp["y"]},
    read_inputs=("x", "y"),
    fresh_case=_vector_add_fresh,
)

SOFTMAX = KernelSpec(
    name="softmax",
    summary="row softmax, one program per row",
    args=("x", "y"),
    make_inputs=_softmax_inputs,
    reference=softmax_reference,
    outputs=lambda inp, dtype: {"y": (inp["x"].shape, dtype)},
    implementation=softmax_into,
    cases={
        "cpu": [Case("single element", dict(rows=1, cols=1)), Case("odd row", dict(rows=3, cols=7)),
                Case("power of two", dict(rows=5, cols=256)), Case("tail", dict(rows=7, cols=1000))],
        "gpu": [Case("single element", dict(rows=1, cols=1)), Case("odd row", dict(rows=3, cols=7)),
                Case("tail", dict(rows=37, cols=1000)), Case("wide", dict(rows=129, cols=12345))],
        "bench": [Case(f"4096x{n}", dict(rows=4096, cols=n)) for n in (256, 1024, 4096, 16384)]
        + [Case("8192x8192", dict(rows=8192, cols=8192))],
    },
    dtypes={"cpu": [torch.float32, torch.float16], "gpu": [torch.float32, torch.bfloat16, torch.float16]},
    tolerances={torch.float32: (1e-6, 1e-5), torch.float16: (1e-3, 2e-3), torch.bfloat16: (4e-3, 1e-2)},
    bytes_moved=lambda p, dtype: 2 * p["rows"] * p["cols"] * bytes_of(dtype),
    flops=lambda p, dtype: 5 * p["rows"] * p["cols"],
    baselines={"torch": lambda inp: torch.softmax(inp["x"], dim=-1),
               "torch (3 passes)": lambda inp: safe_softmax_unfused(inp["x"])},
    read_inputs=("x",),
    # the contract takes row strides (softmax_into passes x.stride(0), y.stride(0))
    strided=("x", "y"),
    edge_data=_softmax_wide_rows,
    fresh_case=_softmax_fresh,
)


# -- row sums over 2-D tiles ----------------------------------------------------------------
def row_sum_reference(x):
    return {"y": x.double().sum(dim=-1)}


def _row_sum_inputs(p, dtype, device, gen):
    # Rows with different offsets: a row read twice, or a tile summed into the wrong row, shows.
    x = randn((p["M"], p["N"]), torch.float32, device, gen)
    x = x + torch.linspace(-2.0, 3.0, p["M"], device=device)[:, None]
    return {"x": x.to(dtype)}


# Column tile widths a learner may pick (the notebook uses 64, gpulab 128).
_ROW_SUM_TILES = (16, 32, 64, 128, 256)


def _first_tile_only(inp):
    x = inp["x"].double()
    for t in _ROW_SUM_TILES:
        if t < x.shape[1]:
            yield {"y": x[:, :t].sum(-1)}


def _first_tile_repeated(inp):
    x = inp["x"].double()
    for t in _ROW_SUM_TILES:
        if t < x.shape[1]:
            yield {"y": x[:, :t].sum(-1) * -(-x.shape[1] // t)}


ROW_SUM_HINT = hypotheses_hint(
    Hypothesis("y is the row mean (the sum divided by N): a row sum is not divided by anything.",
               lambda inp: {"y": inp["x"].double().mean(-1)} if inp["x"].shape[1] > 1 else None),
    Hypothesis("only the first column tile of each row is summed: loop over the columns in steps of "
               "BLOCK_N (n0 = 0, BLOCK_N, 2·BLOCK_N, ... < N) and add every tile to the accumulator.",
               _first_tile_only),
    Hypothesis("every column tile reads the first BLOCK_N columns again: the column offsets must start at "
               "the loop's n0 (cols = n0 + tl.arange(0, BLOCK_N)).", _first_tile_repeated),
)


ROW_SUM = KernelSpec(
    name="row_sum",
    summary="y[m] = sum over n of x[m, n], [BLOCK_M, BLOCK_N] tiles masked on both axes",
    args=("x", "y"),
    make_inputs=_row_sum_inputs,
    reference=row_sum_reference,
    outputs=lambda inp, dtype: {"y": ((inp["x"].shape[0],), torch.float32)},
    implementation=row_sum_into,
    cases={
        "cpu": [Case("1 x 1", dict(M=1, N=1)), Case("one partial tile", dict(M=3, N=7)),
                Case("row tiles + tail", dict(M=ROW_SUM_BLOCK_M + 5, N=30)),
                Case("column tiles + tail", dict(M=2, N=2 * ROW_SUM_BLOCK_N + 3))],
        "gpu": [Case("1 x 1", dict(M=1, N=1)), Case("ragged", dict(M=37, N=1000)),
                Case("wide", dict(M=3, N=12345))],
        "bench": [Case("4096x4096", dict(M=4096, N=4096)), Case("8192x8192", dict(M=8192, N=8192))],
    },
    dtypes={"cpu": [torch.float32, torch.float16], "gpu": [torch.float32, torch.bfloat16]},
    tolerances={torch.float32: (1e-4, 1e-5), torch.float16: (1e-4, 1e-5), torch.bfloat16: (1e-4, 1e-5)},
    bytes_moved=lambda p, dtype: p["M"] * p["N"] * bytes_of(dtype) + 4 * p["M"],
    flops=lambda p, dtype: p["M"] * p["N"],
    baselines={"torch": lambda inp: inp["x"].sum(dim=-1, dtype=torch.float32)},
    read_inputs=("x",),
    strided=("x",),
    axes={"y": ("row",)},
    hint=ROW_SUM_HINT,
    fresh_case=lambda gen: Case("random size", dict(M=int(torch.randint(1, 40, (1,), generator=gen)),
                                                    N=int(torch.randint(1, 300, (1,), generator=gen)))),
)
