import collections
import json
import math
import os
import sys
import tempfile
import time
import zlib

import pytest
import torch

# On a GPU, kernels run their first launch configuration instead of timing every one for
# every shape a check tries (compiling and timing those dominated a compiled run): tests check answers, benchmarks
# pick configurations. Set before gpulab defines its kernels; GPULAB_AUTOTUNE=1 overrides.
os.environ.setdefault("GPULAB_AUTOTUNE", "0")

import gpulab  # noqa: E402,F401  (sets the Triton mode before any test defines a kernel)
from gpulab import paged  # noqa: E402


@pytest.fixture
def device():
    return gpulab.device()


os.environ.setdefault("MPLBACKEND", "Agg")
# `gpulab grade` records progress under GPULAB_HOME: keep the tests' gradings out of ~/.gpulab
os.environ["GPULAB_HOME"] = tempfile.mkdtemp(prefix="gpulab-home-")

# One torch CPU thread per process where xdist workers share the cores, or their OpenMP
# threads wait on each other: on a GPU host too, where the checks' diagnoses recompute
# float64 answers on the CPU (tools/gpu-suite.sh also sets OMP_NUM_THREADS=1 for the
# processes tests start). The interpreter's tiny ops run best on one thread anyway.
if gpulab.mode() != "compiled" or os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(1)


# A device-side assert (an out-of-range index in a PyTorch op, say) or an illegal memory
# access (a kernel's store far outside its buffers) leaves the process's CUDA context
# unusable, so every later test on the same pytest worker would fail with it too. Stop
# that worker instead: pytest-xdist reports the test as the one it crashed
# on and goes on with a fresh worker (without xdist, the session stops there).
_poisoned_by = None


_BROKEN_CONTEXT = ("device-side assert", "illegal memory access")


