"""Grading of :mod:`gpulab.block_step` (a MatMul-free block's decode step in one kernel,
and k greedy draft tokens of the whole model in one kernel): inputs, cases and the specs
``block_step`` and ``draft_rollout``, which feed their checks, their compile checks for
sm_75/80/90 and their benchmarks.

The step quantizes six times to int8 on the way, so a float32 kernel and the float64
reference may round one code differently now and then (a value within float32's error of
a .5); one such flip moves an output by about 1/127 of its row's largest BitLinear input.
The tolerances leave room for that and no more: a missing state, gate or projection, or a
wrong scale, moves the outputs by far more (``tests/test_block_step.py`` checks it).

A flip can cascade: it moves the next quantization's inputs a little, some of their codes
flip, and so on down the row. Evaluated in float32, the reference itself missed the
tolerance in one row of a 64-row case in 5 of 60 seeds (by up to 0.37; a correct kernel
missed it by 0.53 on the H200, 2026-12-04): so a row in 32, and one row in a case of
several, may miss it by up to 1.0 (``row_slack``; never in the one-row case, and a wrong
kernel moves most rows)."""
from __future__ import annotations

import torch

from ..block_step import (BlockStepWeights, RolloutWeights, block_step_into, block_step_ref, draft_rollout_into,
                          draft_rollout_ref, int8_dots, layer_weights)
from ..normquant import rmsnorm_ref
from ..harness.spec import Case, KernelSpec, bytes_of, randn

EPS_NORM, EPS_BIT = 1e-6, 1e-8        # nn.RMSNorm's and BitLinear's, as MatMulFreeLM builds them
WEIGHTS = ("norms", "down_norm", "scales", "w_f", "w_c", "w_g", "w_o", "w_gate", "w_down")


def case_weight_dtype(p: dict) -> torch.dtype:
    """A case's ternary weights: float16, or int8 for the cases with W="int8" where int8
    dots run (sm_80+ and the interpreter; sm_75, Colab's T4, keeps float16)."""
    return torch.int8 if p.get("W") == "int8" and int8_dots() else torch.float16


def block_step_inputs(p: dict, dtype: torch.dtype, device, gen: torch.Generator) -> dict:
    """B rows of the residual stream and the state, and a block's weights: non-uniform
    norm weights, ternary weights with about a third zeros (:func:`case_weight_dtype`),
    per-projection scales."""
    b, d, h = p["B"], p["D"], p["H"]

    def ternary(k, n):
        return (torch.randint(-1, 2, (k, n), generator=gen, device=device)).to(case_weight_dtype(p))

    return {"x": randn((b, d), dtype, device, gen, scale=2.0),
            "h": randn((b, d), torch.float32, device, gen),
            "norms": 0.5 + torch.rand((7, d), generator=gen, device=device),
            "down_norm": 0.5 + torch.rand((h,), generator=gen, device=device),
            "scales": 2.0 + 4.0 * torch.rand((6,), generator=gen, device=device),
            "w_f": ternary(d, d), "w_c": ternary(d, d), "w_g": ternary(d, d), "w_o": ternary(d, d),
            "w_gate": ternary(d, 2 * h), "w_down": ternary(h, d)}


def block_step_reference(x, h, **weights) -> dict:
    """The step in float64 (:func:`gpulab.block_step.block_step_ref`)."""
    w = BlockStepWeights(**weights, eps_norm=EPS_NORM, eps_bit=EPS_BIT)
    x_out, h_out = block_step_ref(x.double(), h.double(), w)
    return {"x_out": x_out, "h_out": h_out.double()}


def block_step_launch(x, h, norms, down_norm, scales, w_f, w_c, w_g, w_o, w_gate, w_down, x_out, h_out):
    """:func:`gpulab.block_step.block_step_into` in the check's calling convention (one
    argument per tensor)."""
    block_step_into(x, h, BlockStepWeights(norms, down_norm, scales, w_f, w_c, w_g, w_o, w_gate, w_down,
                                           EPS_NORM, EPS_BIT), x_out, h_out)


