"""Grading of gpulab.parallel (notebook 10). The exercises run on real gloo process
groups: they are scenario checks (``gpulab.harness.checking.scenario_check``), called by
name through ``gpulab.check`` like kernel checks; extra positional arguments set the
rank counts, rows, dtypes and timeouts.

* ``gpulab.check("ring-all-reduce", fn)`` runs ``fn(tensor)`` on 2, 3 and 4 CPU processes
  (one launch per rank count) on two kinds of input:

  - *fingerprints*: rank r holds (n+1)^r · (7, 11, 13)[i mod 3] at flat index i. Every
    sum of these is an exact float32 integer whose base-(n+1) digits say how many times
    each rank's value was added at each element, so a wrong result tells *which*
    contributions are missing, doubled or misplaced (missing all-gather, off-by-one
    step, wrong chunk offsets);
  - random data in float32, float64, float16 and bfloat16 against a float64 sum.

  Sizes include fewer elements than ranks and sizes not divisible by n; every rank must
  end with the same bits. A deadlock is cut by the process group's timeout and
  diagnosed (ring neighbours).
* ``gpulab.check("glu-shards", shard)`` checks ``shard(w_gate_up, w_down, rank,
  world_size)`` structurally (which rows and columns each rank got, for 2, 3 and 4
  ranks), then runs the GLU at TP=2 with those shards on gloo: the output must be
  *bit-identical* to TP=1.
* ``gpulab.check("row-parallel-matmul", matmul)`` runs the same TP=2 GLU with gpulab's
  split and the learner's ``matmul(x_q, x_scale, w_packed, w_scale, out_dtype, group)``.
* ``scale_partial_sums`` is an ordinary kernel spec: the exact epilogue of the TP layers.
"""
from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .. import runtime
from ..harness.checking import CheckFailure, diagnose, format_ranges, scenario_check
from ..harness.spec import Case, KernelSpec, randn
from ..parallel import launch
from ..parallel.collectives import all_reduce_reference
from ..parallel.tensor_parallel import (TensorParallelGLU, compare_outputs, glu_forward, glu_shards, random_glu,
                                        row_parallel_matmul, row_parallel_matmul_float,
                                        scale_partial_sums_into)
from ..bitlinear import ternary_matmul

# -- the exact epilogue kernel: a spec like every kernel (checks, compile check) --------------------
def _scale_inputs(p, dtype, device, gen):
    m, n = p["m"], p["n"]
    acc = torch.randint(-127 * p["k"], 127 * p["k"] + 1, (m, n), generator=gen, device=device, dtype=torch.int32)
    x_scale = (torch.rand(m, generator=gen, device=device) * 200 + 1).float()
    w_scale = (torch.rand(1, generator=gen, device=device) * 3 + 0.5).float()
    return {"acc": acc, "x_scale": x_scale, "w_scale": w_scale}


def _scale_reference(acc, x_scale, w_scale):
    return {"y": acc.double() / (x_scale.double()[:, None] * w_scale.double())}


SCALE_PARTIAL_SUMS = KernelSpec(
    name="scale_partial_sums",
    summary="int32 partial sums -> one scale per row (the ternary matmul's epilogue, for TP)",
    args=("acc", "x_scale", "w_scale", "y"),
    make_inputs=_scale_inputs, reference=_scale_reference,
    outputs=lambda inp, dtype: {"y": (tuple(inp["acc"].shape), dtype)},
    implementation=scale_partial_sums_into,
    cases={"cpu": [Case("1x1", dict(m=1, n=1, k=1)), Case("ragged", dict(m=3, n=1030, k=300))],
           "gpu": [Case("1x1", dict(m=1, n=1, k=1)), Case("ragged", dict(m=33, n=4099, k=8192))],
           "bench": []},
    dtypes={"cpu": [torch.float32, torch.bfloat16], "gpu": [torch.float32, torch.bfloat16]},
    tolerances={torch.float32: (1e-5, 1e-6), torch.bfloat16: (1e-2, 8e-3)},
    read_inputs=("acc", "x_scale", "w_scale"),
)


