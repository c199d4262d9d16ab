"""The GPU-free parts of the ternary GEMV tools: the static instruction counter compiles the
old and new GEMVs (the int32x16 portable twin included) for sm_90, and the H200 benchmark
parses its arguments, refuses to time without a GPU and calls every variant in a dry run."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

import gpulab
from helpers import subprocess_env

ROOT = Path(__file__).resolve().parents[1]


def _load(name):
    spec = importlib.util.spec_from_file_location(name.replace("-", "_"), ROOT / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_instruction_counts_of_old_and_new_gemv(tmp_path):
    env = subprocess_env(ROOT)
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "gemv-instructions.py"), "--quick", "--few-rows",
                        "--json", str(tmp_path / "counts.json")], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = {row["kernel"].split(" BLOCK")[0]: row
            for row in json.loads((tmp_path / "counts.json").read_text())["rows"]}
    old, new, twin = rows["uint8x4"], rows["int32x16 dp4a"], rows["int32x16 portable"]
    # dp4a: one LOP3 and one IDP.4A per four weights in the main loop, nothing per weight
    assert new["loop_opcodes"].get("IDP", 0) > 0 and new["per_weight"]["dp4a"] == pytest.approx(0.25)
    assert new["per_weight"]["logic/shift"] == pytest.approx(0.25)
    assert new["sass_per_weight"] < old["sass_per_weight"] and twin["loop_opcodes"].get("IDP", 0) == 0
    # the few-rows matmul: its inline PTX unpacks with fewer instructions than its twin
    few, few_twin = rows["few rows PTX 16x64x256 w4 s4"], rows["few rows portable 16x64x256 w4 s4"]
    assert few["loop_opcodes"].get("IMMA", 0) > 0 and few["sass_per_weight"] < few_twin["sass_per_weight"]
    assert "static instruction counts, no GPU run" in r.stdout


def test_gemv_bench_without_gpu_and_dry_run(tmp_path, capsys):
    bench = _load("ternary-gemv-bench")
    with pytest.raises(SystemExit):
        bench.parse_args([])                             # OUTDIR is required
    assert bench.parse_args(["o", "--shapes", "16x4096x14336,1X8X4"]).shapes == [(16, 4096, 14336), (1, 8, 4)]
    for bad in ("16x4096", "16x0x4", "a,b"):
        with pytest.raises(SystemExit):
            bench.parse_args(["o", "--shapes", bad])
    if gpulab.mode() == "compiled":
        pytest.skip("the no-GPU refusal and the interpreter dry run are for CPU machines")
    assert bench.main([str(tmp_path / "none")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err and not (tmp_path / "none").exists()
    bench.DRY_SHAPES = [(1, 33, 100)]
    assert bench.main([str(tmp_path), "--dry-run", "--quick"]) == 0
    doc = json.loads((tmp_path / "ternary_gemv_bench.json").read_text())
    shape = doc["shapes"][0]
    assert doc["what"].startswith("DRY RUN") and "error" not in shape
    assert all(v for k, v in shape["correctness"].items() if k.endswith("bit-identical"))
    assert [r for r in shape["rows"] if "error" in r] == []


def test_few_rows_variants_probe_counts_without_a_gpu():
    """tools/few_rows_variants.py: the three variants of the few-rows kernel compile for
    sm_90 and each has fewer SASS instructions in its main loop than the one before;
    timing them needs a GPU (the tool says so)."""
    env = subprocess_env(ROOT)
    tool = str(ROOT / "tools" / "few_rows_variants.py")
    r = subprocess.run([sys.executable, tool, "--static"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    counts = {line.split()[0]: int(line.split()[3]) for line in r.stdout.splitlines() if "main loop" in line}
    assert counts["with_other"] > counts["package"] > counts["codes"]
    if gpulab.mode() != "compiled":
        r = subprocess.run([sys.executable, tool, str(ROOT / "never-written")], capture_output=True, text=True, env=env)
        assert r.returncode == 2 and "needs a CUDA GPU" in r.stdout
