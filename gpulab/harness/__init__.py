"""What every technique shares for grading and measuring: the spec registry
(:mod:`.spec`), graded checks (:mod:`.checking`), benchmarks (:mod:`.bench`), activation
memory (:mod:`.memory`), plots (:mod:`.plots`), the compile check (:mod:`.compile_check`)
and notebook helpers (:mod:`.notebook`). Nothing here imports a technique's kernels."""
from . import bench, checking, memory, notebook, plots, spec  # noqa: E402,F401
