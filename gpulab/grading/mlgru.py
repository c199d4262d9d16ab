"""Grading of gpulab.mlgru: inputs, cases, specs, checks (being split out of the kernel file)."""
from ..mlgru import *  # noqa: F401,F403
