"""The kernel laboratory (notebook 09): let a machine write kernels, and keep it honest.

* :mod:`.tasks`      the suite: KernelBench-style tasks over the course's kernel specs;
* :mod:`.seeds`      one correct seed kernel per task, written as a template with genes;
* :mod:`.candidate`  candidate sources, genes and lineage;
* :mod:`.evaluate`   the evaluator: each candidate in its own process with time and memory
                     limits, checked on fresh inputs against defences for known cheats,
                     timed against eager PyTorch and ``torch.compile``; ``fast_p``;
* :mod:`.worker`     what runs inside that process;
* :mod:`.costmodel`  the stated cost model used as fitness on a CPU;
* :mod:`.rewrites`   code-level rewrites the search applies to sources;
* :mod:`.search`     the evolutionary search, the ``Proposer`` interface, the archive;
* :mod:`.planted`    planted wrong and cheating kernels (tests and notebook 09);
* :mod:`.inprocess`  loading candidates into this process: the weak harness of notebook 09
                     and a reference in-process verifier;
* :mod:`.compile_candidate`  compiling a candidate for GPU targets on a CPU;
* :mod:`.saved`      lab results measured on a GPU and shipped in ``gpulab/results/lab``;
* :mod:`.cli`        ``gpulab lab list | seed | eval | search | suite``.

Nothing is imported here: ``from gpulab.lab import evaluate, search`` etc.
"""
