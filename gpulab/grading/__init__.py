"""The grading half of every technique: inputs, cases, kernel specs, baselines,
diagnoses and the ``check_*`` functions the notebooks call.

Importing this package registers every spec (see :func:`gpulab.harness.spec.get`).
A new technique adds its module here: that is its one registry line.
"""
import importlib

TECHNIQUES = ("basics", "normquant", "bitlinear", "mlgru", "attention", "paged", "cascade",
              "prefill", "engine", "speculative", "lab", "parallel", "block_step", "rope", "fused_norms")

for _name in TECHNIQUES:
    importlib.import_module(f"{__name__}.{_name}")