def _cuda_context_error() -> str:
    """The sticky CUDA error this process carries, or "" (also without a GPU)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return ""
    try:
        torch.cuda.synchronize()
    except Exception as e:          # a kernel of this test faulted and nothing synced since
        return str(e)
    return ""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    global _poisoned_by
    outcome = yield
    if _poisoned_by is not None:
        return
    if call.excinfo is not None and any(f in str(call.excinfo.value) for f in _BROKEN_CONTEXT):
        _poisoned_by = item.nodeid
        return
    if call.when != "call":
        return
    # A test can break the context and still pass, skip or xfail (a planted mistake whose
    # check reported the fault, say): then it, not the next test, is the one to blame.
    error = _cuda_context_error()
    if any(f in error for f in _BROKEN_CONTEXT):
        _poisoned_by = item.nodeid
        report = outcome.get_result()
        report.outcome, report.longrepr = "failed", (
            f"{item.nodeid} left this process's CUDA context broken ({error.splitlines()[0]}); "
            "a kernel that faults on purpose must run in a subprocess, as the mistake "
            "catalogue's faults_compiled entries do (tests/mistakes/__init__.py)")
        if hasattr(report, "wasxfail"):
            del report.wasxfail


def pytest_runtest_logfinish(nodeid, location):
    if _poisoned_by is None:
        return
    msg = f"{_poisoned_by} triggered a CUDA device-side assert; this process cannot use the GPU any more"
    if os.environ.get("PYTEST_XDIST_WORKER"):
        sys.stderr.write(f"\n{msg}: restarting the worker\n")
        sys.stderr.flush()
        os._exit(70)
    pytest.exit(msg, returncode=1)


# A bad paged layout met by an unvalidated kernel is recorded in the device's fault flag
# (gpulab.paged.fault_flag) and reported by the next plan or validating call anywhere in
# the process: a fault one test leaves behind fails a later one in the same pytest worker
# (on the H200 the engine's warm-up reported one that test_prefill's off-by-one mutant had
# planted). So a test that plants a fault on purpose consumes it, and one left behind
# fails the test that left it, here, on a CPU (the interpreter records faults too) as on a GPU.
@pytest.fixture(autouse=True)
def _no_layout_fault_left_behind(request):
    yield
    if _poisoned_by is not None:          # the CUDA context is gone; the worker restarts
        return
    try:
        paged.raise_recorded_faults(gpulab.device())          # reports and clears
        return
    except paged.LayoutFault as e:
        left = str(e)
    pytest.fail(f"{request.node.nodeid} left a layout fault recorded (consume a planted one with "
                f"pytest.raises(LayoutFault) around gpulab.paged.raise_recorded_faults): {left}", pytrace=False)


# GPULAB_SHARD=k/n runs the k-th of n disjoint parts of the suite (tests spread by a hash of
# their id, so each part gets a share of every heavy file). A compiled run of the whole
# suite outlasts one call of the GPU tool; n calls with k = 1..n cover it exactly once.
# GPULAB_DURATIONS=FILE.json ({node id: seconds} from earlier GPU calls, tools/compiled_ledger.py)
# starts the longest tests first (with `--dist load`): a call cut at its time limit then
# loses a few short tests instead of a long one begun near the end. Tests with no known
# duration start before them: most are tests an earlier call stopped at its limit, and
# they need the whole of a call.
def order_by_duration(items):
    path = os.environ.get("GPULAB_DURATIONS")
    if not path:
        return
    try:
        took = json.loads(open(path).read())
    except (OSError, ValueError) as e:
        raise pytest.UsageError(f"GPULAB_DURATIONS: cannot read {path}: {e}") from None
    items.sort(key=lambda item: -took.get(item.nodeid, math.inf))
    EXPECTED_S.clear()
    EXPECTED_S.update({item.nodeid: took[item.nodeid] for item in items if item.nodeid in took})


# The order in which `--dist loadscope` hands scopes (a module, or a class of tests) to the
# workers, set here (pyproject.toml passes --no-loadscope-reorder): the compile-only checks
# first, then the other scopes, those with the most tests first, as xdist would. xdist's own
# order put the compile-only checks (one test per class, minutes each) last, and one of the
# two workers then ran them alone at the end of the suite.
STARTS_FIRST = "::TestEveryKernelCompilesFor_"


def order_scopes(items):
    def scope(item):
        return item.nodeid.rsplit("::", 1)[0]
    size = collections.Counter(scope(item) for item in items)
    items.sort(key=lambda item: (STARTS_FIRST not in item.nodeid, -size[scope(item)]))


# GPULAB_DEADLINE=epoch seconds (tools/gpu-suite.sh: the call's time limit): a test whose
# known duration (GPULAB_DURATIONS) would carry it past the deadline is skipped as
# DEADLINE_SKIP, not started and then killed, so that the worker runs shorter ones in that
# time. tools/compiled_ledger.py does not count such a skip as done.
DEADLINE_SKIP = "gpulab-deadline: would not finish before the call's time limit"
EXPECTED_S: dict[str, float] = {}        # node id -> seconds (GPULAB_DURATIONS)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    deadline = os.environ.get("GPULAB_DEADLINE")
    expected = EXPECTED_S.get(item.nodeid)
    if deadline and expected is not None and time.time() + expected > float(deadline):
        pytest.skip(DEADLINE_SKIP)


# GPULAB_PASSED=FILE leaves out the node ids listed in FILE (one per line): the tests that
# already passed compiled in earlier GPU calls (tools/compiled_ledger.py writes it).
def pytest_collection_modifyitems(config, items):
    passed = os.environ.get("GPULAB_PASSED")
    if passed:
        try:
            done = set(open(passed).read().split("\n"))
        except OSError as e:
            raise pytest.UsageError(f"GPULAB_PASSED: cannot read {passed}: {e}") from None
        drop = [item for item in items if item.nodeid in done]
        items[:] = [item for item in items if item.nodeid not in done]
        config.hook.pytest_deselected(items=drop)
    if os.environ.get("GPULAB_DURATIONS"):
        order_by_duration(items)
    else:
        order_scopes(items)
    shard = os.environ.get("GPULAB_SHARD")
    if not shard:
        return
    try:
        k, n = (int(v) for v in shard.split("/"))
        assert 1 <= k <= n
    except (ValueError, AssertionError):
        raise pytest.UsageError(f"GPULAB_SHARD must be k/n with 1 <= k <= n, got {shard!r}") from None
    keep, drop = [], []
    for item in items:
        (keep if zlib.crc32(item.nodeid.encode()) % n == k - 1 else drop).append(item)
    items[:] = keep
    config.hook.pytest_deselected(items=drop)
