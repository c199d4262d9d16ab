"""Evolutionary search over a task's kernels, and the archive that remembers them.

The loop is a plain (μ + λ) evolution strategy:

1. the first population is the task's seed, the best kernels the archive holds for the
   task (earlier searches), and random points of the template's gene space;
2. each generation, the proposers make λ children: first a few untried neighbours of
   the best kernel (one gene a step away, or one rewrite toggled), then genes crossed
   between two parents picked by tournament and mutated, now and then with a code-level
   rewrite (:mod:`gpulab.lab.rewrites`) added or dropped;
3. every child goes through the verifier (by default the process-isolated
   :class:`~gpulab.lab.evaluate.Evaluator`); only correct children get a fitness:
   measured time on a GPU, the stated cost model on a CPU;
4. the best μ of parents and children survive (elitism: the best never gets worse);
5. a generation does not wait long for its stragglers: a candidate still compiling or
   being checked at STRAGGLER_FACTOR times the typical candidate's time is stopped
   unjudged and left out (on the H200, kernels at one warp per row of 8192 took 60–80 s
   to compile where most took 10–15 s, and the other seven slots sat idle meanwhile);
6. on a GPU, where one timing is off by a percent or two and the fastest of many
   noisy timings is most often a lucky one, the few best of the last population are
   timed again, in turns, near the end of the budget; the lowest median wins.

Every verified kernel is appended to a JSON-lines archive with its lineage (parents,
operator, proposer, genes, rewrites) and its fitness, and seeds later searches.

Proposers plug in through :class:`Proposer`: anything that, given the task and the
scored population, returns new candidates. The shipped ones need no network;
:class:`OpenAICompatibleProposer` asks a language model behind any OpenAI-compatible
endpoint for kernels and is off unless asked for.
"""
from __future__ import annotations

import datetime as _dt
import inspect
import json
import os
import random
import re
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from .. import runtime
from . import candidate as cand
from . import rewrites as rw
from .evaluate import Evaluator, Verdict
from .tasks import Task, get_task


# -- mutation and crossover -------------------------------------------------------------------
def _numeric(values) -> bool:
    """A gene whose values are numbers (not booleans): it moves a step at a time."""
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def mutate(genes: dict, space: dict, rng: random.Random) -> dict:
    """Change one gene, sometimes two: numeric genes step to a neighbouring value
    (occasionally jump anywhere), others take another allowed value. Returns a new dict."""
    child = dict(genes)
    names = [k for k in space if len(space[k]) > 1]
    if not names:
        return child
    for name in rng.sample(names, k=min(len(names), 1 if rng.random() < 0.7 else 2)):
        values = space[name]
        i = values.index(child[name]) if child[name] in values else rng.randrange(len(values))
        if _numeric(values) and rng.random() < 0.8:
            j = i + rng.choice((-1, 1))
            j = min(max(j, 0), len(values) - 1)
            if j == i:
                j = i - 1 if i > 0 else i + 1
        else:
            j = rng.choice([k for k in range(len(values)) if k != i])
        child[name] = values[j]
    return child


def crossover(a: dict, b: dict, rng: random.Random) -> dict:
    """Uniform crossover: each gene from either parent."""
    return {k: (a[k] if rng.random() < 0.5 else b.get(k, a[k])) for k in a}


@dataclass
class Scored:
    candidate: cand.Candidate
    verdict: Verdict

    @property
    def fitness(self) -> float:
        return self.verdict.fitness_ms


# -- proposers --------------------------------------------------------------------------------
class Proposer:
    """Makes new candidates for a task from the scored population (best first)."""
    name = "proposer"

    def propose(self, task: Task, population: list[Scored], n: int, rng: random.Random) -> list[cand.Candidate]:
        raise NotImplementedError


