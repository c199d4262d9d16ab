import os
import tempfile

import pytest
import torch

import gpulab  # noqa: F401  (sets the Triton mode before any test defines a kernel)


@pytest.fixture
def device():
    return gpulab.device()


os.environ.setdefault("MPLBACKEND", "Agg")
# `gpulab grade` records progress under GPULAB_HOME: keep the tests' gradings out of ~/.gpulab
os.environ["GPULAB_HOME"] = tempfile.mkdtemp(prefix="gpulab-home-")

# Two xdist workers on two cores: one torch thread each, or they fight for the cores.
if not gpulab.runtime._cuda_available():
    torch.set_num_threads(1)
