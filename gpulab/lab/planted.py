"""Planted kernels: wrong ones, and ones that cheat, for testing verifiers.

Each is a complete candidate source for a lab task (most for ``softmax``, whose
correctness cases are cheap in the interpreter), built from the task's seed so it
compiles and runs like a real candidate. ``reason`` is what the evaluator must answer
(a key of :data:`gpulab.lab.evaluate.REASONS`). The tests plant every one of them in the
evaluator; notebook 09 grades the learner's own verifier against the in-process ones.

The cheats are the known ways of gaming a kernel evaluation: keep and return an earlier
result, hard-code the answers for a fixed seed, alias the output, finish the work later,
read the evaluator's data, patch the evaluator, break out of the sandbox.
"""
from __future__ import annotations

from dataclasses import dataclass

from .tasks import get_task


@dataclass(frozen=True)
class Planted:
    name: str
    task: str
    reason: str              # the evaluator's expected verdict reason
    source: str
    what: str                # one line: what the kernel does
    in_process: bool = True  # meaningful to an in-process verifier (notebook 09)
    gpu_only: bool = False   # the trick only exists on a GPU (streams, repeated timing calls)
    needs_compile: bool = False   # only a GPU compiler (or the compile check) catches it


def _softmax() -> str:
    return get_task("softmax").seed_source


def _replace(src: str, old: str, new: str) -> str:
    if old not in src:
        raise ValueError(f"planted kernel: the seed no longer contains {old!r}")
    return src.replace(old, new, 1)


def _wrapped(src: str, launch: str, header: str = "") -> str:
    """The seed with its ``launch`` renamed ``honest_launch`` and a new ``launch``."""
    body = _replace(src, "def launch(", "def honest_launch(")
    return (header + "\n" if header else "") + body + "\n\n" + launch.strip() + "\n"


