"""Later notebooks run the learner's kernels from earlier ones: loading an earlier
notebook's exercise cells, picking the learner's version or gpulab's (and saying which),
and the model's hooks that run them (packed BitLinear kernels, scan launchers)."""
import copy

import nbformat
import pytest
import torch
import triton
import triton.language as tl  # noqa: F401  (the notebook under test imports it itself)

import gpulab
from gpulab import bitlinear as bl
from gpulab import mlgru
from gpulab import model as M
from gpulab import normquant as nq


def _notebook(tmp_path, cells):
    nb = nbformat.v4.new_notebook()
    for kind, source, meta in cells:
        cell = (nbformat.v4.new_code_cell if kind == "code" else nbformat.v4.new_markdown_cell)(source)
        if meta:
            cell.metadata["nbgrader"] = {"schema_version": 3, "grade": False, "locked": False, **meta}
        nb.cells.append(cell)
    path = tmp_path / "01_earlier.ipynb"
    nbformat.write(nb, path)
    return path


ADD_CELL = '''\
@triton.jit
def twice_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, 2 * tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def twice(x, y):
    twice_kernel[(triton.cdiv(x.numel(), 64),)](x, y, x.numel(), BLOCK=64)
'''


def test_notebook_functions_runs_imports_and_exercise_cells_only(tmp_path, capsys, device):
    path = _notebook(tmp_path, [
        ("markdown", "# title", None),
        ("code", "import gpulab\ngpulab.setup()\nimport torch\nimport triton\nimport triton.language as tl", None),
        ("code", "raise RuntimeError('a demo cell that must not run')", None),
        ("code", ADD_CELL, {"solution": True, "grade_id": "ex1-twice"}),
        ("code", "def broken(:\n    pass", {"solution": True, "grade_id": "ex2-broken"}),
    ])
    found = gpulab.notebook_functions(path, "twice", "broken", "absent")
    out = capsys.readouterr().out
    assert "ex2-broken raised SyntaxError" in out and "demo cell" not in out
    assert found["broken"] is None and found["absent"] is None
    x = torch.arange(70, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    found["twice"](x, y)                         # a @triton.jit kernel from exec'd source
    assert torch.equal(y, 2 * x)


def test_notebook_functions_without_the_notebook(tmp_path, capsys):
    found = gpulab.notebook_functions(tmp_path / "01_missing.ipynb", "gemv")
    assert found == {"gemv": None}
    assert "01_missing.ipynb is not next to this notebook" in capsys.readouterr().out


def _stub(*args):
    raise NotImplementedError("TODO (ex3-gemv-kernel): write this")


def _gemv_wrong_scale(x_q, x_scale, w_packed, w_scale, y):
    bl.ternary_gemv_into(x_q, x_scale, w_packed, w_scale, y)
    y.mul_(2)


def _gemv_raises(*args):
    raise IndexError("index 9 is out of bounds")


def test_kernel_sources_picks_and_reports(capsys):
    sources = gpulab.KernelSources()
    assert sources.pick("ternary_gemv", bl.ternary_gemv_into, "01, exercise 3") is bl.ternary_gemv_into
    assert sources.pick("ternary_gemv", _stub, "01, exercise 3") is bl.ternary_gemv_into
    assert sources.pick("ternary_gemv", _gemv_wrong_scale, "01, exercise 3") is bl.ternary_gemv_into
    assert sources.pick("ternary_gemv", _gemv_raises, "01, exercise 3") is bl.ternary_gemv_into
    assert sources.pick("ternary_quantize", None, "01, exercise 1") is bl.ternary_quantize
    mine = lambda w: bl.ternary_quantize(w)    # noqa: E731  (a returning function, agrees)
    assert sources.pick("ternary_quantize", mine, "01, exercise 1") is mine
    sources.note("training on this CPU", "PyTorch", "too slow to interpret")
    assert capsys.readouterr().out == ""        # nothing printed until the report
    sources.report()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 8
    assert lines[1].split()[:2] == ["ternary_gemv", "yours"]
    assert "gpulab's" in lines[2] and "not written yet: finish 01, exercise 3" in lines[2]
    assert "disagrees with gpulab's" in lines[3] and "values of y differ" in lines[3]
    assert "raised IndexError: index 9 is out of bounds; fix 01, exercise 3" in lines[4]
    assert "not found: do 01, exercise 1" in lines[5]
    assert lines[6].split()[:2] == ["ternary_quantize", "yours"]
    assert "training on this CPU" in lines[7]


def test_scan_launchers_run_in_mlgru_scan_and_the_layer(device):
    calls = []

    def forward(*args):
        calls.append("forward")
        mlgru.scan_recurrent_into(*args)

    def backward(*args):
        calls.append("backward")
        mlgru.scan_backward_recurrent_into(*args)

    gen = torch.Generator().manual_seed(0)
    f = torch.rand(2, 5, 3, generator=gen).to(device).requires_grad_()
    i = torch.randn(2, 5, 3, generator=gen).to(device).requires_grad_()
    h, h_last = mlgru.mlgru_scan(f, i, kernel=mlgru.ScanLaunchers(forward, backward))
    h_ref, last_ref = mlgru.mlgru_scan(f, i, kernel="torch")
    torch.testing.assert_close(h, h_ref)
    torch.testing.assert_close(h_last, last_ref)
    h.sum().backward()
    assert calls == ["forward", "backward"]
    with pytest.raises(ValueError, match="kernel must be one of .* or a ScanLaunchers"):
        mlgru.mlgru_scan(f, i, kernel="fast")
    with pytest.raises(TypeError, match="must be callable"):
        mlgru.MLGRU(8, scan=mlgru.ScanLaunchers(forward, None))
    model = M.MatMulFreeLM(d_model=8, n_layers=1).to(device).set_scan(mlgru.ScanLaunchers(forward, backward))
    model(torch.tensor([[1, 2, 3]], device=device))
    assert calls[-1] == "forward"


def test_packed_model_runs_the_given_kernels(device):
    used = set()

    def spy(name, fn):
        def run(*args):
            used.add(name)
            return fn(*args)
        return run

    torch.manual_seed(0)
    model = M.MatMulFreeLM(d_model=16, n_layers=1, hidden=20).to(device)
    tokens = torch.tensor([[3, 1, 4, 1, 5]], device=device)
    with torch.no_grad():
        trained, _ = model(tokens)
        default, _ = copy.deepcopy(model).pack()(tokens)
        kernels = bl.PackedKernels(spy("quantize", bl.ternary_quantize), spy("pack", bl.pack_ternary),
                                   spy("norm", nq.rmsnorm_quant_into), spy("gemv", bl.ternary_gemv_into))
        mine, _ = model.pack(kernels)(tokens)
    assert used == {"quantize", "pack", "norm", "gemv"}
    torch.testing.assert_close(mine, default, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(mine, trained, atol=1e-3, rtol=1e-3)
    with pytest.raises(TypeError, match="kernels must be a PackedKernels"):
        bl.BitLinear(4, 4).pack(kernels=bl.ternary_gemv_into)
    with pytest.raises(ValueError, match="layout='uint8x4'"):
        bl.BitLinear(4, 4).pack("int32x16", kernels=bl.PackedKernels())
