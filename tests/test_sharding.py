"""GPULAB_SHARD=k/n (tests/conftest.py) splits the suite into n disjoint parts whose union
is the whole suite: a compiled run spread over several GPU calls runs every test once."""
import time
from types import SimpleNamespace

import pytest

import conftest
from helpers import load_tool


def _shard(items, monkeypatch, shard):
    monkeypatch.setenv("GPULAB_SHARD", shard)
    dropped = []
    config = SimpleNamespace(hook=SimpleNamespace(pytest_deselected=lambda items: dropped.extend(items)))
    kept = list(items)
    conftest.pytest_collection_modifyitems(config, kept)
    return kept, dropped


def test_shards_are_disjoint_and_cover_the_suite(monkeypatch):
    items = [SimpleNamespace(nodeid=f"tests/test_{f}.py::test_{i}") for f in "abc" for i in range(40)]
    parts = []
    for k in (1, 2, 3):
        kept, dropped = _shard(items, monkeypatch, f"{k}/3")
        assert len(kept) + len(dropped) == len(items) and kept
        parts.append({it.nodeid for it in kept})
    assert set().union(*parts) == {it.nodeid for it in items} and sum(map(len, parts)) == len(items)


@pytest.mark.parametrize("bad", ["0/2", "3/2", "1", "a/b"])
def test_a_bad_shard_is_a_usage_error(monkeypatch, bad):
    with pytest.raises(pytest.UsageError, match="GPULAB_SHARD must be k/n"):
        _shard([SimpleNamespace(nodeid="x")], monkeypatch, bad)


def _select(items, monkeypatch, **env):
    monkeypatch.delenv("GPULAB_SHARD", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, str(v))
    dropped = []
    config = SimpleNamespace(hook=SimpleNamespace(pytest_deselected=lambda items: dropped.extend(items)))
    kept = list(items)
    conftest.pytest_collection_modifyitems(config, kept)
    return [it.nodeid for it in kept], [it.nodeid for it in dropped]


def test_passed_ledger_leaves_those_tests_out_and_durations_put_the_longest_first(monkeypatch, tmp_path):
    items = [SimpleNamespace(nodeid=f"tests/test_a.py::test_{i}") for i in range(5)]
    ledger = tmp_path / "passed.txt"
    ledger.write_text("tests/test_a.py::test_1\ntests/test_a.py::test_3\n")
    kept, dropped = _select(items, monkeypatch, GPULAB_PASSED=ledger)
    assert kept == ["tests/test_a.py::test_0", "tests/test_a.py::test_2", "tests/test_a.py::test_4"]
    assert dropped == ["tests/test_a.py::test_1", "tests/test_a.py::test_3"]
    took = tmp_path / "durations.json"
    took.write_text('{"tests/test_a.py::test_4": 300, "tests/test_a.py::test_0": 1, "tests/test_a.py::test_2": 9}')
    kept, _ = _select(items, monkeypatch, GPULAB_PASSED=ledger, GPULAB_DURATIONS=took)
    assert kept == ["tests/test_a.py::test_4", "tests/test_a.py::test_2", "tests/test_a.py::test_0"]
    # a test with no known duration (an earlier call stopped it, most likely) starts first
    took.write_text('{"tests/test_a.py::test_4": 300, "tests/test_a.py::test_0": 1}')
    kept, _ = _select(items, monkeypatch, GPULAB_PASSED=ledger, GPULAB_DURATIONS=took)
    assert kept == ["tests/test_a.py::test_2", "tests/test_a.py::test_4", "tests/test_a.py::test_0"]
    assert "tests/test_a.py::test_2" not in conftest.EXPECTED_S     # never skipped for lack of time
    with pytest.raises(pytest.UsageError, match="GPULAB_PASSED"):
        _select(items, monkeypatch, GPULAB_PASSED=tmp_path / "missing.txt")


def test_the_compile_only_checks_start_first_then_the_largest_scopes(monkeypatch):
    """xdist's loadscope hands out scopes in this order (--no-loadscope-reorder): the
    compile-only checks, minutes each, first, so that no worker runs them alone at the end."""
    monkeypatch.delenv("GPULAB_DURATIONS", raising=False)
    ids = ["tests/test_a.py::test_0", "tests/test_b.py::test_0", "tests/test_b.py::test_1",
           "tests/test_r.py::TestEveryKernelCompilesFor_sm75::test_compile", "tests/test_r.py::test_mode",
           "solutions/00.ipynb::Cell 0", "solutions/00.ipynb::Cell 1", "solutions/00.ipynb::Cell 2"]
    kept, _ = _select([SimpleNamespace(nodeid=i) for i in ids], monkeypatch)
    assert kept == [ids[3], *ids[5:8], ids[1], ids[2], ids[0], ids[4]]