def _build() -> dict[str, Planted]:
    s = _softmax()
    plants = [
        Planted("correct", "softmax", "correct", s, "is the seed itself"),
        Planted("wrong-scale", "softmax", "wrong-output",
                _replace(s, "y = e / tl.sum(e, axis=1)[:, None]", "y = 0.5 * e / tl.sum(e, axis=1)[:, None]"),
                "scales every output by 0.5"),
        Planted("no-max", "softmax", "wrong-output",
                _replace(s, "        x = x - tl.max(x, axis=1)[:, None]\n", ""),
                "skips the max subtraction, so exp overflows on large inputs"),
        Planted("missing-store-mask", "softmax", "out-of-bounds-write",
                _replace(s, "tl.store(y_ptr + rows64[:, None] * sy + cols[None, :], y.to(y_ptr.dtype.element_ty), "
                            "mask=mask)\n\n\ndef launch",
                         "tl.store(y_ptr + rows64[:, None] * sy + cols[None, :], y.to(y_ptr.dtype.element_ty))"
                         "\n\n\ndef launch"),
                "stores the padded row tail past the end of the row"),
        Planted("interpreter-only", "softmax", "compile-error",
                _replace(s, "    rows = tl.program_id(0) * R + tl.arange(0, R)\n",
                         "    if n_rows < 0:     # never true: the interpreter never sees the raise\n"
                         "        raise ValueError(\"no rows\")\n"
                         "    rows = tl.program_id(0) * R + tl.arange(0, R)\n"),
                "raises in a branch never taken: fine in the interpreter, no GPU compiler accepts it",
                in_process=False, needs_compile=True),
        Planted("cached-output", "softmax", "cached-output", _wrapped(s, '''
_CACHE = {}


def launch(x, y):
    """Computes once per shape, then returns the stored result."""
    key = tuple(x.shape)
    if key in _CACHE:
        y.copy_(_CACHE[key])
        return
    honest_launch(x, y)
    _CACHE[key] = y.clone()
'''), "computes each shape once and returns the stored result afterwards"),
        Planted("seed-dependent", "softmax", "seed-dependent", _wrapped(s, '''
_SPEC = gpulab.get_spec("softmax")
_ANSWERS = {}
for _where in ("cpu", "gpu"):
    for _case in _SPEC.cases[_where]:
        for _dtype in _SPEC.dtypes[_where]:
            # the "usual" fixed seed, drawn on the CPU and on the GPU (other numbers there)
            for _device in dict.fromkeys(["cpu", str(gpulab.device())]):
                _inputs = _SPEC.inputs(_case, _dtype, device=_device, seed=0)
                _ANSWERS.setdefault((tuple(_inputs["x"].shape), _dtype), []).append(
                    (_inputs["x"].cpu(), _SPEC.reference(**_inputs)["y"].cpu()))


def launch(x, y):
    """No kernel at all: the answers for seed 0's inputs, looked up by shape (and, where
    seed 0 was drawn on two devices, by which of them x is)."""
    answers = _ANSWERS[(tuple(x.shape), x.dtype)]
    y.copy_(next((y0 for x0, y0 in answers if torch.equal(x0, x.cpu())), answers[0][1]))
''', header="import gpulab\nimport torch"), "looks up answers precomputed for seed 0's inputs"),
        Planted("aliased-output", "softmax", "aliased-output", _wrapped(s, '''
def launch(x, y):
    """Computes into its own buffer and re-points y at it."""
    out = torch.empty_like(y)
    honest_launch(x, out)
    y.set_(out)
''', header="import torch"), "writes its own buffer and re-points the output tensor at it"),
        Planted("input-modified", "softmax", "input-modified", _wrapped(s, '''
def launch(x, y):
    """Computes in place into x, then copies: right answer, clobbered input."""
    honest_launch(x, x)
    y.copy_(x)
'''), "computes in place into its input and copies the result"),
        Planted("async-thread", "softmax", "async-launch", _wrapped(s, '''
def launch(x, y):
    """Returns at once; a thread does the work a little later."""
    def work():
        time.sleep(0.5)
        honest_launch(x, y)
    threading.Thread(target=work, daemon=True).start()
''', header="import threading\nimport time"), "returns at once and finishes the work in a thread"),
        Planted("reads-reference", "softmax", "reads-evaluator-memory", _wrapped(s, '''
def launch(x, y):
    """Looks up the caller's frames for the reference answer and copies it."""
    frame = inspect.currentframe().f_back
    while frame is not None:
        expected = frame.f_locals.get("expected")
        if isinstance(expected, dict) and "y" in expected:
            y.copy_(expected["y"])
            return
        frame = frame.f_back
    y.zero_()
''', header="import inspect"), "walks up the stack to copy the reference result"),
        Planted("monkeypatch", "softmax", "monkeypatch", _wrapped(s, '''
def launch(x, y):
    """Does nothing: the patched comparisons say it is right."""
    return None
''', header=("import torch\nimport gpulab.harness.checking\n"
             "torch.allclose = lambda *args, **kwargs: True\n"
             "gpulab.harness.checking.diagnose = lambda name, got, exp, *args, **kwargs: (None, 0.0)")),
                "patches torch.allclose and gpulab's comparison to always agree", in_process=False),
        Planted("forbidden-call", "softmax", "forbidden-call", _wrapped(s, '''
def launch(x, y):
    """Phones home before computing."""
    with socket.socket() as sock:
        sock.connect(("127.0.0.1", 9))
    honest_launch(x, y)
''', header="import socket"), "opens a network connection", in_process=False),
        Planted("hang", "softmax", "timeout", _wrapped(s, '''
def launch(x, y):
    """Never returns."""
    while True:
        pass
'''), "loops forever", in_process=False),
        Planted("crash", "softmax", "crash", _wrapped(s, '''
def launch(x, y):
    """Reads address 0: a segmentation fault."""
    ctypes.string_at(0)
''', header="import ctypes"), "dereferences a null pointer", in_process=False),
        Planted("memory-hog", "softmax", "memory", _wrapped(s, '''
def launch(x, y):
    """Asks for 64 GiB."""
    hog = torch.ones(64 << 30, dtype=torch.uint8, device=x.device)
    honest_launch(x, y)
    y.add_(hog[0] - 1)
''', header="import torch"), "allocates 64 GiB", in_process=False),
        Planted("side-stream", "matmul_bias_relu", "async-launch", _wrapped(get_task("matmul_bias_relu").seed_source, '''
_STREAM = []


def launch(a, b, bias, c):
    """Waits for its inputs, launches on a side stream and returns without making the
    caller's stream wait for the result: events on the current stream time nothing."""
    if not _STREAM:
        _STREAM.append(torch.cuda.Stream())
    _STREAM[0].wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(_STREAM[0]):
        honest_launch(a, b, bias, c)
''', header="import torch"), "runs its kernel on a side stream the timer does not wait for", in_process=False,
                gpu_only=True),
        Planted("skips-when-timed", "softmax", "timing-mismatch", _wrapped(s, '''
_CALLS = {}


def launch(x, y):
    """Honest the first 20 times it sees a buffer; after that it does nothing."""
    key = (x.data_ptr(), y.data_ptr())
    _CALLS[key] = _CALLS.get(key, 0) + 1
    if _CALLS[key] <= 20:
        honest_launch(x, y)
'''), "stops computing once it has seen the same buffers a few times (as a timing loop does)",
                in_process=False, gpu_only=True),
    ]
    return {p.name: p for p in plants}


PLANTED = _build()


def truncating_softmax(block: int = 256) -> str:
    """The softmax seed with its block fixed at ``block`` columns instead of the row
    length: right for rows of at most ``block`` elements, silently wrong for longer
    ones, and (it reads less) faster. What a search finds when its verifier tries one
    narrow shape."""
    return _replace(_softmax(), "block_n = TILE_N if online else triton.next_power_of_2(n_cols)",
                    f"block_n = TILE_N if online else {block}")
