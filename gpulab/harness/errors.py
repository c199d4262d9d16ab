"""Errors a learner can read: short messages instead of interpreter tracebacks.

``gpulab.setup()`` registers :func:`show_learner_error` as IPython's handler for every
exception raised by a cell. It rewrites three kinds and leaves all others to IPython:

* an **unfinished exercise** (the generated stub: ``raise NotImplementedError("TODO
  (ex...)")`` or, in a kernel, ``tl.static_assert(False, "TODO (ex...)")``, which
  Triton reports through two chained exceptions): one short message naming the
  exercise, the function, the cell and line of the placeholder, and what the
  function should compute;
* a **failed check** (:class:`~gpulab.harness.checking.CheckFailure`): the diagnosis
  alone, without the frames of gpulab's harness;
* **any other error raised by the learner's code while a check runs**: the learner's
  own lines first (innermost first), the error, and the case it happened on; the
  frames of gpulab, Triton and PyTorch are hidden.

The error itself is unchanged (same type and message), so ``gpulab grade``, nbval and
nbgrader see what they saw before. ``gpulab.verbose_errors(True)`` (or the environment
variable ``GPULAB_VERBOSE_ERRORS=1``) restores IPython's full tracebacks.
"""
from __future__ import annotations

import linecache
import os
import re
import sys
import sysconfig
import textwrap
import traceback
from pathlib import Path

from .checking import CheckFailure

VERBOSE_ENV = "GPULAB_VERBOSE_ERRORS"
SWITCH_NOTE = f"(full traceback: gpulab.verbose_errors(True) or {VERBOSE_ENV}=1)"
TODO = re.compile(r"TODO \(([^)]+)\)")
GPULAB_DIR = str(Path(__file__).resolve().parents[1])
LIBRARY_DIRS = tuple({str(Path(p).resolve()) for k, p in sysconfig.get_paths().items()
                      if k in ("stdlib", "platstdlib", "purelib", "platlib")} | {GPULAB_DIR})
STUB_TYPES = ("NotImplementedError", "CompileTimeAssertionFailure", "InterpreterError", "CompilationError")

_verbose = False


def verbose_errors(on: bool = True) -> None:
    """Show IPython's full tracebacks (``True``) or gpulab's short messages (``False``)."""
    global _verbose
    _verbose = bool(on)


def verbose() -> bool:
    return _verbose or os.environ.get(VERBOSE_ENV, "") not in ("", "0", "false", "False")


# -- reading a traceback -------------------------------------------------------------------
def chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from (``__cause__``/``__context__``)."""
    out, seen = [], set()
    while exc is not None and id(exc) not in seen:
        out.append(exc)
        seen.add(id(exc))
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return out


def is_learner_file(filename: str) -> bool:
    """Code the learner wrote: a notebook cell or a file of their own, not a library's."""
    if filename.startswith("<") and not filename.startswith("<ipython-input"):
        return False
    try:
        path = str(Path(filename).resolve())
    except (OSError, ValueError):
        return False
    return not path.startswith(LIBRARY_DIRS)


def learner_frames(exc: BaseException) -> list[traceback.FrameSummary]:
    """The learner's frames in the traceback of ``exc`` and its causes, innermost first
    (the root cause's frames come first: Triton re-raises a kernel's error at the launch)."""
    frames = []
    for e in reversed(chain(exc)):
        for fs in reversed(traceback.extract_tb(e.__traceback__)):
            if is_learner_file(fs.filename) and fs not in frames:
                frames.append(fs)
    return frames


def place(fs: traceback.FrameSummary) -> str:
    """``Cell In[3], line 4`` for a notebook cell, ``file.py, line 4`` otherwise."""
    ip = _shell()
    named = ip.compile.format_code_name(fs.filename) if ip is not None and hasattr(ip, "compile") else None
    where = f"{named[0]} {named[1]}" if named else Path(fs.filename).name
    return f"{where}, line {fs.lineno}"


def compiled_stub_line(exc: BaseException, function: str) -> traceback.FrameSummary | None:
    """Where, in the learner's cell, the line is that Triton's compiler stopped at.
    Triton reports it relative to the kernel's ``def`` line (``node.lineno`` of its
    CompilationError); the kernel itself is found in the frames' globals by name."""
    errors = chain(exc)
    node = next((e.node for e in errors if getattr(getattr(e, "node", None), "lineno", None)), None)
    if node is None:
        return None
    for e in errors:
        tb = e.__traceback__
        while tb is not None:
            kernel = tb.tb_frame.f_globals.get(function)
            code = getattr(getattr(kernel, "fn", None), "__code__", None)
            if code is not None and is_learner_file(code.co_filename):
                lines = linecache.getlines(code.co_filename)
                first = code.co_firstlineno                 # the first decorator's line
                def_line = next((i + 1 for i in range(first - 1, len(lines))
                                 if lines[i].lstrip().startswith("def ")), first)
                return traceback.FrameSummary(code.co_filename, def_line + node.lineno - 1, function)
            tb = tb.tb_next
    return None


