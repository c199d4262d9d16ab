"""What every technique shares for grading and measuring: the spec registry
(:mod:`.spec`), graded checks (:mod:`.checking`), benchmarks (:mod:`.bench`), plots
(:mod:`.plots`), the compile check (:mod:`.compile_check`), notebook helpers
(:mod:`.notebook`) and short error messages for learners (:mod:`.errors`). Nothing here imports a technique's kernels."""
from . import bench, checking, errors, notebook, plots, spec  # noqa: E402,F401
