"""Grading of gpulab.basics: inputs, cases, specs, checks (being split out of the kernel file)."""
from ..basics import *  # noqa: F401,F403
