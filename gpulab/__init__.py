"""gpulab: build the GPU kernels behind fast LLM inference in Triton, profile them,
and prove them correct.

Importing gpulab first decides where kernels run (see :mod:`gpulab.runtime`), so
import it before defining any ``@triton.jit`` kernel of your own.

The package in layers (CONTRIBUTING.md has the map):

* ``gpulab.<technique>`` (``basics``, ``bitlinear``, ``normquant``, ``mlgru``, ``model``,
  ``attention``, ``paged``, ``cascade``, ``prefill``): kernels and public functions;
* ``gpulab.grading``: each technique's cases, specs and checks;
* ``gpulab.harness``: the spec registry, checks, benchmarks, plots, compile check;
* ``gpulab.tools``: the notebook generator, the grader, the ``gpulab`` command.
"""
from . import runtime  # must come first: sets TRITON_INTERPRET before triton is used
from . import grading  # registers every kernel spec
from .harness import errors
from .harness.checking import CheckFailure, check
from .harness.errors import verbose_errors
from .harness.notebook import KernelSources, mine_or_reference, notebook_functions, show_error
from .harness.plots import benchmark
from .harness.profiler import show as profile
from .harness.spec import Case, get as get_spec
from .runtime import device, env_report, mode
from .tools.progress import show as show_progress

__version__ = "0.1.0"
__all__ = ["Case", "CheckFailure", "KernelSources", "benchmark", "check", "get_spec", "device", "env_report", "mine_or_reference", "mode", "notebook_functions", "profile",
           "setup", "show_error", "show_progress", "verbose_errors"]


def setup() -> None:
    """First cell of every notebook: report the mode and versions, and make errors
    short (an unfinished exercise or a failed check is one message, not a traceback
    through Triton's interpreter; ``gpulab.verbose_errors(True)`` shows everything)."""
    errors.install()
    if runtime.fast() and runtime.mode() != "compiled":
        import torch
        torch.set_num_threads(1)   # CI runs notebooks side by side on few cores
    print(env_report())
