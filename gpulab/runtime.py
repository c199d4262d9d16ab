"""Where gpulab's kernels run: compiled on a GPU, or in Triton's interpreter on the CPU.

Triton fixes its mode when ``@triton.jit`` decorates a function, so this module
must run before any kernel is defined: ``import gpulab`` does it first.

* A CUDA GPU is present  -> compiled Triton (``TRITON_INTERPRET=0``).
* No GPU (laptop, Binder, CPU Colab, CI) -> the interpreter (``TRITON_INTERPRET=1``):
  kernels run as NumPy on the CPU. Results are real, timings are not.
* If the user already set ``TRITON_INTERPRET``, their choice wins.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import os
import platform

_USER_CHOSE = "TRITON_INTERPRET" in os.environ


@functools.cache
def _cuda_available() -> bool:
    # cached: whether this process has a GPU does not change, and every public function's
    # checks ask (torch.cuda.is_available() costs microseconds per call)
    try:
        import torch
        return bool(torch.cuda.is_available())
    except Exception:  # a broken CUDA install should not stop the course
        return False


if not _USER_CHOSE:
    os.environ["TRITON_INTERPRET"] = "0" if _cuda_available() else "1"

# Compile-only mode (set by gpulab.harness.compile_check): launches are compiled for a
# GPU target instead of run, so CPU tensors are accepted without a GPU.
COMPILE_ONLY = os.environ.get("GPULAB_COMPILE_ONLY") == "1"


def _interpret_env() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


# Read once: Triton fixes its mode when a kernel is defined, and every public function
# asks (reading the environment cost 0.7 µs a call on a CPU, several times per call on a
# decode step's path). A process that changes TRITON_INTERPRET before it defines kernels
# (the compile check) calls refresh_mode().
_INTERPRETING = _interpret_env()


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter."""
    return _INTERPRETING


def refresh_mode() -> None:
    """Read ``TRITON_INTERPRET`` again (after changing it, before defining kernels)."""
    global _INTERPRETING
    _INTERPRETING = _interpret_env()


def mode() -> str:
    """'compiled', 'interpreter' or 'compile-only' (no GPU, interpreter switched off)."""
    if interpreting():
        return "interpreter"
    return "compiled" if _cuda_available() else "compile-only"


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive ``b``: ``triton.cdiv`` as plain Python. Since Triton 3.5,
    ``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions that cost about
    3-6 µs a call from Python (Triton 3.9 on a CPU), and a launcher calls them several times
    per launch: the package's launchers use these two, kernels keep Triton's."""
    return -(-int(a) // int(b))


def next_power_of_2(n: int) -> int:
    """The smallest power of two ≥ ``n`` (0 for n ≤ 0), as ``triton.next_power_of_2``."""
    n = int(n)
    return 1 << (n - 1).bit_length() if n > 0 else 0


def device():
    """The device learners' tensors live on: the GPU when compiled, else the CPU."""
    import torch
    return torch.device("cuda" if mode() == "compiled" else "cpu")


def gpu_name() -> str | None:
    if not _cuda_available():
        return None
    import torch
    return torch.cuda.get_device_name()


# In compile-only mode, the GPU generation launchers should plan for and its shared memory
# per block (set per target by gpulab.harness.compile_check, so architecture-dependent
# paths are compiled too).
COMPILE_TARGET: tuple[int, int] | None = None
COMPILE_SHARED_MEMORY: int | None = None


def compute_capability() -> tuple[int, int] | None:
    if not _cuda_available():
        return COMPILE_TARGET if COMPILE_ONLY else None
    import torch
    return _capability_of(torch.cuda.current_device())


@functools.cache
def _capability_of(index: int) -> tuple[int, int]:
    # cached: launchers ask on every call, and torch reads the device's properties each time
    import torch
    return torch.cuda.get_device_capability(index)


def shared_memory_per_block() -> int | None:
    """Bytes of shared memory a block may use on the current GPU (opted in: Triton does),
    the compile target's in compile-only checks; None without a GPU. Launchers whose
    best tiles need more than every sm_80 GPU has (about 100 KiB on sm_86/89) ask this."""
    if not _cuda_available():
        return COMPILE_SHARED_MEMORY if COMPILE_ONLY else None
    import torch
    return _shared_memory_of(torch.cuda.current_device())


