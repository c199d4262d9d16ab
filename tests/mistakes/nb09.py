"""Notebook 09: the kernel laboratory's verifier and mutation operator.

Each wrong ``verify``/``mutate`` is the notebook's solution with one step changed the way a
learner gets it wrong."""
import os

import torch

import gpulab
from gpulab.grading import lab  # noqa: F401  (registers the checks)
from gpulab.harness.checking import Guarded

from . import Mistake


def _mutate(kind):
    def mutate(genes, space, rng):
        child = genes if kind == "in place" else dict(genes)
        movable = [k for k, values in space.items() if len(values) > 1]
        if kind == "numeric only":
            movable = [k for k in movable if all(isinstance(v, int) and not isinstance(v, bool) for v in space[k])]
        if kind == "all genes":
            names = movable
        else:
            names = rng.sample(movable, k=1 if rng.random() < 0.7 else min(2, len(movable)))
        for name in names:
            values = space[name]
            i = values.index(child[name])
            numeric = all(isinstance(v, int) and not isinstance(v, bool) for v in values)
            if kind == "value + 1" and numeric:
                child[name] = child[name] + 1
                continue
            if numeric and rng.random() < 0.8:
                j = i + rng.choice((-1, 1))
                if kind != "no clamp":
                    j = 1 if j < 0 else len(values) - 2 if j >= len(values) else j
            elif kind == "may keep":
                j = rng.randrange(len(values))
            else:
                j = rng.choice([k for k in range(len(values)) if k != i])
            if kind == "may keep" and numeric:
                j = rng.choice((i, j))
            child[name] = values[j]
        return child
    return mutate


def _ex(name, kind, expect):
    return Mistake("09/check-mutation", "lab-mutation", name, _mutate(kind), expect)


MISTAKES = [
    _ex("mutates the parent in place", "in place", ("changed the parent's dict in place",)),
    _ex("a step may land on the same value", "may keep", ("identical to its parent",)),
    _ex("every gene changed at once", "all genes", ("a mutation is a small step",)),
    _ex("neighbour step not clamped to the list", "no clamp", ("list index out of range",)),
    _ex("only numeric genes mutated", "numeric only", ("never changed: every gene must be reachable",)),
    _ex("value + 1 instead of the next allowed value", "value + 1", ("is not one of",)),
]


# -- the verifier ------------------------------------------------------------------------------
def _verifier(kind):
    def verify(task, launch):
        spec = task.spec
        dtype, device = torch.float32, gpulab.device()
        for case in spec.cases["cpu"]:
            for _ in range(1 if kind == "one trial" else 2):
                seed = 0 if kind == "fixed seed" else int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
                inputs = spec.inputs(case, dtype, device=device, seed=seed)
                if kind == "plain randn":
                    inputs = {k: torch.randn(v.shape, dtype=v.dtype, device=device) for k, v in inputs.items()}
                kept = {k: v.clone() for k, v in inputs.items()}
                if kind == "reference first":
                    expected = spec.reference(**kept)
                g_in = {k: Guarded.wrap(v.shape, v.dtype, device, like=v) for k, v in inputs.items()}
                g_out = {k: Guarded.wrap(s, d, device) for k, (s, d) in spec.outputs(inputs, dtype).items()}
                handed = {k: g.inner for k, g in g_out.items()}
                spec.call(launch, {k: g.inner for k, g in g_in.items()}, handed)
                if gpulab.mode() == "compiled":
                    torch.cuda.synchronize()
                outs = {k: g.buf[g.guard:g.guard + g.inner.numel()].clone() for k, g in g_out.items()}
                seen = {k: v.clone() for k, v in handed.items()}
                where = f"{case}, seed {seed}"
                if kind != "no guards":
                    for k, g in {**g_in, **g_out}.items():
                        if any(g.guard_damage()):
                            return f"wrote outside `{k}` ({where})"
                if kind != "inputs not compared":
                    for k, g in g_in.items():
                        if not torch.equal(g.buf[g.guard:g.guard + g.inner.numel()].view(kept[k].shape), kept[k]):
                            return f"changed input `{k}` ({where})"
                if kind != "reference first":
                    expected = spec.reference(**kept)           # only after the kernel returned
                for k, exp in expected.items():
                    got = seen[k] if kind == "reads the handed tensor" else outs[k].view(exp.shape)
                    atol, rtol = spec.tolerance(dtype, k)
                    if not bool(torch.isclose(got.double(), exp, atol=atol, rtol=rtol).all()):
                        return f"output `{k}` is wrong ({where})"
        return None
    return verify


def _vx(name, kind, plant, **kw):
    return Mistake("09/check-verifier", "lab-verifier", name, _verifier(kind), (f"it accepted `{plant}`",), **kw)


MISTAKES += [
    _vx("one trial per shape", "one trial", "cached-output"),
    _vx("a fixed seed", "fixed seed", "seed-dependent"),
    _vx("plain torch.randn inputs", "plain randn", "no-max"),
    _vx("reference computed before the call", "reference first", "reads-reference"),
    _vx("no guard check", "no guards", "missing-store-mask",
        interpreter_only="compiled, the rows' programs run in any order: a row's stray tail can land on the "
                         "next row after that row was stored, and then the output itself is wrong, which "
                         "this verifier sees without the guards (on the H200 it rejected the plant)"),
    _vx("inputs not compared after the call", "inputs not compared", "input-modified"),
    _vx("result read from the tensor handed to the kernel", "reads the handed tensor", "aliased-output"),
]
