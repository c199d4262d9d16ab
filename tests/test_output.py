"""Clean notebook output: tables that fit 88 columns (HTML in notebooks), log axes with
readable ticks, and the interpreter's expected NumPy warnings silenced in checks only."""
import json
import warnings

import matplotlib
import numpy as np
import pytest

import gpulab
from gpulab.harness import bench, plots

matplotlib.use("Agg")


def saved_results():
    return [json.loads(p.read_text()) for p in sorted(bench.RESULTS.glob("*.json"))]


def test_every_saved_table_fits_88_columns():
    results = [r for r in saved_results() if "rows" in r]
    assert results
    for r in results:
        for line in bench.format_table(r).splitlines():
            assert len(line) <= bench.TABLE_WIDTH, f"{r['kernel']}: {len(line)} columns: {line}"


def test_notebooks_get_an_html_table_with_every_row():
    r = bench.load("softmax")
    table = bench.BenchTable(r)
    html = table._repr_html_()
    assert html.count("<tr>") == len(r["rows"]) + 1 and "torch (3 passes) (compiled)" in html
    assert repr(table) == bench.format_table(r)


def test_a_roofline_left_out_shows_as_a_dash_and_the_note_says_why():
    r = json.loads(json.dumps(bench.load("softmax")))
    r["rows"][0]["roofline_pct"] = None
    r["note"] = "ceiling not trusted in this run"
    text, md, html = bench.format_table(r), bench.markdown(r), bench.BenchTable(r)._repr_html_()
    assert all("ceiling not trusted in this run" in t for t in (text, md, html))
    first_row = next(line for line in text.splitlines() if line.startswith(r["rows"][0]["case"]))
    assert " — " in first_row and "| — |" in md and "<td>—</td>" in html
    assert "None" not in text + md + html


def test_log_axis_ticks_are_the_plotted_values_as_plain_numbers():
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots()
    ax.plot([16, 64, 256], [1, 2, 3], "o-")
    plots.readable_log_axis(ax)
    fig.canvas.draw()
    labels = [t.get_text() for t in ax.get_xticklabels() if t.get_visible() and t.get_text()]
    assert labels == ["16", "64", "256"]
    assert not [t for t in ax.xaxis.get_minor_ticks() if t.label1.get_text()]
    assert [plots.plain_number(v) for v in (1, 512, 2048, 32768, 1 << 20, 0.5)] == \
        ["1", "512", "2K", "32K", "1M", "0.5"]
    plt.close(fig)


def test_expected_interpreter_warnings_are_silenced_for_their_spec_only():
    if not gpulab.runtime.interpreting():
        pytest.skip("the interpreter's NumPy warnings do not exist on a GPU")
    quiet, loud = gpulab.get_spec("split_kv_reduce"), gpulab.get_spec("softmax")
    assert quiet.expected_fp_warnings == ("divide",) and not loud.expected_fp_warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with quiet.expected_warnings():
            np.log(np.zeros(2))
        with pytest.raises(RuntimeWarning):
            with loud.expected_warnings():
                np.log(np.zeros(2))
        with pytest.raises(RuntimeWarning):       # outside the check: as NumPy always does
            np.log(np.zeros(2))


def test_a_passing_split_kv_check_prints_no_warning(recwarn):
    gpulab.check("split_kv_reduce", gpulab.get_spec("split_kv_reduce").implementation)
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_bench_cli_shows_saved_figures_without_a_gpu_and_names_what_it_lacks(capsys, monkeypatch, tmp_path):
    if gpulab.mode() == "compiled":
        pytest.skip("without a GPU the command shows saved figures; with one it measures")
    assert bench.main(["ternary_matmul"]) == 2
    out, err = capsys.readouterr()
    assert "needs a GPU" in err and "gpulab bench --markdown NAME" in err
    assert out.startswith("ternary_matmul on NVIDIA H200")
    assert bench.main(["--markdown", "rmsnorm_quant"]) == 0
    out = capsys.readouterr().out
    assert out.count("### ") == 1 and out.startswith("### rmsnorm_quant\n")
    assert bench.main(["no_such_kernel"]) == 2
    assert "no kernel spec named no_such_kernel (gpulab bench --list" in capsys.readouterr().err
    assert bench.main(["--markdown", "no_such_kernel"]) == 2
    assert "no saved results for no_such_kernel; saved: " in capsys.readouterr().err

    # a spec no GPU has measured: the command says so instead of printing nothing
    monkeypatch.setattr(bench, "RESULTS", tmp_path)
    assert bench.main(["rmsnorm_quant"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "not measured on a GPU yet: rmsnorm_quant" in err