@functools.cache
def _shared_memory_of(index: int) -> int:
    import torch
    props = torch.cuda.get_device_properties(index)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or props.shared_memory_per_block)


def default_dtype():
    """bfloat16 where the GPU has bf16 tensor cores (sm_80+), float16 on older GPUs
    such as Colab's T4, float32 in the interpreter (bf16 ``tl.dot`` is wrong there)."""
    import torch
    if mode() != "compiled":
        return torch.float32
    cc = compute_capability()
    return torch.bfloat16 if cc and cc[0] >= 8 else torch.float16


def supports(dtype) -> bool:
    """Can this machine's kernels use ``dtype``? (bf16 needs sm_80+ on a GPU.)"""
    import torch
    if dtype == torch.bfloat16 and mode() in ("compiled", "compile-only"):
        cc = compute_capability()
        return bool(cc and cc[0] >= 8)
    return True


def versions() -> dict:
    import torch
    import triton
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
    }


def env_report() -> str:
    """One paragraph for the first cell of every notebook."""
    v = versions()
    lines = [f"gpulab mode: {mode()}"]
    if mode() == "compiled":
        cc = compute_capability()
        lines.append(f"GPU: {gpu_name()} (sm_{cc[0]}{cc[1]}), CUDA {v['cuda']}")
    elif mode() == "interpreter":
        lines.append("No GPU in use: Triton kernels run in the interpreter on the CPU.")
        lines.append("Results are exact; timings are meaningless, so benchmarks show saved H200 figures.")
    else:
        lines.append("TRITON_INTERPRET=0 but no CUDA GPU: kernels can be compiled, not run.")
    lines.append(f"python {v['python']}, torch {v['torch']}, triton {v['triton']}, default dtype "
                 f"{str(default_dtype()).replace('torch.', '')}")
    return "\n".join(lines)


def runs_on(dev) -> bool:
    """Whether the current mode's kernels take tensors on device ``dev`` (the question
    :func:`check_device` answers with an error)."""
    m = mode()
    if m == "compiled":
        return dev.type == "cuda"
    return m != "interpreter" or dev.type == "cpu" or _cuda_available()


def check_device(name: str, t) -> None:
    """Raise a clear error when a tensor is on a device the current mode cannot run."""
    if runs_on(t.device):
        return
    m = mode()
    if m == "compiled" and t.device.type != "cuda":
        raise ValueError(f"{name} is on {t.device}, but kernels run on the GPU here: "
                         f"move it with {name}.cuda()")
    if m == "interpreter" and t.device.type != "cpu" and not _cuda_available():
        raise ValueError(f"{name} is on {t.device}; in interpreter mode use CPU tensors")


@functools.cache
def num_sms() -> int:
    """Streaming multiprocessors of the current GPU (132 on an H100/H200 when there is
    none, so compile-only runs pick the same launch configurations as the H200)."""
    if _cuda_available():
        return _sm_count(0)
    return 132


@functools.cache
def _sm_count(index: int) -> int:
    # cached: decode launchers ask on every call, and torch reads the properties each time
    import torch
    return torch.cuda.get_device_properties(index).multi_processor_count


def autotuning() -> bool:
    """Whether a kernel with several launch configurations times them (Triton's autotune,
    the default) or runs its first one. ``GPULAB_AUTOTUNE=0`` turns the timing off: the
    test suite sets it on a GPU, where compiling and timing every configuration of every
    shape a check tries dominated a compiled run. Tests check answers; benchmarks
    (which keep autotuning on) pick configurations. Read once, when kernels are defined."""
    return os.environ.get("GPULAB_AUTOTUNE", "1").lower() not in ("0", "false", "off")


def tuning_configs(configs: list) -> list:
    """``configs`` when :func:`autotuning` is on, else only the first (the default)."""
    return list(configs) if autotuning() else list(configs[:1])


# (autotuner, key) -> the launch arguments of the configuration it chose
_TUNED_CHOICES: dict = {}
# (autotuner, key) -> its DirectLaunch (compiled mode): the chosen kernel's compiled forms
_DIRECT: dict = {}
# GPULAB_DIRECT_LAUNCH=0 (or set_direct_launch(False)): every launch takes Triton's own path
_DIRECT_ON = os.environ.get("GPULAB_DIRECT_LAUNCH", "1") not in ("0", "false", "False", "off")


