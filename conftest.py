"""pytest runs the course's notebooks (``solutions/``) as tests, beside ``tests/``. There
their long demos (training runs, searches, sweeps) are shortened, as under CI, on any
machine (``gpulab.runtime.fast``: checks are unchanged): the README's test command then
takes as long on a learner's laptop as in CI. Notebook kernels inherit this environment."""
import os

os.environ.setdefault("GPULAB_FAST", "1")
