"""Grading of gpulab.paged: inputs, cases, specs, checks (being split out of the kernel file)."""
from ..paged import *  # noqa: F401,F403
