"""Grading of gpulab.cascade: inputs, cases, specs, checks (being split out of the kernel file)."""
from ..cascade import *  # noqa: F401,F403
