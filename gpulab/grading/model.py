"""Grading of gpulab.model: inputs, cases, specs, checks (being split out of the kernel file)."""
from ..model import *  # noqa: F401,F403