def set_direct_launch(on: bool) -> None:
    """Launch chosen configurations through :class:`DirectLaunch` (the default) or
    through Triton's own launch path (``GPULAB_DIRECT_LAUNCH=0`` at start-up): to compare
    the two, or to rule the direct path out when a launch misbehaves."""
    global _DIRECT_ON
    _DIRECT_ON = bool(on)


def launch_tuned(kernel, grid, key, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)`` for a ``triton.autotune`` kernel, without the
    autotuner's wrapper or Triton's launch path once it has chosen for ``key``.

    The wrapper rebuilds a dict of every argument and its key from them on every call:
    16 µs of host time per launch with 30 arguments on this repository's CPU (Triton 3.8),
    which a decode call pays per kernel while the GPU waits. The first call of a ``key``
    goes through the autotuner (tuning if it must); later ones launch the configuration
    it chose, compiled, through :class:`DirectLaunch`. ``key`` (hashable) must determine
    the autotuner's own key: the values of its key arguments and the dtypes of the
    tensor arguments."""
    direct = _DIRECT.get((kernel, key))
    if direct is not None and _DIRECT_ON:
        direct(grid, args, kwargs)
        return
    choice = _TUNED_CHOICES.get((kernel, key))
    if choice is not None:
        kernel.fn[grid](*args, **kwargs, **choice)
        return
    kernel[grid](*args, **kwargs)
    # no choice is kept where a hook runs before each launch, nor where nothing launches
    # (the compile check compiles several configurations on each call)
    config = getattr(kernel, "best_config", None)
    if config is not None and config.pre_hook is None and not COMPILE_ONLY:
        _TUNED_CHOICES[(kernel, key)] = choice = config.all_kwargs()
        if not interpreting():
            _DIRECT[(kernel, key)] = DirectLaunch(kernel.fn, choice)


# (jit function, configuration) -> its DirectLaunch, for kernels launched with a fixed one
_FIXED: dict = {}


def launch(fn, grid, config: dict, *args, **kwargs) -> None:
    """``fn[grid](*args, **kwargs, **config)`` for a ``@triton.jit`` kernel with a fixed
    launch configuration (block sizes, ``num_warps``): through :class:`DirectLaunch` on the
    compiled path, which spares a decode call Triton's host time as :func:`launch_tuned`
    does for a tuned kernel. ``kwargs`` may only name constexprs."""
    if not _DIRECT_ON or COMPILE_ONLY or interpreting():
        fn[grid](*args, **kwargs, **config)
        return
    key = (fn, tuple(config.items()))
    direct = _FIXED.get(key)
    if direct is None:
        direct = _FIXED[key] = DirectLaunch(fn, dict(config))
    direct(grid, args, kwargs)


class _Unclassified(Exception):
    """An argument DirectLaunch does not classify (a tuple, an object): Triton's path."""


def _arg_class(v):
    """What Triton specialises a kernel argument on (or something finer): an int's
    equality to 1, divisibility by 16 and width; a tensor's dtype and 16-byte alignment;
    the type of a float or bool; None or a string itself. Anything else (a tuple of
    arguments, an object) raises :class:`_Unclassified`: a key must never hold it."""
    t = type(v)
    if t is int:
        return t, v == 1, v & 15 == 0, -0x80000000 <= v <= 0x7FFFFFFF, v >= 1 << 63
    if t is float or t is bool:
        return t
    if hasattr(v, "data_ptr"):
        return v.dtype, v.data_ptr() & 15 == 0
    if v is None or t is str:
        return v
    raise _Unclassified


