"""Grading of gpulab.bitlinear: inputs, cases, specs, checks (being split out of the kernel file)."""
from ..bitlinear import *  # noqa: F401,F403