# -- ring all-reduce ------------------------------------------------------------------------------
RING_WORLD_SIZES = (2, 3, 4)
_FORK = "fork" if "fork" in mp.get_all_start_methods() else None
_RING_TOL = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-12, 1e-12),
             torch.float16: (2e-2, 1e-2), torch.bfloat16: (1e-1, 2e-2)}


_POSITION_WEIGHTS = torch.tensor([7, 11, 13])


def _fingerprint(n: int, shape) -> torch.Tensor:
    """[n, *shape] float32: rank r's tensor is (n+1)^r · P[i mod 3] at flat index i, with
    P = (7, 11, 13): a value moved from another position is then not a sum of this
    position's values (n+1 <= 5 shares no factor with them)."""
    numel = math.prod(shape)
    pos = _POSITION_WEIGHTS[torch.arange(numel) % 3]
    return torch.stack([(n + 1) ** r * pos for r in range(n)]).float().view(n, *shape)


def _ring_cases(n: int, gen: torch.Generator) -> list:
    """(label, kind, inputs [n, *shape]) for one rank count: fingerprints first."""
    cases = []
    for label, shape in ((f"{n * 4} elements (divisible by {n})", (n * 4,)),
                         (f"{n * 37 + 1} elements (not divisible by {n})", (n * 37 + 1,)),
                         ("1 element (fewer than the ranks)", (1,)),
                         ("2-D (3, 67)", (3, 67))):
        cases.append((label, "fingerprint", _fingerprint(n, shape)))
    for dtype, numel in ((torch.float32, 1001), (torch.float64, 257), (torch.float16, 998),
                         (torch.bfloat16, 515)):
        cases.append((f"random {str(dtype).replace('torch.', '')}, {numel} elements", "random",
                      randn((n, numel), torch.float32, "cpu", gen).to(dtype)))
    return cases


def _run_ring_cases(fn, cases):
    """Rank function: fn on a copy of this rank's input of every case."""
    rank = dist.get_rank()
    out = []
    for label, _, inputs in cases:
        t = inputs[rank].clone()
        try:
            ret = fn(t)
        except Exception as e:
            if hasattr(e, "add_note"):
                e.add_note(f"gpulab: raised while checking case {label!r} on rank {rank}")
            raise
        out.append((t, ret if isinstance(ret, torch.Tensor) else None))
    return out


def _decode(got: torch.Tensor, n: int):
    """Per element of a fingerprint result: how many times each rank's value was added
    ([numel, n] counts), and which elements are not such a sum at all."""
    numel = got.numel()
    pos = _POSITION_WEIGHTS[torch.arange(numel) % 3].double()
    v = got.reshape(-1).double() / pos
    ok = torch.isfinite(v) & (v == v.round()) & (v >= 0) & (v < (n + 1) ** n * n)
    rest = torch.where(ok, v, torch.zeros_like(v)).long()
    counts = torch.zeros(numel, n, dtype=torch.long)
    for r in range(n):
        counts[:, r] = rest % (n + 1)
        rest = rest // (n + 1)
    ok &= rest == 0
    return counts, ~ok


