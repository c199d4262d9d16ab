"""gpulab: build the GPU kernels behind fast LLM inference in Triton, profile them,
and prove them correct.

Importing gpulab first decides where kernels run (see :mod:`gpulab.runtime`), so
import it before defining any ``@triton.jit`` kernel of your own.
"""
from . import runtime  # must come first: sets TRITON_INTERPRET before triton is used
from .runtime import device, env_report, mode  # noqa: F401

__version__ = "0.1.0"
REPO = "gpulab-course/gpulab"   # where the Colab badges and installs point

import importlib as _importlib  # noqa: E402

# One module per technique; importing it registers its kernel specs.
TECHNIQUES = ("basics", "normquant", "bitlinear", "mlgru", "model", "attention", "paged", "cascade")
for _name in TECHNIQUES:
    if _importlib.util.find_spec(f"{__name__}.{_name}") is not None:
        _importlib.import_module(f"{__name__}.{_name}")

from . import bench, checking, plots, spec, validate  # noqa: E402,F401
from .checking import CheckFailure, check  # noqa: E402,F401
from .notebook import mine_or_reference, show_error  # noqa: E402,F401


def setup() -> None:
    """First cell of every notebook: report the mode and versions."""
    if runtime.fast() and runtime.mode() != "compiled":
        import torch
        torch.set_num_threads(1)   # CI runs notebooks side by side on few cores
    print(env_report())
