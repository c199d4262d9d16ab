"""Notebook 09: the mutation operator of the kernel laboratory's search.

Each wrong ``mutate`` is the notebook's solution with one step changed the way a learner
gets it wrong."""
from gpulab.grading import lab  # noqa: F401  (registers the checks)

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
