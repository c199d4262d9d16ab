"""A learner reads one short message for an unfinished exercise, a failed check or their
own error inside a check; gpulab.verbose_errors(True) brings the full traceback back."""
import pytest
from IPython.core.interactiveshell import InteractiveShell

import gpulab
from gpulab.harness import errors

SETUP = "import gpulab, torch, triton\nimport triton.language as tl\ngpulab.setup()\n"

KERNEL_STUB = '''
@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    # YOUR CODE HERE
    tl.static_assert(False, "TODO (ex1-add-kernel): write this part of the kernel")


def add(x, y, out):
    add_kernel[(triton.cdiv(out.numel(), 1024),)](x, y, out, out.numel(), BLOCK=1024)
'''

PYTHON_STUB = '''
def softmax_torch(x):
    """Row softmax."""
    # YOUR CODE HERE
    raise NotImplementedError("TODO (ex2-softmax-torch): write this part")
'''

WRONG_INDEX = '''
def add(x, y, out):
    n = out.numel()
    out.copy_((x + y).reshape(2, n // 2))
'''

WRONG_VALUE = '''
def add(x, y, out):
    out.copy_(x - y)
'''


@pytest.fixture
def shell(capsys):
    ip = InteractiveShell.instance()
    ip.run_cell(SETUP)
    capsys.readouterr()
    yield ip
    errors.verbose_errors(False)
    ip.set_custom_exc((), None)
    InteractiveShell.clear_instance()


def run(ip, capsys, *cells):
    result = None
    for cell in cells:
        result = ip.run_cell(cell, store_history=True)
    out = capsys.readouterr()
    return result, out.out + out.err


def flat(text):
    """The message with its line wrapping undone."""
    return " ".join(text.split())


def test_unfinished_kernel_is_one_short_message(shell, capsys):
    result, text = run(shell, capsys, KERNEL_STUB, 'gpulab.check("vector_add", add)')
    # the exception itself is unchanged for graders: Triton's, which differs by mode
    raised = "InterpreterError" if gpulab.mode() == "interpreter" else "CompileTimeAssertionFailure"
    assert type(result.error_in_exec).__name__ == raised
    assert "Exercise ex1-add-kernel is not finished: `add_kernel` still has its placeholder" in flat(text)
    assert "(Cell In[1], line 4)" in flat(text)
    assert "It computes (vector_add): " + gpulab.get_spec("vector_add").summary in flat(text)
    assert "interpreter.py" not in text and "checking.py" not in text and "Traceback" not in text
    assert len(text.strip().splitlines()) <= 6
    assert all(len(line) <= 100 for line in text.splitlines())
    assert "gpulab.verbose_errors(True)" in text


def test_unfinished_python_function_is_one_short_message(shell, capsys):
    result, text = run(shell, capsys, PYTHON_STUB, "softmax_torch(torch.ones(2, 3))")
    assert isinstance(result.error_in_exec, NotImplementedError)
    assert "Exercise ex2-softmax-torch is not finished: `softmax_torch`" in flat(text)
    assert "Traceback" not in text


def test_failed_check_shows_the_diagnosis_without_harness_frames(shell, capsys):
    result, text = run(shell, capsys, WRONG_VALUE, 'gpulab.check("vector_add", add)')
    assert isinstance(result.error_in_exec, gpulab.CheckFailure)
    assert text.lstrip().startswith("\x1b[0;31m✗ vector_add:") and "is wrong" in text
    assert "checking.py" not in text and "Traceback" not in text


def test_learner_error_inside_a_check_shows_the_learners_line_first(shell, capsys):
    result, text = run(shell, capsys, WRONG_INDEX, 'gpulab.check("vector_add", add)')
    assert isinstance(result.error_in_exec, RuntimeError)
    lines = [l for l in text.splitlines() if l.strip()]
    assert "Your code raised RuntimeError while gpulab checked vector_add" in lines[0]
    assert "in `add` (Cell In[" in lines[1] and "reshape(2, n // 2)" in lines[2]
    assert "raised while checking vector_add" in text          # the case it failed on
    assert "checking.py" not in text and "spec.py" not in text


def test_errors_outside_checks_keep_the_usual_traceback(shell, capsys):
    _, text = run(shell, capsys, "def f():\n    return 1 / 0\nf()")
    assert "ZeroDivisionError" in text and "Traceback" in text and "✗" not in text


def test_verbose_switch_and_environment_variable_show_everything(shell, capsys, monkeypatch):
    gpulab.verbose_errors(True)
    _, text = run(shell, capsys, WRONG_VALUE, 'gpulab.check("vector_add", add)')
    assert "checking.py" in text and "✗" not in text
    gpulab.verbose_errors(False)
    monkeypatch.setenv(errors.VERBOSE_ENV, "1")
    _, text = run(shell, capsys, 'gpulab.check("vector_add", add)')
    assert "checking.py" in text


# the interpreter is on in the tests (no GPU): the kernel is made a compilable JITFunction
COMPILED_STUB = KERNEL_STUB.replace("@triton.jit", "@triton.runtime.jit.JITFunction").replace('''def add(x, y, out):
    add_kernel[(triton.cdiv(out.numel(), 1024),)](x, y, out, out.numel(), BLOCK=1024)''', '''def add(x, y, out):
    # what a launch does on a GPU: compile for the device, here sm_90, before anything runs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig = {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}
    triton.compile(ASTSource(add_kernel, signature=sig, constexprs={"BLOCK": 1024}),
                   target=GPUTarget("cuda", 90, 32))''')


def test_unfinished_kernel_compiled_for_a_gpu_names_the_placeholder_line(shell, capsys):
    """Compiled, the placeholder never runs as Python: Triton's compiler reports it
    relative to the kernel, and the message still points at the cell's line."""
    assert COMPILED_STUB != KERNEL_STUB
    result, text = run(shell, capsys, COMPILED_STUB, 'gpulab.check("vector_add", add)')
    assert type(result.error_in_exec).__name__ == "CompileTimeAssertionFailure"
    assert "Exercise ex1-add-kernel is not finished: `add_kernel` still has its placeholder" in flat(text)
    assert "(Cell In[1], line 4)" in flat(text)
    assert "Traceback" not in text and len(text.strip().splitlines()) <= 6
