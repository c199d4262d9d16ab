"""Mode selection, compile checks for real GPU targets, and benchmark honesty."""
import gc
import os
import subprocess
import sys

import pytest
import torch

import gpulab
from gpulab import runtime
from gpulab.harness import bench
from helpers import load_tool


def _mode_in_subprocess(env):
    code = "import gpulab, os; print(gpulab.mode(), os.environ['TRITON_INTERPRET'])"
    full = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True,
                          text=True, check=True).stdout.split()


def test_mode_follows_the_hardware_unless_the_user_chose():
    expected = ["compiled", "0"] if torch.cuda.is_available() else ["interpreter", "1"]
    assert _mode_in_subprocess({}) == expected
    assert _mode_in_subprocess({"TRITON_INTERPRET": "1"}) == ["interpreter", "1"]


def test_env_report_names_mode_and_versions():
    text = runtime.env_report()
    assert gpulab.mode() in text and "triton" in text and "torch" in text


def _compile_for(arch):
    r = subprocess.run([sys.executable, "-m", "gpulab", "compile-check", "--arch", str(arch)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "0 failures" in r.stdout


def test_compile_check_names_what_it_does_not_know(monkeypatch, capsys):
    from gpulab.harness import compile_check
    monkeypatch.setenv("TRITON_INTERPRET", "0")      # as in its own process: no re-exec
    monkeypatch.setenv("GPULAB_COMPILE_ONLY", "1")
    for argv, says in ((["no_such_kernel"], "no kernel spec named no_such_kernel; the specs are: "),
                       (["--arch", "91"], "the targets are [75, 80, 90]"),
                       (["--arch", "sm90"], "--arch takes numbers")):
        with pytest.raises(SystemExit) as e:
            compile_check.main(argv)
        assert e.value.code == 2 and says in capsys.readouterr().err


# One class per target so that pytest-xdist (--dist loadscope) compiles them in parallel.
for _arch in (75, 80, 90):
    _cls = f"TestEveryKernelCompilesFor_sm{_arch}"
    globals()[_cls] = pytest.mark.skipif(
        torch.cuda.is_available(), reason="compile-only check is for machines without a GPU")(
        type(_cls, (), {"test_compile": (lambda self, a=_arch: _compile_for(a))}))


@pytest.mark.skipif(gpulab.mode() == "compiled", reason="interpreter-only behaviour")
def test_benchmarks_refuse_interpreter_timings():
    with pytest.raises(bench.InterpreterTiming, match="timings say nothing"):
        bench.time_ms(lambda: None)
    r = subprocess.run([sys.executable, "-m", "gpulab", "bench", "softmax"], capture_output=True, text=True)
    assert r.returncode == 2 and "needs a GPU" in r.stderr


def test_saved_results_are_complete_and_plot(monkeypatch):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gpulab.harness import plots
    saved = sorted(bench.RESULTS.glob("*.json"))
    if not saved:
        pytest.skip("no saved benchmark results yet")
    for path in saved:
        result = bench.load(path.stem)
        for key in ("date", "gpu", "versions", "ceilings", "rows"):
            assert key in result, f"{path.name} lacks {key}"
        assert any(r["impl"] == "gpulab" and r.get("ms") for r in result["rows"]), path.name
        assert "gpulab is" in bench.format_table(result)
        monkeypatch.setattr("matplotlib.pyplot.show", lambda: None)
        plots.plot(result)
        plt.close("all")                   # one figure per saved result: keep one open at a time


@pytest.mark.skipif(gpulab.mode() != "compiled", reason="needs a GPU")
def test_bench_runs_on_gpu():
    from gpulab.harness.spec import Case
    result = bench.run("vector_add", cases=[Case("small", dict(n=1 << 20))], compile_baselines=False)
    ours = next(r for r in result["rows"] if r["impl"] == "gpulab")
    assert ours["ms"] > 0 and 0 < ours["roofline_pct"] < 150


def test_count_compilations_records_each_compile_and_restores_the_hook():
    knobs = pytest.importorskip("triton.knobs")
    from types import SimpleNamespace

    calls = []

    def outer_hook(*args, **kwargs):
        calls.append(kwargs["fn"].name)

    previous = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = outer_hook
    try:
        with runtime.count_compilations() as outer:
            with runtime.count_compilations() as inner:
                # what Triton calls after compiling a new specialisation (JITFunction._call_hook)
                knobs.runtime.jit_post_compile_hook(key=None, repr="k[num_warps=4](M: i32)",
                                                    fn=SimpleNamespace(name="k"), compile={},
                                                    is_manual_warmup=False, already_compiled=False)
            assert knobs.runtime.jit_post_compile_hook is not None
        assert (inner.count, inner.names, inner.details) == (1, ["k"], ["k[num_warps=4](M: i32)"])
        assert outer.count == 1 and calls == ["k"]         # nested counters and the hook before them all see it
        assert knobs.runtime.jit_post_compile_hook is outer_hook
    finally:
        knobs.runtime.jit_post_compile_hook = previous
    x = torch.ones(5, device=runtime.device())
    with runtime.count_compilations() as seen:
        gpulab.basics.vector_add(x, x)
        gpulab.basics.vector_add(x, x)
    if runtime.mode() == "interpreter":                     # the interpreter compiles nothing
        assert seen.count == 0
    else:                                                   # compiled at most once (a warm cache: 0)
        assert seen.count <= 1 and set(seen.names) <= {"add_kernel"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_capture_survives_an_earlier_graph_left_to_the_garbage_collector():
    """A collection inside a capture that destroys an unreachable graph invalidates the
    capture (an engine left behind by a worker's earlier test, H200, 2026-12-01):
    runtime.cuda_graph_capture collects first and holds the collector off. Here the
    collector is kept from running until the capture has begun, then made to run at the
    next allocation, as it may in a long test session."""
    x = torch.ones(8, device="cuda")

    def leave_a_graph_behind():
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = x * 2                  # memory of the graph's own pool, freed with the graph
        cycle = {"graph": g, "y": y}
        cycle["self"] = cycle          # only the collector frees it
    threshold = gc.get_threshold()
    gc.set_threshold(1_000_000)        # no collection before the capture begins
    try:
        leave_a_graph_behind()
        g = torch.cuda.CUDAGraph()
        with runtime.cuda_graph_capture(g):
            gc.set_threshold(1)        # a collection at the next allocation, inside the capture
            for _ in range(50):
                [object() for _ in range(20)]
                x.mul_(2)
        assert gc.isenabled()
        x.fill_(1)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(x, torch.full_like(x, 2.0 ** 50))
    finally:
        gc.set_threshold(*threshold)


def test_the_launchers_integer_helpers_equal_tritons():
    """runtime.cdiv and runtime.next_power_of_2 stand in for Triton's in launchers (Triton's
    are constexpr functions since 3.5: microseconds a call from Python); same values."""
    import triton
    for n in range(0, 300):
        assert runtime.next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 3, 16, 128):
            assert runtime.cdiv(n, d) == triton.cdiv(n, d), (n, d)
    assert runtime.next_power_of_2(2 ** 40 + 1) == 2 ** 41


def test_the_host_path_tool_times_its_calls_without_launching():
    """tools/host_path.py replaces kernels by no-ops in its own process (never in the
    test's) and times the Python of a decode-sized call."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, os.path.join(root, "tools", "host_path.py"), "--calls", "70"],
                         capture_output=True, text=True, timeout=300, cwd=root)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line for line in out.stdout.splitlines() if "µs a call (launches stubbed" in line]
    assert [" ".join(line.split()[:2]) for line in lines] == [
        "paged_decode_attention B4", "cascade_decode_attention 256", "ternary_matmul M=1", "ternary_matmul M=16"], \
        out.stdout


def test_launch_tuned_asks_the_autotuner_once_per_key_then_launches_its_choice(monkeypatch):
    """The first launch of a key goes through the autotuner; later ones launch the kernel
    itself with the configuration the autotuner chose for that key, not another key's.
    A configuration with a pre-launch hook, or the compile check, keeps the autotuner."""
    import triton

    class Kernel:
        def __init__(self, log):
            self.log = log

        def __getitem__(self, grid):
            return lambda *args, **kwargs: self.log.append(("kernel", grid, args, kwargs))

    class Tuner:
        def __init__(self, choices):
            self.log, self.choices = [], choices
            self.fn = Kernel(self.log)

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                self.best_config = self.choices[kwargs["K"]]
                self.log.append(("autotuner", grid, args, kwargs))
            return run

    small, big = triton.Config({"BLOCK": 32}, num_warps=4), triton.Config({"BLOCK": 128}, num_warps=8)
    tuner = Tuner({1: small, 2: big})
    for k in (1, 1, 2, 1, 2):
        runtime.launch_tuned(tuner, (7,), ("key", k), "x", K=k)
    assert [entry[0] for entry in tuner.log] == ["autotuner", "kernel", "autotuner", "kernel", "kernel"]
    assert tuner.log[1][1:] == ((7,), ("x",), {"K": 1, **small.all_kwargs()})
    assert tuner.log[4][3] == {"K": 2, **big.all_kwargs()}

    hooked = Tuner({1: triton.Config({"BLOCK": 32}, pre_hook=lambda nargs: None)})
    for _ in range(2):
        runtime.launch_tuned(hooked, (1,), "hooked", K=1)
    assert [entry[0] for entry in hooked.log] == ["autotuner", "autotuner"]
    monkeypatch.setattr(runtime, "COMPILE_ONLY", True)
    compiling = Tuner({1: small})
    for _ in range(2):
        runtime.launch_tuned(compiling, (1,), "compile", K=1)
    assert [entry[0] for entry in compiling.log] == ["autotuner", "autotuner"]


def test_direct_launch_reuses_a_compiled_kernel_only_for_its_argument_class():
    """DirectLaunch launches the compiled kernel Triton returned for the same argument
    class (an int's 1 / multiple of 16 / width, a tensor's dtype and 16-byte alignment,
    a constexpr's value) and goes through Triton's path for a new class, a launch hook,
    a pre-run hook or a keyword argument that is not a constexpr."""
    import types

    import torch
    from triton import knobs

    log = []

    class Compiled:
        def __init__(self, n):
            self.function, self.packed_metadata, self.n = f"function{n}", f"meta{n}", n

        @property
        def run(self):
            return lambda *a: log.append(("direct", self.n, a))

    def param(name, constexpr=False, default=None):
        return types.SimpleNamespace(name=name, is_constexpr=constexpr, default=default)

    class Fn:
        params = [param("x"), param("n"), param("SCALE", True), param("FLAG", True, default=0),
                  param("BLOCK", True)]
        constexprs = [2, 3, 4]
        pre_run_hooks = []

        def __getitem__(self, grid):
            def triton_path(*args, **kwargs):
                compiled = Compiled(len([e for e in log if e[0] == "triton"]))
                log.append(("triton", compiled.n, grid, args, kwargs))
                return compiled
            return triton_path

    launch = runtime.DirectLaunch(Fn(), {"BLOCK": 64})
    launch.usable, launch.current_device, launch.current_stream = True, lambda: 0, lambda device: "stream"
    x = torch.zeros(64)
    grid = lambda meta: (meta["BLOCK"], 2)  # noqa: E731

    def call(*args, **kwargs):
        launch(grid, args, kwargs)
        return log[-1]

    first = call(x, 32, 1.0)
    assert first[0] == "triton" and first[4] == {"BLOCK": 64}
    again = call(x, 48, 1.0)                             # same class: 48 is a multiple of 16 too
    assert again[:2] == ("direct", 0)
    assert again[2] == (64, 2, 1, "stream", "function0", "meta0", None, None, None, x, 48, 1.0, 0, 64)
    for args in ((x, 33, 1.0), (x, 1, 1.0), (x[1:], 32, 1.0), (x.half(), 32, 1.0), (x, 32, 2.0), (x, 1 << 40, 1.0)):
        assert call(*args)[0] == "triton", args            # a new class (or constexpr value) compiles
        assert call(*args)[0] == "direct", args
    assert call(x, 32, 1.0, FLAG=1)[0] == "triton"        # a constexpr keyword is part of the class
    assert call(x, 32, 1.0, FLAG=1)[0] == "direct"
    for args in ((7, 32, 1.0), (x, x, 1.0), (x, x.half(), 1.0), (x, True, 1.0)):
        assert call(*args)[0] == "triton", args            # another type where the first call had one
        assert call(*args)[0] == "direct", args

    knobs.runtime.launch_enter_hook.add(hook := lambda metadata: None)
    try:
        assert call(x, 32, 1.0)[0] == "triton"           # a profiler sees every launch
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    Fn.pre_run_hooks.append(lambda *a, **k: None)
    assert call(x, 32, 1.0)[0] == "triton"
    Fn.pre_run_hooks.clear()
    assert call(x, 32, 1.0)[0] == "direct"

    not_constexpr = runtime.DirectLaunch(Fn(), {"BLOCK": 64})
    not_constexpr.usable, not_constexpr.current_device = True, lambda: 0
    for _ in range(2):                                   # n given by keyword: never direct
        not_constexpr(grid, (x,), {"n": 32, "SCALE": 1.0})
        assert log[-1][0] == "triton"
    kept = len(launch.compiled)
    for _ in range(2):                                   # a tuple argument: never direct, never kept
        assert call(x, (x, 1), 1.0)[0] == "triton"
    assert len(launch.compiled) == kept and not not_constexpr.compiled


def test_written_out_classifier_agrees_with_arg_class():
    """The classifier DirectLaunch writes out for an argument layout returns what
    _arg_class returns argument by argument (a constexpr position: the value), for every
    kind of value each position may later receive."""
    import torch

    x = torch.zeros(40)
    layout = (x, 5, 2.0, None, True, 16)
    classify = runtime._classifier(layout, frozenset({5}))
    values = [x, x[1:], x.half(), 1, 16, 17, 0, -16, 1 << 40, (1 << 63) + 5, 2.5, True, False, None, "s",
              (x, 1), object()]
    for i in range(len(layout)):
        for v in values:
            args = layout[:i] + (v,) + layout[i + 1:]
            if i != 5 and type(v) in (tuple, object):
                with pytest.raises((runtime._Unclassified, AttributeError)):    # never part of a key
                    classify(args)
                continue
            expected = tuple(a if j == 5 else runtime._arg_class(a) for j, a in enumerate(args))
            try:
                got = classify(args)
            except AttributeError:       # a tensor position given something else: classified one by one
                assert i == 0 and not isinstance(v, torch.Tensor)
                continue
            assert got == expected, (i, v)


@pytest.mark.skipif(gpulab.mode() != "compiled", reason="needs a GPU")
def test_decode_kernels_launch_directly_once_compiled():
    """Compiled, the decode path's kernels (ternary GEMVs of both layouts, the split-K
    reduce, rmsnorm_quant, paged decode; a prompt step's append attention and its
    split-KV merge) really take DirectLaunch's path from their
    second call: a change that sent
    them back to Triton's launch path would still give right answers, so only this
    notices."""
    import triton

    from gpulab import bitlinear, normquant, paged, prefill

    dev = torch.device("cuda")
    x = torch.randn(3, 256, device=dev, dtype=torch.bfloat16)
    w_t, s = bitlinear.ternary_quantize(torch.randn(512, 256, device=dev))
    wp, ws = bitlinear.pack_ternary(w_t), s.reshape(1).float()
    k_cache = torch.randn(16, 16, 2, 64, device=dev, dtype=torch.bfloat16)
    q = torch.randn(2, 4, 64, device=dev, dtype=torch.bfloat16)
    # 8 pages a row: 128 positions, enough for the append kernel's KV to split in two
    table = torch.arange(16, device=dev, dtype=torch.int32).reshape(2, 8)
    lens = torch.tensor([100, 17], device=dev, dtype=torch.int32)
    w16 = bitlinear.pack_ternary_x16(w_t)
    qa = torch.randn(5, 4, 64, device=dev, dtype=torch.bfloat16)
    indptr = torch.tensor([0, 2, 5], device=dev, dtype=torch.int32)
    for _ in range(3):
        x_q, x_scale = normquant.rmsnorm_quant(x, torch.ones(256, device=dev))
        bitlinear.ternary_matmul(x_q[:1], x_scale[:1], wp, ws)
        bitlinear.ternary_matmul(x_q[:1], x_scale[:1], w16, ws)          # int32x16
        bitlinear.ternary_gemv_x16_into(x_q[:1], x_scale[:1], w16, ws,   # a fixed tile and split
                                        torch.empty(1, 512, device=dev), split_k=2,
                                        config={"BLOCK_N": 32, "BLOCK_G": 8, "num_warps": 4})
        paged.paged_decode_attention(q, k_cache, k_cache, table, lens)
        # a prompt step's attention, its KV split in two parts merged by the split reduce
        prefill.append_attention_into(qa, k_cache, k_cache, indptr, table, lens, True, None,
                                      torch.empty_like(qa), torch.empty(5, 4, device=dev), num_splits=2)
    torch.cuda.synchronize()
    launched = {}                                        # kernel name -> launched directly at least once
    for direct in (*runtime._DIRECT.values(), *runtime._FIXED.values()):
        if not isinstance(direct.fn, triton.runtime.JITFunction):
            continue                                     # another test's fake kernel, same process
        name = direct.fn.fn.__name__
        launched[name] = launched.get(name, False) or (direct.usable and any(direct.compiled.values()))
    for part in ("ternary_gemv_kernel", "ternary_gemv_x16", "split_k_reduce", "rmsnorm_quant_fwd", "decode_partition",
                 "append_attention", "split_reduce"):
        assert any(part in name and ok for name, ok in launched.items()), (part, launched)


def test_direct_launch_can_be_turned_off_from_the_environment():
    """GPULAB_DIRECT_LAUNCH=0 at start-up sends every launch through Triton's own path."""
    code = "from gpulab import runtime; print(runtime._DIRECT_ON)"
    for value, expected in (("0", "False"), ("1", "True"), (None, "True")):
        env = {k: v for k, v in os.environ.items() if k != "GPULAB_DIRECT_LAUNCH"}
        if value is not None:
            env["GPULAB_DIRECT_LAUNCH"] = value
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        assert out.stdout.strip() == expected, (value, out.stderr[-500:])


def test_spec_host_profile_says_what_to_fix_before_it_needs_a_gpu(capsys):
    """tools/spec_host_profile.py (run on the GPU host) checks its spec names and case
    indices first, so a typo is named on any machine, and says where it must run."""
    tool = load_tool("spec_host_profile")
    assert tool.main(["/tmp/unused", "ternary_matmull"]) == 2
    assert "no kernel spec named ternary_matmull" in capsys.readouterr().err
    assert tool.main(["/tmp/unused", "ternary_matmul:3"]) == 2
    assert "CASE must be 0..2, got '3'" in capsys.readouterr().err
    if not (torch.cuda.is_available() and runtime.mode() == "compiled"):
        assert tool.main(["/tmp/unused", "ternary_matmul:1"]) == 2
        assert "run it on the GPU host" in capsys.readouterr().err


@pytest.mark.skipif(not (torch.cuda.is_available() and runtime.mode() == "compiled"), reason="times a GPU")
def test_host_and_wall_us_times_queued_calls():
    x = torch.ones(1 << 20, device="cuda")
    paced = bench.host_and_wall_us(lambda: gpulab.basics.vector_add(x, x), 20)
    assert 0 < paced["host_us"] <= paced["wall_us"] + 1.0
    assert set(paced["allocator"]) == {"num_device_alloc", "num_device_free", "num_alloc_retries",
                                       "num_sync_all_streams"}