def _bytes(p, dtype):
    d, h = p["D"], p["H"]
    weights = case_weight_dtype(p).itemsize * (4 * d * d + 3 * d * h) + 4 * (8 * d + h + 6)
    return weights + p["B"] * d * (2 * bytes_of(dtype) + 8)


BLOCK_STEP = KernelSpec(
    name="block_step",
    summary="a MatMul-free block's decode step (MLGRU + GLU, six BitLinears) in one kernel",
    args=("x", "h") + WEIGHTS + ("x_out", "h_out"),
    make_inputs=block_step_inputs,
    reference=block_step_reference,
    outputs=lambda inp, dtype: {"x_out": (inp["x"].shape, dtype), "h_out": (inp["h"].shape, torch.float32)},
    implementation=block_step_launch,
    cases={"cpu": [Case("one row", dict(B=1, D=32, H=64)), Case("17 rows", dict(B=17, D=64, H=256)),
                   Case("5 rows, int8 weights", dict(B=5, D=32, H=64, W="int8"))],
           "gpu": [Case("draft, batch 1", dict(B=1, D=128, H=512)), Case("33 rows", dict(B=33, D=64, H=256)),
                   Case("draft, batch 64", dict(B=64, D=128, H=512)),
                   Case("33 rows, int8 weights", dict(B=33, D=128, H=512, W="int8"))],
           "bench": [Case("draft B1", dict(B=1, D=128, H=512)), Case("draft B64", dict(B=64, D=128, H=512)),
                     Case("draft B1 int8", dict(B=1, D=128, H=512, W="int8"))]},
    dtypes={"cpu": [torch.float32], "gpu": [torch.float32, torch.bfloat16]},
    tolerances={torch.float32: (2e-2, 1e-2), torch.bfloat16: (5e-2, 2e-2)},
    row_slack=(1 / 32, 1.0),
    bytes_moved=_bytes,
    flops=lambda p, dtype: 2 * p["B"] * (4 * p["D"] ** 2 + 3 * p["D"] * p["H"]),
    graph_timing=True,
    bench_dtypes=[torch.bfloat16],
    read_inputs=("x", "h", "w_f", "w_down"),
    notes="gpulab = block_step_into (one launch); its purpose is the speculative draft's step, "
          "timed there as draft_ms (tools/speculative_bench.py).",
)


# -- draft_rollout: k greedy tokens of a whole MatMul-free LM -------------------------------
# The drafts are compared exactly; where the kernel took the other side of a near tie, the
# reference follows it (draft_rollout_follow_ties), so that the sequence's later drafts and
# states are still checked, on the kernel's path. A rollout is 2·(k+1) block steps a row,
# and the block step's float32 reference parted from float64 in one row of 64 in 5 seeds
# of 60: the GPU cases keep few rows (20 at most) to make a changed draft rare. A flip that
# moves states and no draft is covered by block_step's row slack, over state_out's L·B rows
# of (k+1)·D: a flip at step i moves its layer's state at every later step of that
# sequence, so the k + 1 rows of a sequence in a layer count as one (the wide tiles,
# compiled on the H200, 2026-12-05: one bfloat16 state row of 200 off by 0.164 in one run
# of ten, drafts exact; on a CPU, 2026-12-05, a flip at step 1 moved steps 1 and 3 of one
# sequence, past the tolerance by 0.02, in one check of 150). The diagnosis of a wrong
# rollout (_carry_hint) compares it with the learner's two likely mistakes recomputed, with
# the same near ties followed and the same row slack.
def draft_rollout_inputs(p: dict, dtype: torch.dtype, device, gen: torch.Generator) -> dict:
    """L blocks' weights (as block_step's, stacked), an embedding and a head in ``dtype``,
    B rows' first tokens and states; K drafts each. The head's rows are scaled so that
    the logits' top two are apart by more than an int8 code's flip moves them."""
    L, b, d, v = p["L"], p["B"], p["D"], p["V"]
    layers = [block_step_inputs({**p, "B": 1}, dtype, device, gen) for _ in range(L)]
    inputs = {"first": torch.randint(0, v, (b,), generator=gen, device=device),
              "state_in": randn((L, b, d), torch.float32, device, gen),
              "embed": randn((v, d), dtype, device, gen, scale=2.0),
              "final_norm": 0.5 + torch.rand((d,), generator=gen, device=device),
              "head": randn((v, d), dtype, device, gen, scale=4.0)}
    inputs.update({k: torch.stack([w[k] for w in layers]) for k in WEIGHTS})
    inputs["k"] = p["K"]
    inputs["launch"] = p.get("LAUNCH", "one")
    return inputs


