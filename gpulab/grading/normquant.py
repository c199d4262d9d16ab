"""Grading of gpulab.normquant: inputs, cases, specs, checks (being split out of the kernel file)."""
from ..normquant import *  # noqa: F401,F403