def _diagnose_fingerprint(n: int, label: str, inputs: torch.Tensor, results: list, exact: torch.Tensor) -> str:
    """Explain a wrong fingerprint result from the decoded contribution counts."""
    numel = exact.numel()
    lines = [f"ring_all_reduce with {n} ranks, case {label}: wrong result (rank r's input is "
             f"(n+1)^r · (7, 11 or 13 by position), so each output element tells which ranks' values were added)."]
    per_rank = []
    for r, (t, _) in enumerate(results):
        counts, foreign = _decode(t, n)
        correct = (counts == 1).all(1) & ~foreign
        own = torch.zeros(n, dtype=torch.long)
        own[r] = 1
        untouched = (counts == own).all(1) & ~foreign
        per_rank.append((counts, foreign, correct, untouched))
    for r, (counts, foreign, correct, _) in enumerate(per_rank):
        bad = (~correct).nonzero().flatten()
        if bad.numel():
            i = int(bad[0])
            what = ("not a sum of the ranks' values at this position" if foreign[i] else
                    "sum of " + " + ".join(f"{int(c)}×rank {k}" for k, c in enumerate(counts[i]) if c) or "zero")
            lines.append(f"  rank {r}: {bad.numel()} of {numel} elements wrong (flat {format_ranges(bad.flatten().tolist(), 3)}); "
                         f"element {i} holds the {what}")
            break
    all_untouched = all(bool(u.all()) for *_, u in per_rank)
    any_foreign = any(bool(f.any()) for _, f, _, _ in per_rank)
    any_repeat = any(bool((c > 1).any()) for c, *_ in per_rank)
    wrong = torch.stack([~c for _, _, c, _ in per_rank])          # [n, numel]
    tail_start = n * (numel // n)
    if all_untouched:
        returned = [ret for _, ret in results]
        if all(ret is not None and ret.shape == exact.shape and torch.equal(ret.double(), exact) for ret in returned):
            hint = ("your function returns the right sum but leaves `tensor` unchanged: write the result "
                    "into `tensor` itself (in place, like dist.all_reduce), e.g. tensor.copy_(result).")
        else:
            hint = ("`tensor` is unchanged on every rank: nothing was added into it (in place), or the "
                    "function returned before the reduce-scatter.")
    elif numel % n and not bool(wrong[:, :tail_start].any()):
        hint = (f"only the last {numel % n} element(s) (flat {tail_start}..{numel - 1}) are wrong: {numel} is "
                f"not a multiple of {n} and the chunks miss the remainder. Chunk boundaries must cover "
                f"[0, numel) exactly, with chunk sizes differing by at most one.")
    elif _constant_ratio(results, exact) is not None:
        ratio = _constant_ratio(results, exact)
        hint = (f"every element is the right sum times {ratio:.4g}"
                + (f" = 1/{n}: that is the average, not the sum" if abs(ratio * n - 1) < 1e-6 else "")
                + ": a scale is applied that should not be (dist.all_reduce sums).")
    elif _is_missing_all_gather(per_rank, n):
        hint = ("each rank holds the full sum on one chunk only (its own), and partial sums elsewhere: "
                "the all-gather phase is missing. After the reduce-scatter, pass the finished chunks "
                "around the ring n-1 more times, copying (not adding) what you receive.")
    elif any_foreign:
        hint = ("some elements hold values that belong to other positions: a chunk is sent, received "
                "or added at the wrong offset. Check the start/stop of each chunk on the sending and "
                "the receiving side (they must agree), and that you add the received chunk into the "
                "same chunk of your tensor.")
    elif any_repeat:
        hint = ("some elements contain one rank's value more than once: a chunk is added twice. At "
                "reduce-scatter step s, rank r sends chunk (r - s) mod n and adds what it receives "
                "into chunk (r - s - 1) mod n; an off-by-one in s or in the chunk index re-adds a "
                "chunk that already holds that contribution.")
    else:
        hint = ("elements are missing some ranks' contributions: the reduce-scatter needs n - 1 steps "
                "(range(n - 1)), each adding the received chunk into the chunk the next step sends on; "
                "and the all-gather must start from the chunk that is complete on this rank, "
                "(r + 1) mod n.")
    lines.append("  Hint: " + hint)
    return "\n".join(lines)


def _constant_ratio(results, exact):
    """The factor relating every rank's result to the sum, if there is one (≠ 1)."""
    if not bool((exact != 0).all()):
        return None
    ratios = torch.cat([(t.double().reshape(-1) / exact.reshape(-1)) for t, _ in results])
    r0 = float(ratios[0])
    if math.isfinite(r0) and abs(r0 - 1) > 1e-6 and bool(((ratios - r0).abs() < 1e-6 * abs(r0)).all()):
        return r0
    return None


def _is_missing_all_gather(per_rank, n) -> bool:
    """Every rank right on (about) 1/n of the elements, the right parts disjoint and
    together covering the tensor, partial sums elsewhere."""
    correct = torch.stack([c for _, _, c, _ in per_rank])
    numel = correct.shape[1]
    if numel < n or bool(correct.all()):
        return False
    foreign = torch.stack([f for _, f, _, _ in per_rank])
    repeat = torch.stack([(c > 1).any(1) for c, *_ in per_rank])
    disjoint = bool((correct.sum(0) <= 1).all())
    covered = bool(correct.any(0).all())
    return disjoint and covered and not bool(foreign.any()) and not bool(repeat.any())


def _ring_deadlock_failure(n: int, passed: list, error: BaseException, timeout_s: float) -> CheckFailure:
    hint = (f"ring_all_reduce with {n} ranks: the ranks waited on each other until the {timeout_s:g} s "
            f"timeout (a deadlock): some receive had no matching send.\n  Hint: rank r must send to "
            f"(r + 1) % n and receive from (r - 1) % n, at every step, the same number of times on every "
            f"rank. ")
    if passed and max(passed) == 2 and n > 2:
        hint += ("It worked with 2 ranks, where the next and the previous rank are the same rank: "
                 "a mix-up of the two neighbours only shows from 3 ranks on.")
    else:
        hint += ("With blocking send/recv, post the receive with irecv (or use isend) so that every rank "
                 "is not waiting in send at once.")
    first = str(error).splitlines()[0][:300] if str(error) else type(error).__name__
    return CheckFailure(hint + f"\n  (the error: {type(error).__name__}: {first})")


def _ring_run_failure(n: int, passed: list, e: BaseException, timeout_s: float) -> BaseException:
    """The exception to raise when the ranks did not all return: a diagnosis when the
    failure is recognisable, else the learner's own exception (e.g. the stub's)."""
    text = str(e).lower()
    first = str(e).splitlines()[0][:240] if str(e) else type(e).__name__
    if _timed_out(e):
        return _ring_deadlock_failure(n, passed, e, timeout_s)
    if isinstance(e, launch.RankError) and e.exitcode is not None:
        return CheckFailure(
            f"ring_all_reduce with {n} ranks: rank {e.rank} crashed ({first}).\n  Hint: gloo aborts a "
            f"process whose receive buffer is smaller than the message it gets: a send and its receive "
            f"disagree on the chunk size or the dtype. Allocate receive buffers like the chunk they "
            f"receive (torch.empty_like(chunk)) and compute the same boundaries on both sides.")
    if "must match the size" in text or "size mismatch" in text:
        return CheckFailure(
            f"ring_all_reduce with {n} ranks: {type(e).__name__}: {first}\n  Hint: a received chunk and "
            f"the slice it is added into (or copied to) have different lengths: with sizes not "
            f"divisible by n, chunks differ by one element, so the buffer for chunk c must have chunk c's "
            f"length, and it must be added into chunk c itself.")
    return e


def _timed_out(e: BaseException) -> bool:
    return isinstance(e, launch.RanksTimedOut) or "timed out" in str(e).lower()


@scenario_check("ring-all-reduce")
def check_ring_all_reduce(fn, world_sizes=(2, 3, 4), timeout_s: float = 15.0,
                          dtypes=(torch.float32, torch.float64, torch.float16, torch.bfloat16),
                          seed: int | None = None, quiet: bool = False) -> None:
    """``gpulab.check("ring-all-reduce", fn)``: ``fn(tensor)``, an in-place sum over all
    ranks of the default process group, run on gloo with each rank count in
    ``world_sizes`` (module docstring). Raises :class:`CheckFailure` with a diagnosis;
    prints one line when right."""
    seed = seed if seed is not None else int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
    gen = torch.Generator().manual_seed(seed)
    passed, count = [], 0
    for n in world_sizes:
        cases = [c for c in _ring_cases(n, gen) if c[1] == "fingerprint" or c[2].dtype in dtypes]
        try:
            # CPU tensors only: fork even where CUDA is in use (fast, and keeps notebook functions)
            results = launch.run_ranks(_run_ring_cases, n, fn, cases, backend="gloo", start_method=_FORK,
                                       collective_timeout_s=timeout_s, timeout_s=3 * timeout_s + 60)
        except Exception as e:
            raise _ring_run_failure(n, passed, e, timeout_s) from None
        for k, (label, kind, inputs) in enumerate(cases):
            got = [results[r][k] for r in range(n)]
            exact = all_reduce_reference(list(inputs))
            if kind == "fingerprint":
                if not all(torch.equal(t.double(), exact) for t, _ in got):
                    raise CheckFailure(_diagnose_fingerprint(n, label, inputs, got, exact))
                continue
            dtype = inputs.dtype
            atol, rtol = _RING_TOL[dtype]
            for r, (t, ret) in enumerate(got):
                if t.dtype != dtype or t.shape != inputs[r].shape:
                    raise CheckFailure(f"ring_all_reduce with {n} ranks, case {label}: rank {r}'s tensor became "
                                       f"{t.dtype} {tuple(t.shape)}: reduce in place, keeping dtype and shape.")
                msg, _ = diagnose("tensor", t, exact, atol * n, rtol)
                if msg:
                    only_low = dtype in (torch.float16, torch.bfloat16)
                    raise CheckFailure(
                        f"ring_all_reduce with {n} ranks, case {label}, rank {r}:\n{msg}"
                        + ("\n  Hint: the float32 cases pass, so look at what depends on the dtype: "
                           "receive buffers must be allocated with the tensor's dtype "
                           "(torch.empty_like), and the additions done in it." if only_low else ""))
            first = got[0][0]
            for r in range(1, n):
                if not torch.equal(got[r][0], first):
                    diff = int((got[r][0] != first).sum())
                    raise CheckFailure(
                        f"ring_all_reduce with {n} ranks, case {label}: ranks 0 and {r} disagree on {diff} "
                        f"element(s), though each is close to the sum.\n  Hint: an all-reduce must leave "
                        f"the same bits on every rank (replicas that drift apart take different decisions "
                        f"later). Compute each chunk's sum on one rank and pass the finished chunk around "
                        f"(all-gather) instead of every rank adding in its own order.")
            count += 1
        passed.append(n)
        count += sum(1 for c in cases if c[1] == "fingerprint")
    kinds = ", ".join(str(d).replace("torch.", "") for d in dtypes)
    if not quiet:
        print(f"✔ ring_all_reduce: {count} cases correct on {', '.join(map(str, passed))} gloo processes "
              f"(uneven sizes, fewer elements than ranks, exact fingerprints, random {kinds}; identical on "
              f"every rank)")


# -- the column/row split of a GLU MLP ----------------------------------------------------------

TP_D_MODEL, TP_HIDDEN = 32, 48          # hidden divisible by 2, 3 and 4


def _distinct_ternary(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """Ternary int8 rows that are pairwise different (so a shard's rows can be traced)."""
    while True:
        w = torch.randint(-1, 2, (rows, cols), generator=gen, dtype=torch.int8)
        if len({bytes(r.numpy().tobytes()) for r in w}) == rows:
            return w


def _trace_rows(shard: torch.Tensor, full: torch.Tensor) -> list:
    """Index in ``full`` of each row of ``shard`` (None where the row is not one of them)."""
    where = {bytes(r.numpy().tobytes()): i for i, r in enumerate(full)}
    return [where.get(bytes(r.contiguous().numpy().tobytes())) for r in shard]


def _as_int8(name, t):
    if not isinstance(t, torch.Tensor):
        raise CheckFailure(f"shard must return two tensors (w_gate_up shard, w_down shard); {name} is "
                           f"{type(t).__name__}")
    return t.detach().cpu().to(torch.int8)


def _span(idx: list) -> str:
    if any(i is None for i in idx):
        return "rows that are not rows of the input"
    return format_ranges(list(idx), 3) if idx else "nothing"


def _check_shard_structure(shard, gen) -> None:
    """Call the learner's shard function for 2, 3 and 4 ranks and check which rows of
    w_gate_up and which columns of w_down each rank got."""
    d, hidden = TP_D_MODEL, TP_HIDDEN
    w_gu = _distinct_ternary(2 * hidden, d, gen)
    w_down = _distinct_ternary(hidden, d, gen).t().contiguous()     # [d, hidden], distinct columns
    for n in (2, 3, 4):
        share = hidden // n
        owner = {}
        for r in range(n):
            out = shard(w_gu.clone(), w_down.clone(), r, n)
            if not isinstance(out, (tuple, list)) or len(out) != 2:
                raise CheckFailure("shard must return a pair (w_gate_up shard, w_down shard)")
            gu, dn = _as_int8("w_gate_up shard", out[0]), _as_int8("w_down shard", out[1])
            where = f"rank {r} of {n} (d_model={d}, hidden={hidden})"
            if dn.dim() == 2 and dn.shape[1] == hidden and dn.shape[0] < d:
                raise CheckFailure(
                    f"shard, {where}: the w_down shard has shape {tuple(dn.shape)}, expected {(d, share)}.\n"
                    f"  Hint: w_down is [d_model, hidden] and the row-parallel layer splits its *input* "
                    f"features: take columns (w_down[:, a:b]), not rows; rows would split the output.")
            if gu.dim() == 2 and gu.shape[0] == 2 * hidden and gu.shape[1] < d:
                raise CheckFailure(
                    f"shard, {where}: the w_gate_up shard has shape {tuple(gu.shape)}, expected {(2 * share, d)}.\n"
                    f"  Hint: w_gate_up is [2·hidden, d_model] and the column-parallel layer splits its "
                    f"*output* features: take rows (dim 0) of each half, not columns (dim 1, the input).")
            if tuple(gu.shape) != (2 * share, d) or tuple(dn.shape) != (d, share):
                raise CheckFailure(
                    f"shard, {where}: got shapes {tuple(gu.shape)} and {tuple(dn.shape)}, expected "
                    f"{(2 * share, d)} (gate and up rows of this rank's hidden units) and {(d, share)} "
                    f"(w_down columns of the same units).")
            rows = _trace_rows(gu, w_gu)
            cols = _trace_rows(dn.t(), w_down.t())
            gate_idx, up_idx = rows[:share], rows[share:]
            expect = list(range(r * share, (r + 1) * share))
            if rows == list(range(r * 2 * share, (r + 1) * 2 * share)):
                raise CheckFailure(
                    f"shard, {where}: the w_gate_up shard is rows {_span(rows)} of the stacked [gate; up] "
                    f"matrix, cut as one block.\n  Hint: w_gate_up stacks the gate rows (0..{hidden - 1}) "
                    f"and the up rows ({hidden}..{2 * hidden - 1}); SiLU(gate_j)·up_j needs both rows of "
                    f"hidden unit j on one rank. Take this rank's slice of each half and stack them.")
            if up_idx == expect and all(i is not None and i >= hidden for i in gate_idx):
                raise CheckFailure(f"shard, {where}: the up rows come first and the gate rows second.\n"
                                   f"  Hint: keep the layout [gate slice; up slice]: the layer splits its "
                                   f"output in two halves, gate first.")
            if None in rows or None in cols:
                raise CheckFailure(f"shard, {where}: the shards contain rows/columns that are not in the "
                                   f"weights (modified values?): return slices of the inputs.")
            if [i - hidden for i in up_idx] != gate_idx:
                raise CheckFailure(
                    f"shard, {where}: gate rows {_span(gate_idx)} but up rows {_span([i - hidden for i in up_idx])} "
                    f"(counted within the up half).\n  Hint: gate row j and up row j belong to the same "
                    f"hidden unit j: take the same slice [a, b) of both halves.")
            if cols != gate_idx:
                raise CheckFailure(
                    f"shard, {where}: the gate/up rows are hidden units {_span(gate_idx)} but the w_down "
                    f"columns are units {_span(cols)}.\n  Hint: the down projection must read exactly the "
                    f"hidden units this rank computes: w_down[:, a:b] with the same [a, b).")
            for u in gate_idx:
                owner.setdefault(u, []).append(r)
        twice = sorted(u for u, rs in owner.items() if len(rs) > 1)
        missing = sorted(set(range(hidden)) - set(owner))
        if twice or missing:
            raise CheckFailure(
                f"shard with {n} ranks: hidden units {_span(missing) if missing else 'none'} are on no rank, "
                f"units {_span(twice) if twice else 'none'} on several.\n  Hint: rank r takes units "
                f"[r·hidden/n, (r+1)·hidden/n): check the offsets (an off-by-one shifts every rank's slice).")


def _tp_rank(shard, matmul, rows, seeds):
    """Rank function: for each dtype (``seeds``: {dtype: seed}, one spawn for them all),
    TP=1, TP=n with the learner's pieces, and reference variants."""
    dev = runtime.device()

    def local_only(x_q, x_scale, w_packed, w_scale, out_dtype=torch.float32, group=None):
        return ternary_matmul(x_q, x_scale, w_packed, w_scale, out_dtype=out_dtype)

    outs = {}
    for dtype, seed in seeds.items():
        gate_up, down = random_glu(TP_D_MODEL, TP_HIDDEN, seed, dtype, dev)
        x = torch.randn(rows, TP_D_MODEL, generator=torch.Generator().manual_seed(seed + 1)).to(dev, dtype)
        with torch.no_grad():
            out = {"tp1": glu_forward(gate_up, down, x),
                   "yours": TensorParallelGLU(gate_up, down, shard=shard, matmul=matmul)(x)}
            out["float"] = TensorParallelGLU(gate_up, down, matmul=row_parallel_matmul_float)(x)
            out["local"] = TensorParallelGLU(gate_up, down, matmul=local_only)(x)
        outs[dtype] = out
    return outs


def _tp_check(shard, matmul, world_size, rows, dtypes, timeout_s, seed, quiet, structure: bool,
              what: str) -> None:
    """Run the GLU at TP=world_size with ``shard`` and ``matmul`` on gloo processes; the
    output must equal TP=1 bit for bit (module docstring)."""
    s = seed if seed is not None else int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
    if structure:
        _check_shard_structure(shard, torch.Generator().manual_seed(s))
    dtypes = [d for d in dtypes if runtime.supports(d)]     # no bf16 kernels below sm_80
    checked = 0
    for m in rows:
        seeds, results = {d: s for d in dtypes}, {}
        for attempt in range(4):
            try:
                # kernels run where gpulab runs them: with a GPU, the gloo ranks are spawned (a
                # forked child cannot use CUDA) and share the GPU, talking through the CPU;
                # one spawn serves every dtype (starting a rank costs seconds)
                res = launch.run_ranks(_tp_rank, world_size, shard, matmul, m, seeds, backend="gloo",
                                       start_method=launch.kernel_start_method(),
                                       collective_timeout_s=timeout_s, timeout_s=2 * timeout_s + 60)
            except Exception as e:
                if _timed_out(e):
                    raise CheckFailure(f"{what}, TP={world_size}: the ranks timed out waiting for each other: "
                                       f"does every rank call the same collectives (an all_reduce on every "
                                       f"rank, in the same order)?") from None
                raise
            for dtype in list(seeds):
                ranks = [r[dtype] for r in res]
                # where even a float reduction gives TP=1's bits (about 1 draw in 300 in float32),
                # the case cannot tell the two apart: draw other inputs
                if attempt == 3 or not all(torch.equal(o["float"], o["tp1"]) for o in ranks):
                    results[dtype] = ranks
                    del seeds[dtype]
                else:
                    seeds[dtype] = (seeds[dtype] + 7919) & 0x7FFFFFFF
            if not seeds:
                break
        for dtype in dtypes:
            res = results[dtype]
            where = f"TP={world_size} vs TP=1, {m} row(s), {str(dtype).replace('torch.', '')}"
            tp1 = res[0]["tp1"]
            for r, out in enumerate(res):
                y = out["yours"]
                if not isinstance(y, torch.Tensor) or y.shape != tp1.shape or y.dtype != tp1.dtype:
                    got = f"{y.dtype} {tuple(y.shape)}" if isinstance(y, torch.Tensor) else type(y).__name__
                    raise CheckFailure(f"{what}: {where}, rank {r}: the layer's output is {got}, expected {tp1.dtype} "
                                       f"{tuple(tp1.shape)} (return the reduced output in out_dtype).")
                if torch.equal(y, tp1):
                    continue
                stats = compare_outputs(tp1, y)
                head = (f"{where}, rank {r}: {stats['different']} of {stats['elements']} outputs differ from "
                        f"TP=1 (largest difference {stats['max_abs_diff']:.3g}, {stats['max_ulps']} ulp).")
                if torch.equal(y, out["local"]):
                    hint = ("the output is this rank's partial result alone: the all-reduce is missing "
                            "(dist.all_reduce of the partial sums).")
                elif torch.equal(y, out["float"]) or (stats["max_ulps"] <= 64 and y.dtype == torch.float32) \
                        or stats["max_abs_diff"] <= 0.05 * float(tp1.abs().max()):
                    hint = ("close to TP=1 but not the same bits: the reduction rounds. Each rank's partial "
                            "result was scaled to floats before the all-reduce; all-reduce the *int32* "
                            "partial sums (exact) and scale once afterwards, as TP=1 does.")
                else:
                    ratio = (y.double() / tp1.double())[tp1.abs() > 1e-3 * float(tp1.abs().max())]
                    med = float(ratio.median()) if ratio.numel() else 0.0
                    constant = ratio.numel() and abs(med - 1) > 0.05 and \
                        float(((ratio - med).abs() < 0.03 * abs(med)).double().mean()) >= 0.9
                    if constant and abs(med * world_size - 1) < 0.01:
                        hint = (f"the outputs are TP=1's times {med:.3g} = 1/{world_size}: the reduction "
                                f"averages (ReduceOp.AVG, or a division by the rank count) instead of summing.")
                    elif bool((y.float() == y.float().round()).all()) and not bool((tp1 == tp1.round()).all()):
                        hint = ("the outputs are whole numbers: the int32 partial sums were never scaled. "
                                "After the all-reduce, apply the scales once (scale_partial_sums).")
                    elif constant:
                        hint = (f"the outputs are off by a factor ≈ {med:.3g}: a scale is "
                                f"applied twice, or missing, or the reduction averages (ReduceOp.AVG) "
                                f"instead of summing.")
                    else:
                        hint = ("compare with TP=1 step by step: partial sums of this rank's inputs "
                                "(ternary_partial_sums), an all_reduce of them, one scale "
                                "(scale_partial_sums).")
                raise CheckFailure(f"{what}: " + head + "\n  Hint: " + hint)
            checked += 1
    if not quiet:
        print(f"✔ {what}: " + ("shards right for 2, 3 and 4 ranks; " if structure else "")
              + f"TP={world_size} output bit-identical to TP=1 in {checked} case(s) "
              f"({', '.join(str(d).replace('torch.', '') for d in dtypes)})")


@scenario_check("glu-shards")
def check_glu_shards(shard, world_size: int = 2, rows=(1,), dtypes=(torch.float32, torch.bfloat16),
                     timeout_s: float = 30.0, seed: int | None = None, quiet: bool = False) -> None:
    """``gpulab.check("glu-shards", shard)``: the split ``shard(w_gate_up, w_down, rank,
    world_size)`` for 2, 3 and 4 ranks, then the GLU at TP=world_size with those shards
    (and gpulab's row-parallel reduction) bit-identical to TP=1."""
    _tp_check(shard, row_parallel_matmul, world_size, rows, dtypes, timeout_s, seed, quiet, True, "glu_shards")


@scenario_check("row-parallel-matmul")
def check_row_parallel_matmul(matmul, world_size: int = 2, rows=(1,), dtypes=(torch.float32, torch.bfloat16),
                              timeout_s: float = 30.0, seed: int | None = None, quiet: bool = False) -> None:
    """``gpulab.check("row-parallel-matmul", matmul)``: the row-parallel reduction
    ``matmul(x_q, x_scale, w_packed, w_scale, out_dtype, group)`` in the GLU at
    TP=world_size (gpulab's split), bit-identical to TP=1."""
    _tp_check(glu_shards, matmul, world_size, rows, dtypes, timeout_s, seed, quiet, False,
              "row_parallel_matmul")