def build(task: Task, genes: dict, rewrite_names=(), **lineage) -> cand.Candidate | None:
    """Render ``genes`` into the task's template, then apply the rewrites (None if one
    does not apply)."""
    source = cand.render(task.seed_source, genes)
    source = rw.apply_all(source, rewrite_names)
    if source is None:
        return None
    return cand.Candidate(task=task.name, source=source, genes=dict(genes), rewrites=tuple(rewrite_names), **lineage)


class EvolutionaryProposer(Proposer):
    """Tournament selection, uniform crossover, mutation of genes, and code rewrites.

    ``mutate`` is any function (genes, space, rng) -> new genes (notebook 09 plugs in the
    learner's); ``rewrites`` the names of the rewrites it may add (default: the safe
    ones). A child's rewrites change with ``rewrite_rate`` (half of those children keep
    their genes as they are): one is dropped with ``drop_rate`` (or when none is left to
    add), else one is added; every other child has its genes mutated."""
    name = "evolution"

    def __init__(self, mutate: Callable = mutate, crossover_rate: float = 0.5, rewrite_rate: float = 0.25,
                 rewrites=rw.SAFE, tournament: int = 3, drop_rate: float = 0.3):
        self.mutate = mutate
        self.drop_rate = drop_rate
        self.crossover_rate = crossover_rate
        self.rewrite_rate = rewrite_rate
        self.rewrites = tuple(rewrites)
        self.tournament = tournament

    def _pick(self, population: list[Scored], rng: random.Random) -> Scored:
        group = rng.sample(population, k=min(self.tournament, len(population)))
        return min(group, key=lambda s: s.fitness)

    def propose(self, task, population, n, rng):
        space = task.gene_space
        out = []
        for _ in range(n * 4):
            if len(out) >= n:
                break
            a = self._pick(population, rng)
            genes, parents, ops = dict(a.candidate.genes), [a.candidate.id], []
            rewrites = list(a.candidate.rewrites)
            if len(population) > 1 and rng.random() < self.crossover_rate:
                b = self._pick(population, rng)
                if b.candidate.id != a.candidate.id:
                    genes = crossover(genes, b.candidate.genes, rng)
                    parents.append(b.candidate.id)
                    ops.append("crossover")
                    if rng.random() < 0.5:
                        rewrites = sorted(set(rewrites) | set(b.candidate.rewrites))
            touch_rewrites = bool(self.rewrites) and rng.random() < self.rewrite_rate
            # one rewrite more or less on a good kernel's own genes is a move of its own:
            # with the genes always mutated, the best genes would never meet a new rewrite
            if not touch_rewrites or rng.random() < 0.5:
                genes = self.mutate(genes, space, rng)
                ops.append("mutation")
            if touch_rewrites:
                base = cand.render(task.seed_source, genes)
                base = rw.apply_all(base, rewrites) or base
                options = [r for r in rw.applicable(base, self.rewrites) if r not in rewrites]
                # a rewrite is a gene too: a lineage can shed one (it may have helped only
                # at other genes), else it would keep every rewrite it ever took
                if rewrites and (not options or rng.random() < self.drop_rate):
                    rewrites.remove(rng.choice(rewrites))
                    ops.append("drop-rewrite")
                elif options:
                    rewrites.append(rng.choice(options))
                    ops.append("rewrite")
            child = build(task, genes, rewrites, parents=tuple(parents), operator="+".join(ops),
                          proposer=self.name)
            if child is not None:
                out.append(child)
        return out


