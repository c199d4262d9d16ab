"""What every technique shares for grading and measuring: the spec registry
(:mod:`.spec`), graded checks (:mod:`.checking`), benchmarks (:mod:`.bench`), activation
memory (:mod:`.memory`), plots (:mod:`.plots`), the compile check (:mod:`.compile_check`),
notebook helpers (:mod:`.notebook`), short error messages for learners (:mod:`.errors`),
the profiler summaries (:mod:`.profiler`); interactive views (:mod:`.views`, imported
on demand: it loads ipywidgets). Nothing here imports a technique's kernels."""
from . import bench, checking, errors, memory, notebook, plots, profiler, spec  # noqa: E402,F401