def _classifier(args: tuple, constexpr: frozenset):
    """A function of the argument tuple that returns what :func:`_arg_class` returns for
    each argument (a constexpr's value itself), written out for the types seen in
    ``args``: about half the host time of calling :func:`_arg_class` per argument. An
    int position that receives something else falls back to :func:`_arg_class`; a
    tensor position that receives something without ``dtype`` and ``data_ptr`` raises
    AttributeError (the caller then classifies argument by argument)."""
    parts = []
    for i, v in enumerate(args):
        a = f"a{i}"
        if i in constexpr:
            parts.append(a)
        elif type(v) is int:
            parts.append(f"(int, {a} == 1, {a} & 15 == 0, -0x80000000 <= {a} <= 0x7FFFFFFF, {a} >= 1 << 63) "
                         f"if type({a}) is int else arg_class({a})")
        elif hasattr(v, "data_ptr") and hasattr(v, "dtype"):
            parts.append(f"({a}.dtype, {a}.data_ptr() & 15 == 0)")
        else:
            parts.append(f"arg_class({a})")
    if not args:
        return lambda args: ()
    names = ", ".join(f"a{i}" for i in range(len(args)))
    namespace = {"arg_class": _arg_class}
    exec(f"def classify(args):\n    {names}, = args\n    return ({', '.join(parts)},)\n", namespace)
    return namespace["classify"]


class DirectLaunch:
    """Launch one configuration of a ``@triton.jit`` kernel through its compiled form.

    ``fn[grid](*args)`` binds every argument into a dict, specialises each one, builds
    a cache key as a string and launch metadata for profiler hooks before the launch
    itself: 19-29 µs of host time per call on the H200's host (Triton 3.6, the decode
    GEMV's 11 arguments, `tools/launch_probe.py`), more than the GEMV runs. Here the
    first call of each argument class goes through ``fn[grid]`` (which compiles if it
    must) and keeps the compiled kernel it returns; later calls of the same class
    (:func:`_arg_class` of every argument, a constexpr's value: the same compiled
    specialisation) call its launcher directly. Triton's own path is taken whenever a
    launch hook is set (a profiler such as Proton), a ``pre_run_hook`` or a keyword
    argument that is not a constexpr is given, or the internals used here are missing
    (another Triton)."""

    def __init__(self, fn, choice: dict):
        self.fn, self.choice = fn, choice              # choice: also what a grid function reads
        self.compiled: dict = {}                       # argument classes -> launch parts
        self.classifiers: dict = {}                    # number of arguments -> classifier
        self.constexpr = frozenset(getattr(fn, "constexprs", ()))
        self.constexpr_names = frozenset(p.name for p in getattr(fn, "params", ()) if p.is_constexpr)
        try:
            from triton import knobs
            from triton.runtime import driver
            self.enter_hooks, self.exit_hooks = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
            self.current_device = driver.active.get_current_device
            self.current_stream = driver.active.get_current_stream
            self.usable = (hasattr(self.enter_hooks, "calls") and hasattr(self.exit_hooks, "calls")
                           and hasattr(fn, "params"))
        except Exception:                               # no driver, or another Triton
            self.usable = False

    def _triton_launch(self, grid, args, kwargs):
        return self.fn[grid](*args, **kwargs, **self.choice)

    def _key(self, device, args: tuple, kwargs: dict):
        """The argument class of a call, or None where it has none (Triton's path)."""
        classify = self.classifiers.get(len(args))
        if classify is None:
            classify = self.classifiers[len(args)] = _classifier(args, self.constexpr)
        try:
            try:
                classes = classify(args)
            except AttributeError:                      # another type where a tensor was
                classes = ("any",) + tuple(_arg_class(v) if i not in self.constexpr else v
                                           for i, v in enumerate(args))
        except _Unclassified:
            return None
        if kwargs and not self.constexpr_names.issuperset(kwargs):
            return None                                 # a runtime argument by keyword
        return device, classes, tuple(kwargs.items()) if kwargs else ()

    def __call__(self, grid, args: tuple, kwargs: dict) -> None:
        if not self.usable or self.enter_hooks.calls or self.exit_hooks.calls or self.fn.pre_run_hooks:
            self._triton_launch(grid, args, kwargs)
            return
        device = self.current_device()
        key = self._key(device, args, kwargs)
        try:
            parts = None if key is None else self.compiled.get(key)
        except TypeError:                               # an unhashable constexpr value
            key = None
        if key is None:
            self._triton_launch(grid, args, kwargs)
            return
        if parts is None:
            compiled = self._triton_launch(grid, args, kwargs)
            self.compiled[key] = self._parts(compiled, args, kwargs)
            return
        if parts is False:                              # this class always takes Triton's path
            self._triton_launch(grid, args, kwargs)
            return
        run, function, metadata, tail = parts
        if callable(grid):
            grid = grid(self.choice if not kwargs else {**self.choice, **kwargs})
        n = len(grid)
        run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, self.current_stream(device),
            function, metadata, None, None, None, *args, *tail)

    def _parts(self, compiled, args, kwargs):
        """(launcher, function, packed metadata, trailing constexpr arguments) of a
        compiled kernel, or False where it cannot be launched directly."""
        rest = self.fn.params[len(args):]
        if not all(p.is_constexpr for p in rest):
            return False
        try:
            tail = tuple(kwargs.get(p.name, self.choice.get(p.name, p.default)) for p in rest)
            return compiled.run, compiled.function, compiled.packed_metadata, tail
        except AttributeError:
            return False