def _rollout_weights(embed, final_norm, head, blocks: dict) -> RolloutWeights:
    return RolloutWeights(embed, final_norm, head, BlockStepWeights(**blocks, eps_norm=EPS_NORM, eps_bit=EPS_BIT),
                          EPS_NORM)


def draft_rollout_reference(first, state_in, embed, final_norm, head, k, launch="one", **blocks) -> dict:
    """The rollout in float64, one step after another (:func:`gpulab.block_step.draft_rollout_ref`);
    ``launch`` changes how the kernel is launched, not what it computes."""
    drafts, states = draft_rollout_ref(first, state_in, _rollout_weights(embed, final_norm, head, blocks), k)
    return {"drafts": drafts, "state_out": states.flatten(1, 2).double()}


@torch.no_grad()
def rollout_path(inp: dict, choose=None, feed_back: bool = True, carry_state: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference rollout (:func:`draft_rollout_reference`'s float64 steps) with each
    step's token from ``choose(i, logits [B, V], states [L, B, D]) -> tokens [B]`` (None:
    the argmax; ``states``: every layer's state after step i): (drafts [k, B], state_out
    [L, B·(k+1), D] float64). ``feed_back`` / ``carry_state`` off: a learner's mistake,
    every step from the first token / from state_in."""
    blocks = {k: inp[k] for k in WEIGHTS}
    w = _rollout_weights(inp["embed"], inp["final_norm"], inp["head"], blocks)
    first, k = inp["first"].long(), inp["k"]
    h0 = [inp["state_in"][j].float() for j in range(w.n_layers)]
    token, h, drafts, hist = first, list(h0), [], []
    for i in range(k + 1):
        x = w.embed[token if feed_back else first]
        for j in range(w.n_layers):
            x, h[j] = block_step_ref(x, h[j] if carry_state else h0[j], layer_weights(w.blocks, j))
        hist.append(torch.stack(h))
        if i < k:
            xn = rmsnorm_ref(x.double(), w.norm.double(), w.eps).to(w.embed.dtype)
            logits = xn.double() @ w.head.double().t()
            token = logits.argmax(-1) if choose is None else choose(i, logits, hist[-1])
            drafts.append(token)
    empty = torch.empty((0, first.shape[0]), dtype=torch.long, device=first.device)
    return (torch.stack(drafts) if drafts else empty), torch.stack(hist, dim=2).flatten(1, 2).double()


def _near_tie(logits: torch.Tensor, best: torch.Tensor, took: torch.Tensor, tolerance) -> torch.Tensor:
    """Where ``took`` (in range) is another token whose logit is within ``tolerance`` (atol +
    rtol · the row's largest |logit|) of ``best``'s: [B] bool."""
    atol, rtol = tolerance
    safe = took.clamp(0, logits.shape[-1] - 1)
    gap = (logits.gather(-1, best[:, None]) - logits.gather(-1, safe[:, None]))[:, 0]
    return (safe != best) & (safe == took) & (gap <= atol + rtol * logits.abs().amax(-1))


def draft_rollout_follow_ties(got: dict, expected: dict, inputs: dict, tolerance: tuple[float, float]) -> dict:
    """The reference along the kernel's drafts where the kernel took the other side of a
    near tie: a token whose reference logit is within ``tolerance`` (atol + rtol · the
    row's largest |logit|) of the best one, chosen from states within the row slack's
    bound of the reference's (a kernel whose states went wrong before it is not followed:
    its diagnosis names that), in at most one sequence in 32 (and one in any case). Its
    later drafts and states are then checked on that path. (Compiled on the H200,
    2026-12-05, bfloat16: one sequence of 20 took another token at step 2 in one run of
    ten, and drafted on from it.)"""
    drafts, want, states = got.get("drafts"), expected["drafts"], got.get("state_out")
    if not isinstance(drafts, torch.Tensor) or drafts.shape != want.shape or want.numel() == 0 \
            or not isinstance(states, torch.Tensor) or states.shape != expected["state_out"].shape \
            or torch.equal(drafts.cpu(), want.cpu()):
        return expected
    k, dev = want.shape[0], want.device
    kernel = drafts.to(dev).long()
    kernel_states = states.to(dev).double().unflatten(1, (want.shape[1], k + 1))     # [L, B, k + 1, D]
    allowed, followed = max(1, want.shape[1] // 32), set()
    bound = DRAFT_ROLLOUT.row_slack[1]

    def choose(i, logits, path_states):
        best = logits.argmax(-1)
        steady = ((kernel_states[:, :, i] - path_states.double()).abs() <= bound).flatten(1).all(-1)  # [L, B]
        near = _near_tie(logits, best, kernel[i], tolerance) & steady.all(0)
        for b in near.nonzero().flatten().tolist():
            if b in followed or len(followed) < allowed:
                followed.add(b)
            else:
                near[b] = False
        return torch.where(near, kernel[i], best)

    path_drafts, path_states = rollout_path(inputs, choose)
    return {**expected, "drafts": path_drafts, "state_out": path_states} if followed else expected


def draft_rollout_hint(output, got, expected, inputs, outputs=None):
    """Names a rollout that does not carry a step's results to the next one (recomputed
    exactly; drafts named so only where the kernel's states, in ``outputs``, agree), or
    that starts wrong after a verify pass (its first step wrong); else, if draft 0 alone is
    right, says where to look."""
    states = (outputs or {}).get("state_out")
    says = _carry_hint(output, got, inputs, states)
    # Was the first step wrong? Its states tell (draft 0 can be right from a wrong start
    # state), unless some state row was never written or is NaN: then a kernel that put
    # the states in the wrong rows, or one that read past them (compiled: NaN guards),
    # cannot be told apart that way, and draft 0 decides.
    states = got if output == "state_out" else states
    start_wrong = output == "drafts" and not torch.equal(got[:1].cpu(), expected[:1].cpu())
    if states is not None and bool(states.isfinite().all()):
        ref = rollout_path(inputs)[1]
        g, e = (t.double().cpu().unflatten(1, (-1, inputs["k"] + 1))[:, :, 0] for t in (states, ref))
        start_wrong = start_wrong or not bool(((g - e).abs() <= 0.1).all())
    elif output == "state_out":
        start_wrong = True
    if says is None and inputs.get("launch") == "ahead" and start_wrong:
        says = ("this case starts each row after a verify pass (the launcher's `ahead`; the same rollout is "
                "checked without it too): a = the leading drafts equal to the target's argmax best[r + i] (at "
                "most the n verified), first token best[r + a], state row s + a.")
    if says is None and output == "drafts" and not start_wrong:
        says = ("draft 0 is right and later drafts are not: step i + 1 must start from step i's argmax "
                "and from the states step i wrote (in every layer).")
    return says


def _carry_hint(output, got, inputs, states=None):
    if inputs["k"] < 2:
        return None
    index = 0 if output == "drafts" else 1
    got = got.cpu()
    if index == 0:          # a variant's drafts follow the kernel's where they meet a near tie (float32 vs 64)
        kernel, tolerance = got.to(inputs["first"].device).long(), DRAFT_ROLLOUT.tolerance(inputs["embed"].dtype)

        def choose(i, logits, path_states):
            best = logits.argmax(-1)
            return torch.where(_near_tie(logits, best, kernel[i], tolerance), kernel[i], best)
    for mistake, says in ((dict(feed_back=False), "every step starts from `first`: feed each step's argmax "
                           "back as the next step's token (only draft 0 follows `first`)"),
                          (dict(carry_state=False), "every step starts from `state_in`: step i + 1 must "
                           "read the states step i wrote to `state_out` (row dst[b·(k+1) + i])")):
        alt = rollout_path(inputs, choose if index == 0 else None, **mistake)
        if index == 0:      # a few drafts can match by chance: the states must agree too, where given
            same = torch.equal(got, alt[0].cpu()) and (states is None or _states_match(states, alt[1], inputs))
        else:
            same = _states_match(got, alt[1], inputs)
        if same:
            return f"{output} equals a rollout in which {says}."
    return None


def _states_match(got: torch.Tensor, alt: torch.Tensor, inputs: dict) -> bool:
    """Do a kernel's state_out and a variant's agree, as the check's row slack lets them (an
    int8 flip may move one sequence's states), the split launches' last step left out (its
    own launch can go wrong its own way)?"""
    if tuple(got.shape) != tuple(alt.shape):
        return False
    diff = (got.double().cpu() - alt.double().cpu()).abs().unflatten(1, (-1, inputs["k"] + 1))   # [L, B, k + 1, D]
    if inputs.get("launch", "one") != "one":
        diff = diff[:, :, :-1]
    moved = (diff > 1e-3).any(-1).any(-1)                                                      # [L, B]
    return int(moved.sum()) <= max(1, moved.numel() // 32) and bool((diff <= DRAFT_ROLLOUT.row_slack[1]).all())


def verify_pass_for(first: torch.Tensor, src: torch.Tensor, k: int) -> tuple:
    """A verify pass after which row b starts from token first[b] and state row src[b], as
    the launcher's ``ahead`` argument encodes it (rows, verified drafts, target argmax,
    first_limit): row b verified k drafts and accepted (7b + 3) mod (k + 1) of them (the
    draft after them differs from the target's token, which is first[b]), and its states
    before them start that many rows before src[b]."""
    b, k1, dev = first.shape[0], k + 1, first.device
    first_h, src_h = first.cpu().tolist(), src.cpu().tolist()
    vocab = max(first_h, default=0) + 2
    verified = (torch.tensor(first_h)[None, :] + 13 * torch.arange(1, k + 1)[:, None]) % vocab   # [k, b]
    best = torch.zeros(b * k1, dtype=torch.long)
    rows = torch.zeros((b, 4), dtype=torch.long)
    for i in range(b):
        a = (7 * i + 3) % k1
        best[i * k1:i * k1 + a] = verified[:a, i]
        best[i * k1 + a] = first_h[i]
        if a < k and verified[a, i] == first_h[i]:
            verified[a, i] = (first_h[i] + 1) % vocab
        rows[i] = torch.tensor([i * k1, k, src_h[i] - a, i])
    return rows.to(dev), verified.contiguous().to(dev), best.to(dev), vocab


def draft_rollout_launch(first, state_in, embed, final_norm, head, norms, down_norm, scales, w_f, w_c, w_g, w_o,
                         w_gate, w_down, k, drafts, state_out, launch="one", into=draft_rollout_into):
    """:func:`gpulab.block_step.draft_rollout_into` (or ``into``, a launcher with its
    arguments) in the check's calling convention: row b's states from row b of state_in,
    step i's to row b·(k+1) + i of state_out. ``launch``: "one" launch of all k + 1
    steps; "split" as the engine's graphs launch it, the k drafting steps then the last
    alone; "ahead" split too, with the start told as a verify pass (:func:`verify_pass_for`:
    ``first`` and the state rows passed as -1s the kernel must not read)."""
    b, dev = first.shape[0], first.device
    w = _rollout_weights(embed, final_norm, head, dict(norms=norms, down_norm=down_norm, scales=scales, w_f=w_f,
                                                       w_c=w_c, w_g=w_g, w_o=w_o, w_gate=w_gate, w_down=w_down))
    src, dst = torch.arange(b, device=dev), torch.arange(b * (k + 1), device=dev)
    if launch == "one":
        into(first, src, dst, state_in, state_out, w, k, drafts)
        return
    start = {}
    if launch == "ahead":
        start = dict(ahead=verify_pass_for(first, src, k))
        first = src = torch.full_like(first, -1)
    into(first, src, dst, state_in, state_out, w, k, drafts, part="drafts", **start)
    into(first, src, dst, state_in, state_out, w, k, drafts, part="last")


def _rollout_bytes(p, dtype):
    weights = p["L"] * (_bytes({**p, "B": 0}, dtype)) + 2 * p["V"] * p["D"] * bytes_of(dtype)
    return (p["K"] + 1) * weights + p["L"] * p["B"] * (p["K"] + 2) * p["D"] * 4


DRAFT_ROLLOUT = KernelSpec(
    name="draft_rollout",
    summary="k greedy draft tokens of a MatMul-free LM (embedding, L blocks, norm, head, argmax) in one kernel",
    args=("first", "state_in", "embed", "final_norm", "head") + WEIGHTS + ("k", "drafts", "state_out", "launch"),
    make_inputs=draft_rollout_inputs,
    reference=draft_rollout_reference,
    outputs=lambda inp, dtype: {"drafts": ((inp["k"], inp["first"].shape[0]), torch.int64),
                                "state_out": ((inp["state_in"].shape[0], inp["first"].shape[0] * (inp["k"] + 1),
                                               inp["state_in"].shape[2]), torch.float32)},
    implementation=draft_rollout_launch,
    cases={"cpu": [Case("one row, 3 drafts", dict(L=2, B=1, D=32, H=64, V=64, K=3)),
                   Case("17 rows, 2 drafts", dict(L=1, B=17, D=32, H=64, V=128, K=2)),
                   Case("3 rows, 2 drafts, int8 weights", dict(L=2, B=3, D=32, H=64, V=64, K=2, W="int8")),
                   Case("5 rows, 2 drafts, started after a verify pass", dict(L=1, B=5, D=32, H=64, V=64, K=2,
                                                                           LAUNCH="ahead")),
                   Case("2 rows, 3 drafts, the last step apart", dict(L=2, B=2, D=32, H=64, V=64, K=3,
                                                                    LAUNCH="split"))],
           # the draft's sizes (one compile configuration); few rows: see the note above
           "gpu": [Case("draft, batch 1", dict(L=2, B=1, D=128, H=512, V=256, K=4)),
                   Case("20 rows", dict(L=2, B=20, D=128, H=512, V=256, K=4)),
                   Case("draft, batch 1, int8 weights", dict(L=2, B=1, D=128, H=512, V=256, K=4, W="int8")),
                   Case("20 rows started after a verify pass", dict(L=2, B=20, D=128, H=512, V=256, K=4,
                                                                    LAUNCH="ahead")),
                   Case("batch 1, the last step apart", dict(L=2, B=1, D=128, H=512, V=256, K=4, LAUNCH="split"))],
           "bench": [Case("draft B1 k4", dict(L=2, B=1, D=128, H=512, V=256, K=4)),
                     Case("draft B1 k4 int8", dict(L=2, B=1, D=128, H=512, V=256, K=4, W="int8")),
                     Case("draft B1 k8", dict(L=2, B=1, D=128, H=512, V=256, K=8)),
                     Case("draft B64 k4", dict(L=2, B=64, D=128, H=512, V=256, K=4))]},
    dtypes={"cpu": [torch.float32], "gpu": [torch.float32, torch.bfloat16]},
    tolerances={torch.float32: (2e-2, 1e-2), torch.bfloat16: (5e-2, 2e-2)},
    output_tolerances={"drafts": {torch.float32: (0.0, 0.0)}},
    row_slack=(1 / 32, 1.0),
    slack_row_group=lambda name, inputs: inputs["k"] + 1 if name == "state_out" else 1,
    follow_ties=draft_rollout_follow_ties,
    bytes_moved=_rollout_bytes,
    flops=lambda p, dtype: 2 * p["B"] * (p["K"] + 1) * (p["L"] * (4 * p["D"] ** 2 + 3 * p["D"] * p["H"])
                                                        + p["D"] * p["V"]),
    graph_timing=True,
    bench_dtypes=[torch.bfloat16],
    read_inputs=("first", "state_in", "embed", "head", "w_down"),
    hint=draft_rollout_hint,
    hint_sees_outputs=True,
    notes="gpulab = draft_rollout_into (one launch for all k drafts); the layered alternative is "
          "(embedding + L block_step launches + norm + head + argmax) per draft, timed in the "
          "speculative benchmark as draft_ms (tools/speculative_bench.py).",
)