def check_in_progress(exc: BaseException):
    """The spec a check was running when ``exc`` was raised (None outside a check)."""
    for e in chain(exc):
        tb = e.__traceback__
        while tb is not None:
            code = tb.tb_frame.f_code
            if code.co_filename.startswith(GPULAB_DIR) and code.co_name in ("check", "run_check") \
                    and hasattr(tb.tb_frame.f_locals.get("spec"), "summary"):
                return tb.tb_frame.f_locals["spec"]
            tb = tb.tb_next
    return None


# -- the messages --------------------------------------------------------------------------
def unfinished_exercise(exc: BaseException) -> str | None:
    """The short message for an exercise stub, or None if ``exc`` is not one."""
    errors = chain(exc)
    todo = next((TODO.search(str(e)) for e in errors if TODO.search(str(e))), None)
    if todo is None and not any(type(e).__name__ == "NotImplementedError" for e in errors):
        return None
    frames = learner_frames(exc)
    stub = next((fs for fs in frames if fs.line and ("TODO (" in fs.line or "NotImplementedError" in fs.line)), None)
    if todo is None and stub is None:
        return None           # a NotImplementedError from a library, not an exercise stub
    if stub is not None:
        function, where = stub.name, place(stub)
    else:                     # compiled on a GPU: Triton reports the kernel in its message
        m = re.search(r"def (\w+)\(", "\n".join(str(e) for e in errors))
        function = m.group(1) if m else "your kernel"
        line = compiled_stub_line(exc, function)
        where = place(line) if line is not None else "its cell"
    exercise = f"Exercise {todo.group(1)}" if todo else "This exercise"
    text = (f"{exercise} is not finished: `{function}` still has its placeholder ({where}). "
            "Write your code in place of `# YOUR CODE HERE` and the line after it, run that "
            "cell, then this one again.")
    spec = check_in_progress(exc)
    if spec is not None:
        text += f"\nIt computes ({spec.name}): {spec.summary}"
    return wrap("✗ " + text)


def wrap(text: str, width: int = 88) -> str:
    """Wrap each paragraph to ``width`` columns, continuation lines indented by two."""
    return "\n".join(textwrap.fill(par, width, subsequent_indent="  ", initial_indent="" if i == 0 else "  ",
                                    break_on_hyphens=False, break_long_words=False)
                     for i, par in enumerate(text.split("\n")))


def learner_error_in_check(exc: BaseException) -> str | None:
    """The learner's lines first for an error raised by their code inside a check."""
    spec = check_in_progress(exc)
    if spec is None:
        return None
    frames = learner_frames(exc)
    # The learner's frames below the check call (the grade cell itself is not the culprit).
    inner = [fs for fs in frames if "check(" not in (fs.line or "")] or frames
    root = chain(exc)[-1]
    lines = [f"✗ Your code raised {type(exc).__name__} while gpulab checked {spec.name}:"]
    for fs in inner[:4]:
        lines.append(f"  in `{fs.name}` ({place(fs)}):")
        lines.append(f"      {(fs.line or linecache.getline(fs.filename, fs.lineno)).strip()}")
    lines.append(f"  {type(root).__name__}: {_first_lines(root)}")
    if root is not exc:
        lines.append(f"  (reported as {type(exc).__name__} by {type(exc).__module__.split('.')[0]})")
    lines += [f"  {note}" for note in getattr(exc, "__notes__", [])]
    return "\n".join(lines)


def _first_lines(exc: BaseException, n: int = 6) -> str:
    text = str(exc).strip() or "(no message)"
    lines = text.splitlines()
    return "\n  ".join(lines[:n]) + ("\n  ..." if len(lines) > n else "")


def short_message(exc: BaseException) -> str | None:
    """What a learner should read for ``exc``, or None for IPython's usual traceback."""
    if isinstance(exc, CheckFailure):
        return "✗ " + str(exc)
    return unfinished_exercise(exc) or learner_error_in_check(exc)


# -- IPython -------------------------------------------------------------------------------
def _shell():
    ipython = sys.modules.get("IPython")
    return ipython.get_ipython() if ipython is not None else None


def show_learner_error(shell, etype, value, tb, tb_offset=None):
    """IPython custom exception handler (see ``InteractiveShell.set_custom_exc``)."""
    text = None if verbose() else short_message(value)
    if text is None:
        shell.showtraceback((etype, value, tb), tb_offset=tb_offset)
        return None
    stb = [f"\x1b[0;31m{text}\x1b[0m", SWITCH_NOTE]
    shell._showtraceback(etype, value, stb)   # sends the error (same type and message) to the frontend
    return stb


def install(shell=None) -> bool:
    """Register the handler in the running IPython (no-op outside IPython)."""
    shell = shell or _shell()
    if shell is None or not hasattr(shell, "set_custom_exc"):
        return False
    shell.set_custom_exc((Exception,), show_learner_error)
    return True