def fast() -> bool:
    """True under CI (``CI`` set) or ``GPULAB_FAST=1``: notebooks shorten long demos
    such as training runs, and benchmarks run on a GPU leave out the ``torch.compile``
    baselines; checks are unchanged."""
    return bool(os.environ.get("CI")) or os.environ.get("GPULAB_FAST") == "1"


# Data-dependent input validation (page ids in range, lengths within capacity) reads
# device data and so synchronises the host with the GPU. Public functions skip it by
# default; GPULAB_DEBUG=1 or set_debug_checks(True) turns it on for every call.
_DEBUG_CHECKS: bool | None = None


def debug_checks() -> bool:
    """True when public functions run their data-dependent validation on every call
    (``GPULAB_DEBUG=1`` in the environment, or :func:`set_debug_checks`)."""
    if _DEBUG_CHECKS is not None:
        return _DEBUG_CHECKS
    return os.environ.get("GPULAB_DEBUG", "") not in ("", "0", "false", "False")


def set_debug_checks(on: bool | None) -> None:
    """Switch the data-dependent validation of every call on or off (None: follow
    ``GPULAB_DEBUG`` again)."""
    global _DEBUG_CHECKS
    _DEBUG_CHECKS = None if on is None else bool(on)


class Compilations:
    """What :func:`count_compilations` saw: ``names`` of the kernels compiled, in order,
    and Triton's description of each (``details``: launch options and argument types,
    which show the specialisation that was new)."""

    def __init__(self):
        self.names: list[str] = []
        self.details: list[str] = []

    @property
    def count(self) -> int:
        return len(self.names)


@contextlib.contextmanager
def count_compilations():
    """Count the Triton kernels compiled inside the block: each new specialisation of a
    kernel (a new constexpr, a new autotuning key, an integer argument that changes
    between multiple-of-16, 1 and other) costs a compile of about a second on a GPU host,
    so a serving loop that still compiles is not yet measuring steady state. Counts 0 in
    the interpreter, which compiles nothing. Nests."""
    seen = Compilations()
    try:
        from triton import knobs
        runtime_knobs = knobs.runtime
    except (ImportError, AttributeError):     # triton < 3.4: no hook to count with
        yield seen
        return
    previous = runtime_knobs.jit_post_compile_hook

    def hook(*args, fn=None, **kwargs):
        seen.names.append(str(getattr(fn, "name", "?")))
        seen.details.append(str(kwargs.get("repr", "")))
        return previous(*args, fn=fn, **kwargs) if previous else None

    runtime_knobs.jit_post_compile_hook = hook
    try:
        yield seen
    finally:
        runtime_knobs.jit_post_compile_hook = previous


@contextlib.contextmanager
def cuda_graph_capture(graph, pool=None, stream=None):
    """``torch.cuda.graph(graph, pool, stream)`` with Python's garbage collector held off.

    A collection that runs inside a capture (any allocation of Python objects can start
    one) may free an unreachable engine from earlier, and destroying its CUDA graphs is not
    allowed while a stream captures: the new graph is invalidated (seen on the H200,
    2026-12-01, when a worker's earlier test left an engine behind). PyTorch no longer
    collects before a capture, as it once did: we collect once, then hold it off."""
    import torch
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            yield
    finally:
        if enabled:
            gc.enable()