class NeighbourProposer(Proposer):
    """The best kernel's untried neighbours: each gene one step either way (another
    value for a gene that is not a number) and each safe rewrite toggled, in random
    order, a few per generation. Evolution moves a lineage one change at a time, and a
    lineage that carries a rewrite that hurts at its genes may never be picked again to
    shed it; the neighbours of the best are where a small gain is most likely."""
    name = "neighbours"

    def __init__(self, rewrites=rw.SAFE):
        self.rewrites = tuple(rewrites)
        self.proposed: set[str] = set()

    def neighbours(self, task: Task, best: cand.Candidate, rng: random.Random) -> list[cand.Candidate]:
        out, genes, have = [], dict(best.genes), list(best.rewrites)
        for name, values in task.gene_space.items():
            i = values.index(genes[name]) if genes[name] in values else -1
            steps = [j for j in ((i - 1, i + 1) if _numeric(values) and i >= 0 else range(len(values)))
                     if 0 <= j < len(values) and j != i]
            out += [build(task, {**genes, name: values[j]}, have, parents=(best.id,), operator="neighbour",
                          proposer=self.name) for j in steps]
        base = rw.apply_all(cand.render(task.seed_source, genes), have)
        for r in self.rewrites:
            if r in have:
                toggled = [x for x in have if x != r]
            elif base is not None and rw.REWRITES[r](base) is not None:
                toggled = have + [r]
            else:
                continue
            out.append(build(task, genes, toggled, parents=(best.id,), operator="neighbour", proposer=self.name))
        out = [c for c in out if c is not None and c.id not in self.proposed]
        rng.shuffle(out)
        return out

    def propose(self, task, population, n, rng):
        kids = self.neighbours(task, population[0].candidate, rng)[:n]
        self.proposed.update(c.id for c in kids)
        return kids


class RandomProposer(Proposer):
    """Random points of the gene space (a baseline for the evolutionary proposer)."""
    name = "random"

    def propose(self, task, population, n, rng):
        space = task.gene_space
        return [build(task, cand.random_genes(space, rng), operator="random", proposer=self.name) for _ in range(n)]


class OpenAICompatibleProposer(Proposer):
    """Asks a language model behind an OpenAI-compatible ``/chat/completions`` endpoint
    for a faster kernel, showing it the task, the reference and the best candidate so
    far with its fitness. Off by default; never used in tests. ``post`` sends the
    request (default: urllib), so it can be replaced (or logged)."""
    name = "llm"

    def __init__(self, endpoint: str, model: str, api_key_env: str = "OPENAI_API_KEY", temperature: float = 0.7,
                 post: Callable[[str, dict, dict], dict] | None = None, timeout_s: float = 120.0):
        self.endpoint = endpoint.rstrip("/")
        self.model = model
        self.api_key_env = api_key_env
        self.temperature = temperature
        self.post = post or self._post
        self.timeout_s = timeout_s

    def _post(self, url: str, payload: dict, headers: dict) -> dict:
        req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers=headers, method="POST")
        with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
            return json.loads(r.read())

    def prompt(self, task: Task, best: Scored) -> list[dict]:
        spec = task.spec
        ref = inspect.getsource(spec.reference)
        return [
            {"role": "system", "content": "You write fast, correct Triton kernels. Answer with one complete "
                                          "Python module in a ```python block and nothing else."},
            {"role": "user", "content": (
                f"Task `{task.name}`: {task.summary}.\nReference (float64 PyTorch):\n```python\n{ref}```\n"
                f"The module must define `launch({', '.join(spec.args)})`: the inputs, then preallocated "
                f"outputs it writes in place. It is checked on fresh random inputs of awkward shapes "
                f"{[c.params for c in spec.cases['gpu']]} in {spec.dtypes['gpu']} and timed at "
                f"{task.bench_case.params} ({task.bench_dtype}).\nBest kernel so far "
                f"({best.fitness * 1e3:.1f} µs):\n```python\n{best.candidate.source}```\nWrite a faster one.")},
        ]

    def propose(self, task, population, n, rng):
        key = os.environ.get(self.api_key_env, "")
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        out = []
        for _ in range(n):
            payload = {"model": self.model, "messages": self.prompt(task, population[0]),
                       "temperature": self.temperature}
            try:
                reply = self.post(f"{self.endpoint}/chat/completions", payload, headers)
                text = reply["choices"][0]["message"]["content"]
            except Exception as e:       # a failed request is no candidate, not a failed search
                print(f"llm proposer: {type(e).__name__}: {e}", file=sys.stderr)
                continue
            source = extract_code(text)
            if source:
                out.append(cand.Candidate(task=task.name, source=source, genes=cand.genes_of(source),
                                          parents=(population[0].candidate.id,), operator="llm", proposer=self.name))
        return out


