"""The ``gpulab`` command: env, generate, grade, bench, compile-check, lab."""
from __future__ import annotations

import sys

USAGE = """usage: gpulab COMMAND [ARGS]

commands:
  env             where kernels run (GPU or interpreter) and the versions in use
  generate        regenerate notebooks/ from solutions/ (--check: fail if stale)
  grade NB...     execute notebooks and grade their exercises (writes grades.json)
  bench [NAME...] benchmark kernels on a GPU against PyTorch (--save, --list)
  compile-check   compile every kernel for sm_75, sm_80 and sm_90 without a GPU
  profile NAME    profile a benchmark case (Nsight Compute, else torch.profiler;
                  on a CPU: the saved H200 report)
  progress        every exercise of the course with its status and points
  serve           an OpenAI-compatible HTTP server over the engine (--host, --port)
  train           train the serving engine's ternary transformer, save a 2-bit checkpoint
  serve-bench     drive the serving engine with a generated workload (vs static batching)
  lab ...         the kernel laboratory: list, seed, eval, search, suite (gpulab lab -h)
"""


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "env":
        from ..runtime import env_report
        print(env_report())
        return 0
    if cmd == "generate":
        from .authoring import main as m
    elif cmd == "grade":
        from .grade import main as m
    elif cmd == "bench":
        from ..harness.bench import main as m
    elif cmd == "compile-check":
        from ..harness.compile_check import main as m
    elif cmd == "profile":
        from ..harness.profiler import main as m
    elif cmd == "progress":
        from .progress import main as m
    elif cmd == "serve":
        from ..engine.server import main as m
    elif cmd == "train":
        from ..engine.train import main as m
    elif cmd == "serve-bench":
        from ..engine.serve_bench import main as m
    elif cmd == "lab":
        from ..lab.cli import main as m
    else:
        print(f"unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return m(rest)


if __name__ == "__main__":
    sys.exit(main())
