"""``gpulab lab``: the kernel laboratory from the command line.

    gpulab lab list                         the tasks
    gpulab lab seed TASK                    print a task's seed kernel (a template to start from)
    gpulab lab eval TASK FILE               evaluate a candidate; exit status 0 only if it is correct
    gpulab lab search TASK --budget 10m     evolve kernels; progress bar, summary table, results saved
    gpulab lab suite                        evaluate a kernel per task (seed or archived best); fast_p

On a GPU kernels are timed against eager PyTorch and torch.compile; on a CPU they run
in Triton's interpreter and fitness is the stated cost model (gpulab.lab.costmodel).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .. import runtime
from . import rewrites as rw
from .evaluate import Evaluator, EvaluatorError, fast_p
from .search import Archive, EvolutionaryProposer, OpenAICompatibleProposer, RandomProposer, parse_budget, search
from .tasks import TASKS, get_task

DEFAULT_OUT = "lab-results"


def _list(_a) -> int:
    print(f"{'task':18} {'kind':12} {'spec':22} {'timed at':18} genes")
    for t in TASKS.values():
        genes = ", ".join(t.gene_space)
        print(f"{t.name:18} {t.kind:12} {t.spec_name:22} {t.bench:18} {genes}")
        print(f"{'':18} {t.summary}")
    return 0


def _seed(a) -> int:
    print(get_task(a.task).seed_source, end="")
    return 0


def _evaluator(a) -> Evaluator:
    kw = {}
    if getattr(a, "compile", None):
        kw["compile_targets"] = tuple(int(x) for x in a.compile.split(","))
    if getattr(a, "timeout", None):
        kw["timeout_s"] = a.timeout
    if getattr(a, "memory", None):
        kw["memory_mb"] = a.memory
    return Evaluator(**kw)


def _eval(a) -> int:
    task = get_task(a.task)
    path = Path(a.file)
    if not path.exists():
        print(f"no such file: {path}", file=sys.stderr)
        return 2
    with _evaluator(a) as ev:
        v = ev.evaluate(task, path)
    print(v.summary())
    if not v.correct:
        print(v.message)
    if v.correct and "compiled_for" in v.cost:
        print(f"compiles for {', '.join(f'sm_{x}' for x in v.cost['compiled_for'])} "
              f"({v.cost['compilations']} kernel variants)")
    if v.correct and v.cost_ms is not None:
        c = v.cost
        print(f"cost model: {v.cost_ms * 1e3:.2f} µs (ideal {c['ideal_ms'] * 1e3:.2f} µs; traffic ratio "
              f"{c['traffic_ratio']:.2f}, {c['launches']} launch(es), {c['programs']} programs of {c['num_warps']} "
              f"warps, utilisation {c['utilisation']:.2f}, vector efficiency {c['vector_efficiency']:.2f})")
    if a.json:
        Path(a.json).write_text(json.dumps(v.to_json(), indent=1, default=str) + "\n")
    return 0 if v.correct else 1


def _proposers(a) -> list:
    safe = rw.REWRITES if a.unsafe_rewrites else rw.SAFE
    if a.proposer == "random":
        return [RandomProposer()]
    if a.proposer == "llm":
        if not a.endpoint or not a.model:
            raise SystemExit("--proposer llm needs --endpoint URL and --model NAME")
        return [EvolutionaryProposer(rewrites=safe), OpenAICompatibleProposer(a.endpoint, a.model)]
    return [EvolutionaryProposer(rewrites=safe)]


def _search(a) -> int:
    task = get_task(a.task)
    out = Path(a.out)
    archive = Archive(a.archive or out / "archive.jsonl")
    with _evaluator(a) as ev:
        result = search(task, budget_s=parse_budget(a.budget), max_evals=a.max_evals, population=a.population,
                        proposers=_proposers(a), evaluator=ev, archive=archive, seed=a.seed)
    print(result.table())
    path = result.save(out)
    print(f"results: {path}\nbest kernel: {out / f'best-{task.name}.py'}\narchive: {archive.path}")
    return 0


def _suite(a) -> int:
    archive = Archive(a.archive) if a.archive else None
    names = a.tasks or list(TASKS)
    pairs = []
    for name in names:
        task = get_task(name)
        best = archive.best(name, 1) if archive else []
        pairs.append((task, best[0] if best else task.seed()))
    with _evaluator(a) as ev:
        rows = ev.evaluate_pairs(pairs)
    for v in rows:
        print(v.summary() + ("" if v.correct else f"\n  {v.message.splitlines()[0][:160]}"))
    result = {"tasks": [v.to_json() for v in rows], "mode": runtime.mode(), "gpu": runtime.gpu_name(),
              "versions": runtime.versions()}
    if runtime.mode() == "compiled":
        for p in (0, 1.0, 1.5, 2.0):
            for against in ("eager", "compiled"):
                result[f"fast_{p:g}_vs_{against}"] = fast_p(rows, p, against)
        print("  ".join(f"fast_{p:g}: {fast_p(rows, p):.2f} vs eager, {fast_p(rows, p, 'compiled'):.2f} vs compile"
                        for p in (0, 1.0, 1.5)))
    else:
        print(f"fast_0 (correct): {fast_p(rows, 0):.2f}; speed-ups need a GPU (fitness here: the cost model)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "suite.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"results: {out / 'suite.json'}")
    return 0 if all(v.correct for v in rows) else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="gpulab lab", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="the tasks")
    s = sub.add_parser("seed", help="print a task's seed kernel")
    s.add_argument("task")
    e = sub.add_parser("eval", help="evaluate a candidate file (exit 0 only if correct)")
    e.add_argument("task")
    e.add_argument("file")
    e.add_argument("--json", help="write the verdict here")
    e.add_argument("--compile", metavar="ARCHS", nargs="?", const="75,80,90",
                   help="on a CPU, also compile for these GPUs (default 75,80,90)")
    for q in (e,):
        q.add_argument("--timeout", type=float, help="seconds before a candidate counts as hung")
        q.add_argument("--memory", type=float, help="MiB a candidate's process may grow by")
    r = sub.add_parser("search", help="evolutionary search for a task")
    r.add_argument("task")
    r.add_argument("--budget", default="10m", help="time budget, e.g. 10m, 90s (default 10m)")
    r.add_argument("--max-evals", type=int, help="stop after this many candidates")
    r.add_argument("--population", type=int, default=8)
    r.add_argument("--out", default=DEFAULT_OUT, help=f"results directory (default ./{DEFAULT_OUT})")
    r.add_argument("--archive", help="JSON-lines archive (default OUT/archive.jsonl)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--proposer", choices=("evolution", "random", "llm"), default="evolution")
    r.add_argument("--unsafe-rewrites", action="store_true", help="let the search try the unsafe rewrites")
    r.add_argument("--endpoint", help="OpenAI-compatible base URL for --proposer llm")
    r.add_argument("--model", help="model name for --proposer llm")
    r.add_argument("--timeout", type=float)
    r.add_argument("--memory", type=float)
    u = sub.add_parser("suite", help="evaluate one kernel per task; fast_p")
    u.add_argument("tasks", nargs="*")
    u.add_argument("--archive", help="take each task's best kernel from this archive")
    u.add_argument("--out", default=DEFAULT_OUT)
    u.add_argument("--timeout", type=float)
    u.add_argument("--memory", type=float)
    a = p.parse_args(argv)
    try:
        return {"list": _list, "seed": _seed, "eval": _eval, "search": _search, "suite": _suite}[a.cmd](a)
    except (KeyError, ValueError, EvaluatorError) as err:
        print(f"gpulab lab {a.cmd}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
