import os

import pytest

import gpulab  # noqa: F401  (sets the Triton mode before any test defines a kernel)


@pytest.fixture
def device():
    return gpulab.device()


def on_gpu() -> bool:
    return gpulab.mode() == "compiled"


os.environ.setdefault("MPLBACKEND", "Agg")