def test_ledger_tool_reads_junit_and_extends_an_earlier_ledger(tmp_path):
    tool = load_tool("compiled_ledger")
    run = tmp_path / "run"
    run.mkdir()
    (run / "junit.xml").write_text(
        '<testsuites><testsuite>'
        '<testcase classname="tests.test_a" name="test_ok[x-1]" time="2.5"/>'
        '<testcase classname="tests.test_a" name="test_bad" time="1"><failure message="no"/></testcase>'
        '<testcase classname="tests.test_b.TestK" name="test_skip" time="0.1">'
        '<skipped type="pytest.skip" message="GPU only"/></testcase>'
        '<testcase classname="" name="tests.test_c" time="0"/>'
        f'<testcase classname="tests.test_d" name="test_late" time="0"><skipped type="pytest.skip" '
        f'message="{conftest.DEADLINE_SKIP}"/></testcase>'
        '</testsuite></testsuites>')
    earlier = tmp_path / "earlier.txt"
    earlier.write_text("tests/test_z.py::test_old\n")
    out, took = tmp_path / "passed.txt", tmp_path / "took.json"
    assert tool.main([str(run), "--include", str(earlier), "--out", str(out), "--durations-out", str(took)]) == 0
    assert out.read_text().split() == ["tests/test_a.py::test_ok[x-1]", "tests/test_b.py::TestK::test_skip",
                                       "tests/test_z.py::test_old"]
    assert '"tests/test_a.py::test_ok[x-1]": 2.5' in took.read_text()
    # --drop: code a test runs changed outside tests/, so its pass no longer stands
    assert tool.main([str(run), "--include", str(earlier), "--out", str(out), "--drop", "test_z.py::"]) == 0
    assert out.read_text().split() == ["tests/test_a.py::test_ok[x-1]", "tests/test_b.py::TestK::test_skip"]


def test_a_test_that_cannot_finish_before_the_deadline_is_skipped_not_begun(monkeypatch, tmp_path):
    """GPULAB_DEADLINE (tools/gpu-suite.sh): a test whose known duration outlasts the call's
    time limit is skipped with DEADLINE_SKIP (the ledger above does not count it as done);
    one that fits runs, and without a deadline nothing is skipped."""
    took = tmp_path / "durations.json"
    took.write_text('{"tests/test_a.py::test_long": 300, "tests/test_a.py::test_short": 2}')
    items = [SimpleNamespace(nodeid=f"tests/test_a.py::test_{n}") for n in ("short", "long")]
    _select(items, monkeypatch, GPULAB_DURATIONS=took)
    monkeypatch.setenv("GPULAB_DEADLINE", str(time.time() + 60))
    with pytest.raises(pytest.skip.Exception, match="gpulab-deadline"):
        conftest.pytest_runtest_setup(items[1])
    conftest.pytest_runtest_setup(items[0])
    monkeypatch.delenv("GPULAB_DEADLINE")
    conftest.pytest_runtest_setup(items[1])


def test_the_test_that_breaks_the_cuda_context_is_the_one_that_fails(monkeypatch):
    """A test can xfail (or pass) and still leave an illegal address behind: the context
    probe after its call fails *it*, and the worker stops before the next test runs."""
    monkeypatch.setattr(conftest, "_poisoned_by", None)
    monkeypatch.setattr(conftest, "_cuda_context_error",
                        lambda: "CUDA error: an illegal memory access was encountered\nmore")
    report = SimpleNamespace(outcome="skipped", longrepr=None, wasxfail="hint not specific")
    hook = conftest.pytest_runtest_makereport(SimpleNamespace(nodeid="tests/t.py::test_culprit"),
                                              SimpleNamespace(when="call", excinfo=None))
    next(hook)
    with pytest.raises(StopIteration):
        hook.send(SimpleNamespace(get_result=lambda: report))
    assert report.outcome == "failed" and not hasattr(report, "wasxfail")
    assert "test_culprit left this process's CUDA context broken" in report.longrepr
    assert conftest._poisoned_by == "tests/t.py::test_culprit"