def extract_code(text: str) -> str | None:
    """The first ```python block of a reply (or the whole reply if it has none)."""
    m = re.search(r"```(?:python|py)?\s*\n(.*?)```", text, re.S)
    code = m.group(1) if m else text
    return code if "def launch" in code else None


# -- the archive --------------------------------------------------------------------------------
class Archive:
    """Verified kernels, one JSON object per line, with lineage and fitness."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def append(self, s: Scored, generation: int, fitness_kind: str) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        v = s.verdict
        entry = {**s.candidate.to_json(), "fitness_ms": v.fitness_ms, "fitness_kind": fitness_kind,
                 "time_ms": v.time_ms, "cost_ms": v.cost_ms, "eager_ms": v.eager_ms,
                 "compiled_ms": v.compiled_ms, "generation": generation, "gpu": runtime.gpu_name(),
                 "mode": runtime.mode(), "date": _dt.datetime.now().isoformat(timespec="seconds")}
        with self.path.open("a") as f:
            f.write(json.dumps(entry) + "\n")

    def entries(self, task: str | None = None) -> list[dict]:
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            try:
                e = json.loads(line)
            except json.JSONDecodeError:
                continue
            if task is None or e.get("task") == task:
                out.append(e)
        return out

    def best(self, task: str, k: int, fitness_kind: str | None = None) -> list[cand.Candidate]:
        """The ``k`` fittest distinct kernels archived for ``task`` (of one fitness kind)."""
        seen, out = set(), []
        rows = [e for e in self.entries(task) if fitness_kind is None or e.get("fitness_kind") == fitness_kind]
        for e in sorted(rows, key=lambda e: e["fitness_ms"]):
            if e["id"] in seen:
                continue
            seen.add(e["id"])
            out.append(cand.Candidate.from_json(e))
            if len(out) == k:
                break
        return out


# -- the loop -----------------------------------------------------------------------------------
STRAGGLER_FACTOR = 3.0      # a generation waits this many typical candidates' times at most...
STRAGGLER_MIN_S = 30.0      # ...and never less than this


def straggler_limit_s(evaluated: list) -> float | None:
    """How long a chunk of candidates checked at once may run: STRAGGLER_FACTOR times the
    median run of the candidates judged so far (at least STRAGGLER_MIN_S); None (no limit)
    before four have been judged."""
    runs = sorted(s.verdict.run_s for s in evaluated if s.verdict.run_s > 0)
    if len(runs) < 4:
        return None
    return max(STRAGGLER_MIN_S, STRAGGLER_FACTOR * runs[len(runs) // 2])


@dataclass
class SearchResult:
    task: str
    fitness_kind: str
    seed: Scored
    best: Scored
    history: list = field(default_factory=list)       # one dict per generation
    evaluated: list = field(default_factory=list)     # every Scored, in order
    elapsed_s: float = 0.0
    finals: list = field(default_factory=list)        # the finalists' re-timings (GPU)
    stragglers: list = field(default_factory=list)    # ids stopped unjudged: slower than their generation

    @property
    def improvement(self) -> float:
        """Seed fitness / best fitness (> 1: the search found something faster)."""
        return self.seed.fitness / self.best.fitness

    def rejected(self) -> dict:
        counts: dict = {}
        for s in self.evaluated:
            if not s.verdict.correct:
                counts[s.verdict.reason] = counts.get(s.verdict.reason, 0) + 1
        return counts

    def table(self) -> str:
        unit = "measured GPU time" if self.fitness_kind == "gpu-time" else "cost model (modelled H200 time)"
        lines = [f"search `{self.task}`: {len(self.evaluated)} candidates in {self.elapsed_s:.0f} s, "
                 f"{len(self.history)} generations; fitness = {unit}",
                 f"{'gen':>4} {'evaluated':>9} {'correct':>8} {'best µs':>10} {'median µs':>10}"]
        for h in self.history:
            lines.append(f"{h['generation']:>4} {h['evaluated']:>9} {h['correct']:>8} "
                         f"{h['best_ms'] * 1e3:>10.2f} {h['median_ms'] * 1e3:>10.2f}")
        lines.append(f"seed  {self.seed.candidate.describe()}: {self.seed.fitness * 1e3:.2f} µs")
        lines.append(f"best  {self.best.candidate.describe()}: {self.best.fitness * 1e3:.2f} µs "
                     f"({self.improvement:.2f}× the seed, via {self.best.candidate.operator})")
        if self.finals:
            lines.append("finalists timed again: " + "; ".join(
                f"{f['candidate']} " + (f"median {f['median_ms'] * 1e3:.2f} µs of "
                                        + ", ".join(f"{t * 1e3:.2f}" for t in f["times_ms"])
                                        if f["median_ms"] is not None else f"dropped: {f['reason']}")
                for f in self.finals))
        if self.stragglers:
            lines.append(f"stopped unjudged (still compiling or checking at {STRAGGLER_FACTOR:g}× the typical "
                         f"candidate's time, so as not to hold up their generation): {len(self.stragglers)}")
        rej = self.rejected()
        if rej:
            lines.append("rejected: " + ", ".join(f"{k} {v}" for k, v in sorted(rej.items(), key=lambda x: -x[1])))
        return "\n".join(lines)

    def to_json(self) -> dict:
        def row(s: Scored):
            return {**{k: v for k, v in s.candidate.to_json().items() if k != "source"},
                    "verdict": s.verdict.to_json()}
        return {"task": self.task, "fitness_kind": self.fitness_kind, "elapsed_s": self.elapsed_s,
                "improvement": self.improvement, "seed": row(self.seed),
                "best": {**row(self.best), "source": self.best.candidate.source},
                "history": self.history, "evaluated": [row(s) for s in self.evaluated],
                "finals": self.finals, "stragglers": self.stragglers,
                "gpu": runtime.gpu_name(), "mode": runtime.mode(), "versions": runtime.versions(),
                "date": _dt.datetime.now().isoformat(timespec="seconds")}

    def save(self, directory: str | Path) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        path = directory / f"search-{self.task}-{stamp}.json"
        path.write_text(json.dumps(self.to_json(), indent=1, default=str) + "\n")
        (directory / f"best-{self.task}.py").write_text(self.best.candidate.source)
        return path


def parse_budget(text: str | float | int) -> float:
    """'10m', '90s', '1h' or a number of seconds."""
    if isinstance(text, (int, float)):
        return float(text)
    m = re.fullmatch(r"\s*([\d.]+)\s*([smh]?)\s*", str(text))
    if not m:
        raise ValueError(f"budget {text!r}: write e.g. 10m, 90s or 1h")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def search(task: Task | str, *, budget_s: float | str = 600, max_evals: int | None = None,
           population: int = 8, offspring: int | None = None, proposers: list[Proposer] | None = None,
           verifier: Callable[[Task, cand.Candidate], Verdict] | None = None,
           evaluator: Evaluator | None = None, archive: Archive | str | Path | None = None,
           seed: int = 0, progress: bool = True, random_start: int | None = None,
           finalists: int | None = None, rounds: int = 3) -> SearchResult:
    """Evolve kernels for ``task`` until the time budget or ``max_evals`` runs out.

    ``verifier(task, candidate) -> Verdict`` decides correctness and fitness (default: a
    process-isolated :class:`Evaluator`); ``archive`` (path or :class:`Archive`) receives
    every verified kernel and seeds the first population with the best it holds.

    The ``finalists`` best kernels of the last population (default: 3 when fitness is
    measured time and only the budget bounds the search; none under the cost model or
    with ``max_evals``) are verified and timed ``rounds`` more times each, in turns, and
    the lowest median time wins: the best single timing among many is biased low by
    noise. The evolution stops early enough to leave them time (as many evaluations'
    worth as it takes on average); a finalist rejected in any round drops out (a kernel
    must pass every time)."""
    task = get_task(task) if isinstance(task, str) else task
    budget = parse_budget(budget_s)
    rng = random.Random(seed)
    owned = None
    if verifier is None:
        owned = evaluator or Evaluator()
        chunk = owned.parallel

        def verify_many(cs, stop_after_s=None):
            return owned.evaluate_many(task, cs, stop_after_s=stop_after_s)
    else:
        chunk = 1

        def verify_many(cs, stop_after_s=None):
            return [verifier(task, c) for c in cs]
    archive = Archive(archive) if isinstance(archive, (str, Path)) else archive
    proposers = proposers or [NeighbourProposer(), EvolutionaryProposer()]
    offspring = offspring or population
    fitness_kind = "gpu-time" if runtime.mode() == "compiled" else "cost-model"
    if finalists is None:
        finalists = 3 if fitness_kind == "gpu-time" and max_evals is None else 0
    t0 = time.monotonic()
    seen: dict[str, Scored] = {}
    stragglers: list[str] = []
    evaluated: list[Scored] = []
    history: list[dict] = []
    bar = tqdm(total=max_evals or int(budget), disable=not progress, file=sys.stderr, leave=True,
               desc=f"search {task.name}", unit="eval" if max_evals else "s", dynamic_ncols=True)

    def evolution_budget() -> float:
        """The budget less the finalists' share, at the average wall time of an evaluation so far."""
        if finalists < 2 or not evaluated:
            return budget
        return max(0.0, budget - (time.monotonic() - t0) / len(evaluated) * finalists * rounds)

    def out_of_budget() -> bool:
        return (time.monotonic() - t0 > evolution_budget()
                or (max_evals is not None and len(evaluated) >= max_evals))

    def record(s: Scored, generation: int) -> None:
        seen[s.candidate.id] = s
        evaluated.append(s)
        if s.verdict.correct and archive is not None:
            archive.append(s, generation, fitness_kind)
        bar.n = len(evaluated) if max_evals else min(int(budget), int(time.monotonic() - t0))
        best = min((x.fitness for x in seen.values()), default=float("inf"))
        bar.set_postfix_str(f"best {best * 1e3:.2f} µs" if best < float("inf") else "no correct kernel yet")
        bar.refresh()

    def run(cs: list, generation: int) -> None:
        """Verify new candidates, a chunk (as many as the evaluator runs at once) at a time.
        After the first generation (the seed must be judged) the budget bounds a chunk too:
        a slow-compiling candidate could otherwise hold the search minutes past it;
        candidates stopped unjudged are left out, as if never proposed."""
        todo, ids = [], set(stragglers)
        for c in cs:
            if c is not None and c.id not in seen and c.id not in ids:
                todo.append(c)
                ids.add(c.id)
        for i in range(0, len(todo), chunk):
            if out_of_budget():
                return
            part = todo[i:i + chunk]
            if max_evals is not None:
                part = part[:max_evals - len(evaluated)]
            left = None if generation == 0 else max(0.0, evolution_budget() - (time.monotonic() - t0))
            # where several run at once, the chunk waits for its slowest: bound that too
            limit = straggler_limit_s(evaluated) if generation > 0 and len(part) > 1 else None
            stop = left if limit is None else (limit if left is None else min(left, limit))
            for c, v in zip(part, verify_many(part, stop)):
                if v.status != "unfinished":
                    record(Scored(c, v), generation)
                elif limit is not None and (left is None or limit < left):
                    stragglers.append(c.id)       # never proposed again

    first = [task.seed()]
    if archive is not None:
        first += archive.best(task.name, max(1, population // 2), fitness_kind)
    n_random = population - len(first) if random_start is None else random_start
    first += [build(task, cand.random_genes(task.gene_space, rng), operator="random", proposer="random")
              for _ in range(max(0, n_random))]
    run(first, 0)
    seed_scored = seen[task.seed().id]
    pop = sorted([s for s in seen.values() if s.verdict.correct], key=lambda s: s.fitness)[:population]
    if not pop:
        bar.close()
        raise RuntimeError(f"search {task.name}: not even the seed passed the verifier:\n{seed_scored.verdict}")
    history.append(_stats(0, evaluated, pop))
    generation, stalled = 0, 0
    while not out_of_budget() and stalled < 3:
        generation += 1
        kids: list[cand.Candidate] = []
        for i, p in enumerate(proposers):     # each its share; the last fills what is left
            share = offspring - len(kids) if i == len(proposers) - 1 else offspring // len(proposers)
            kids += p.propose(task, pop, max(1, share), rng)
        fresh = [k for k in kids if k is not None and k.id not in seen]
        if not fresh:                     # the population has converged: restart part of it at random
            fresh = [build(task, cand.random_genes(task.gene_space, rng), operator="random", proposer="random")
                     for _ in range(max(1, offspring // 2))]
        before = len(evaluated)
        run(fresh, generation)
        stalled = stalled + 1 if len(evaluated) == before else 0    # a tiny gene space, exhausted
        pool = {s.candidate.id: s for s in pop}
        pool.update({k.id: seen[k.id] for k in fresh if k.id in seen and seen[k.id].verdict.correct})
        pop = sorted(pool.values(), key=lambda s: s.fitness)[:population]
        history.append(_stats(generation, evaluated, pop))
    best, finals = pop[0], []
    if finalists >= 2 and len(pop) >= 2:
        best, finals = _final_round(pop[:finalists], rounds, verify_many)
        if best is None:      # every finalist failed a re-run: the next best of the population, else the seed
            dropped = {f["candidate"] for f in finals}
            best = next((s for s in pop if s.candidate.id not in dropped), seed_scored)
    bar.close()
    if owned is not None and evaluator is None:
        owned.close()
    return SearchResult(task.name, fitness_kind, seed_scored, best, history, evaluated,
                        time.monotonic() - t0, finals, stragglers)


def _final_round(top: list[Scored], rounds: int, verify_many) -> tuple[Scored | None, list[dict]]:
    """Verify and time each finalist ``rounds`` more times, in turns (each round starts one
    further along, so none is always first), and return the one with the lowest median
    time (its median verdict; None if every finalist dropped out) and every finalist's times."""
    order = [top[(i + r) % len(top)].candidate for r in range(rounds) for i in range(len(top))]
    got: dict[str, list[Verdict]] = {s.candidate.id: [] for s in top}
    for c, v in zip(order, verify_many(order)):
        got[c.id].append(v)
    finals, best = [], None
    for s in top:
        vs = got[s.candidate.id]
        bad = next((v for v in vs if not v.correct), None)
        if bad is not None or not vs:
            finals.append({"candidate": s.candidate.id, "times_ms": [v.fitness_ms for v in vs if v.correct],
                           "median_ms": None, "reason": bad.reason if bad else "not timed"})
            continue
        vs = sorted(vs, key=lambda v: v.fitness_ms)
        middle = vs[len(vs) // 2]
        finals.append({"candidate": s.candidate.id, "times_ms": [v.fitness_ms for v in got[s.candidate.id]],
                       "median_ms": middle.fitness_ms, "reason": "correct"})
        if best is None or middle.fitness_ms < best.fitness:
            best = Scored(s.candidate, middle)
    return best, finals


def _stats(generation: int, evaluated: list[Scored], pop: list[Scored]) -> dict:
    fits = sorted(s.fitness for s in pop)
    return {"generation": generation, "evaluated": len(evaluated),
            "correct": sum(s.verdict.correct for s in evaluated), "best_ms": fits[0],
            "median_ms": fits[len(fits) // 2], "population": [s.candidate.id for s in pop]}
