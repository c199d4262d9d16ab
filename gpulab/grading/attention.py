"""Grading of gpulab.attention: inputs, cases, specs, checks (being split out of the kernel file)."""
from ..attention import *  # noqa: F401,F403
