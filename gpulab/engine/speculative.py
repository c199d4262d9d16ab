r"""Speculative decoding: a small draft model proposes k tokens, the target model scores
all of them in one forward pass, and exact rejection sampling keeps the output
distribution the target's own (Leviathan et al., 2023; Chen et al., 2023).

For draft tokens x_1..x_k drawn from the draft's distributions q_1..q_k, and the
target's p_1..p_{k+1} from one pass over the k+1 positions (the last accepted token and
the k drafts):

    for i = 1..k:  accept x_i with probability min(1, p_i(x_i) / q_i(x_i))
                   at the first rejection emit y ~ norm(max(0, p_i - q_i)) and stop
    all accepted:  emit a bonus token y ~ p_{k+1}

Every emitted token is then distributed exactly as if sampled from the target alone.
Greedy decoding is the special case "accept while x_i is the target's argmax, then emit
the target's argmax". With acceptance rate α a target pass yields on average
(1 - α^{k+1}) / (1 - α) tokens.

In the engine (:class:`SpeculativeLLM`) a decoding sequence's drafts are appended to
its tokens before scheduling, so the scheduler gives it k+1 tokens to run and pages for
them; the runner returns logits for all k+1 rows; after acceptance the sequence is
**rolled back**: rejected tokens are cut, the pages that only held them are released,
and only then are full pages registered in the prefix cache. The draft keeps its state
at the last accepted token and rewinds to it (:class:`Drafter`).
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import json
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import runtime
from ..bitlinear import BitLinear
from ..model import MatMulFreeLM, encode, load_corpus, train
from ..paged import fault_flag, raise_recorded_faults
from .block_manager import BlockManager
from .engine import LLM, PLACEHOLDER      # drafts still on the device are placeholders too
from .model import TernaryTransformer, attention_with_history, packed_bitlinear_reference
from .sampling import filter_top_k_top_p, gumbel, token_seed
from .scheduler import ScheduledBatch
from .sequence import SamplingParams, Sequence, Status
from .spec_graphs import GraphStepPlan, MLGRUGraphDrafter, PendingDrafts, VerifyGraphs

DRAFT_CHECKPOINT = Path(__file__).resolve().parent.parent / "data" / "mlgru_draft.pt"
RESULTS = Path(__file__).resolve().parent.parent / "results" / "engine" / "speculative.json"
ACCEPT_SALT = 0x5EC0DE      # random streams of acceptance tests and draft samples are
DRAFT_SALT = 0xD4AF7        # apart from the sampler's


# -- the acceptance rule ----------------------------------------------------------------------
def accept_draft(draft: list[int], q: torch.Tensor, p: torch.Tensor, gen: torch.Generator) -> list[int]:
    """Tokens emitted for one sequence: the accepted prefix of ``draft`` plus one more.

    draft: k token ids drawn from q; q: [k, V] the draft's probabilities; p: [k+1, V]
    the target's probabilities at the same positions and one beyond. Uniforms come
    from ``gen`` (CPU), so the result is reproducible."""
    k = len(draft)
    p, q = p.double().cpu(), q.double().cpu()
    for i, x in enumerate(draft):
        u = torch.rand((), generator=gen, dtype=torch.float64)
        if q[i, x] > 0 and u * q[i, x] <= p[i, x]:            # u < min(1, p/q), no division
            continue
        residual = (p[i] - q[i]).clamp_min(0)
        if residual.sum() <= 0:                                  # p == q: nothing to correct
            residual = p[i]
        return draft[:i] + [int(torch.multinomial(residual / residual.sum(), 1, generator=gen))]
    return list(draft) + [int(torch.multinomial(p[k] / p[k].sum(), 1, generator=gen))]


def accept_greedy(draft: list[int], target_logits: torch.Tensor) -> list[int]:
    """Greedy acceptance: keep drafts while they equal the target's argmax, then emit the
    target's argmax at the first mismatch (or the bonus position)."""
    return accept_greedy_ids(draft, target_logits.argmax(-1).tolist())


def accept_greedy_ids(draft: list[int], best: list[int]) -> list[int]:
    """:func:`accept_greedy` given the target's argmax per position (len(draft) + 1 ids)."""
    for i, x in enumerate(draft):
        if x != best[i]:
            return draft[:i] + [best[i]]
    return list(draft) + [best[len(draft)]]


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[n, V] sampling distribution of ``params`` (temperature, top-k, top-p) per row."""
    n = logits.shape[0]
    top_k = torch.full((n,), params.top_k, device=logits.device)
    top_p = torch.full((n,), float(params.top_p), device=logits.device)
    return torch.softmax(filter_top_k_top_p(logits.float() / params.temperature, top_k, top_p), dim=-1)


def expected_tokens_per_pass(alpha: float, k: int) -> float:
    """(1 - α^{k+1}) / (1 - α): tokens one target pass yields at acceptance rate α."""
    return k + 1.0 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def best_k(alpha: float, k_max: int, draft_cost: float) -> int:
    """The number of drafts that maximises tokens per unit of time when a target pass
    costs 1 and each draft step ``draft_cost`` (Leviathan et al.'s choice of γ):
    argmax over k in 1..k_max of expected_tokens_per_pass(α, k) / (1 + k · draft_cost)."""
    return max(range(1, k_max + 1), key=lambda k: expected_tokens_per_pass(alpha, k) / (1 + k * draft_cost))


def rollback(seq: Sequence, block_manager: BlockManager, n_drafts: int, n_accepted: int) -> None:
    """After the target checked ``n_drafts`` drafts at the end of ``seq.token_ids`` and
    accepted the first ``n_accepted``: cut the rejected ones, count the last committed
    token and the accepted drafts as computed (the target pass wrote their K and V), and
    release the pages past those tokens (they held only rejected drafts: fresh pages,
    never in the prefix cache), last page first."""
    del seq.token_ids[seq.num_tokens - (n_drafts - n_accepted):]
    seq.num_computed_tokens += 1 + n_accepted
    keep = block_manager.blocks_for(seq.num_computed_tokens)
    while len(seq.block_table) > keep:
        block_manager.release_block(seq.block_table.pop())


# -- drafts -----------------------------------------------------------------------------------------
def _stream(seq: Sequence, position: int, salt: int) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed(token_seed(seq.seed ^ salt, seq.index, position))
    return gen


def draft_noise(starts: list[tuple[Sequence, int]], count: int, vocab: int, device=None) -> torch.Tensor:
    """Gumbel noise [len(starts), count, vocab] (float32, on ``device``): row (j, i) for the
    draft token at position p + i of sequence s, (s, p) = ``starts[j]``, from that token's
    own seeded stream: the same noise whether drafting runs eagerly or in a graph, for any
    batch (all rows in one :func:`~gpulab.engine.sampling.gumbel` call)."""
    keys = [token_seed(s.seed ^ DRAFT_SALT, s.index, p + i) for s, p in starts for i in range(count)]
    return gumbel(keys, vocab, device).view(len(starts), count, vocab)


class Drafter:
    """A draft model for :class:`SpeculativeLLM`.

    It keeps, per sequence, its state after the sequence's *accepted* tokens. ``propose``
    first catches up over the tokens accepted since the last call (so a rewind is free:
    rejected drafts never enter that state), then drafts from copies of the states, all
    sequences together. Drafted tokens stay on the device until the last one is drawn:
    one device -> host copy per call, whatever the batch and k."""

    vocab_size: int = 258

    def __init__(self):
        self.states: dict[int, object] = {}

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[tuple[list[int], torch.Tensor | None]]:
        """For each sequence, (draft tokens, [len, V] draft probabilities or None when
        greedy). A sequence may get fewer tokens than asked (none: plain decoding)."""
        states, logits = [], []
        for seq in seqs:
            state, row = self.catch_up(seq, self.states.get(seq.seq_id))
            self.states[seq.seq_id] = state
            states.append(state)
            logits.append(row)
        tokens = [[] for _ in seqs]     # per sequence, one device scalar per drafted position
        probs = [[] for _ in seqs]
        for pos in range(max(ks, default=0)):
            live = [i for i in range(len(seqs)) if ks[i] > pos and logits[i] is not None]
            if not live:
                break
            drawn = self._draw([seqs[i] for i in live], torch.stack([logits[i] for i in live]), pos)
            for j, i in enumerate(live):
                tokens[i].append(drawn[0][j])
                if drawn[1] is not None and not seqs[i].params.greedy:
                    probs[i].append(drawn[1][j])
            going = [j for j, i in enumerate(live) if ks[i] > pos + 1]
            if going:
                new_states, new_logits = self.advance_many([states[live[j]] for j in going], drawn[0][going])
                for j, st, row in zip(going, new_states, new_logits):
                    states[live[j]], logits[live[j]] = st, row
        flat = [t for row in tokens for t in row]
        ids = torch.stack(flat).tolist() if flat else []     # the call's one device -> host copy
        out, at = [], 0
        for row, q in zip(tokens, probs):
            out.append((ids[at:at + len(row)], torch.stack(q) if q else None))
            at += len(row)
        return out

    @staticmethod
    def _draw(seqs: list[Sequence], logits: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One draft token per row, on the device: the argmax for greedy sequences, else
        a Gumbel-max draw from the sequence's sampling distribution q (its own seeded
        stream per position). Returns (tokens [n], q [n, V] or None if all greedy)."""
        best = logits.argmax(-1)
        if all(s.params.greedy for s in seqs):
            return best, None
        q = torch.stack([probabilities(row[None], s.params)[0] if not s.params.greedy else
                         torch.zeros_like(row) for s, row in zip(seqs, logits)])
        noise = draft_noise([(s, s.num_tokens + pos) for s in seqs], 1, logits.shape[-1], q.device)[:, 0]
        drawn = (q.log() + noise).argmax(-1)
        greedy = torch.tensor([s.params.greedy for s in seqs], device=logits.device)
        return torch.where(greedy, best, drawn), q

    def advance_many(self, states: list, tokens: torch.Tensor) -> tuple[list, list]:
        """:meth:`advance` for several sequences (tokens: [n] on the device). A drafter
        that can batch its model overrides this; logits None ends that sequence's draft."""
        out = [self.advance(st, tok) for st, tok in zip(states, tokens)]
        return [st for st, _ in out], [row for _, row in out]

    def forget(self, seq_id: int) -> None:
        self.states.pop(seq_id, None)

    # a draft model implements these two
    def catch_up(self, seq: Sequence, state):
        """(state after all of ``seq.token_ids``, logits [V] for the next token or None)."""
        raise NotImplementedError

    def advance(self, state, token: torch.Tensor):
        """(a new state after one more token (a 0-d tensor on the device, read without a
        host sync), its next-token logits [V] or None); ``state`` unchanged."""
        raise NotImplementedError


class MLGRUDrafter(Drafter):
    """The MatMul-free LM of notebook 03 as the draft: a constant-size state per
    sequence (n_layers vectors), no KV cache. Its 256 byte logits are widened to the
    target's vocabulary (the specials get probability 0: the target corrects that)."""

    def __init__(self, model, vocab_size: int = 258):
        super().__init__()
        # Compiled, each block's step is one kernel (gpulab.block_step: a step of the
        # layered blocks was ~40 launches, 0.13 ms a token on the H200 even in a graph).
        self.fused = not (runtime.interpreting() or model.embed.weight.device.type == "cpu")
        if not self.fused:
            # On a CPU run the packed BitLinears as PyTorch ops (the same arithmetic):
            # the interpreter would run their Triton kernels a thousand times slower,
            # and compiled kernels need the GPU.
            model = copy.deepcopy(model)
            for m in model.modules():
                if isinstance(m, BitLinear) and m.packed:
                    m.forward = functools.partial(packed_bitlinear_reference, m)
        self.model, self.vocab_size = model.eval(), vocab_size
        self.device = model.embed.weight.device

    def _widen(self, logits: torch.Tensor) -> torch.Tensor:
        pad = torch.full((self.vocab_size - logits.shape[-1],), -torch.inf, device=logits.device)
        return torch.cat([logits.float(), pad])

    @torch.no_grad()
    def catch_up(self, seq, state):
        n_done, states, logits = state if state is not None else (0, None, None)
        new = [t for t in seq.token_ids[n_done:] if t < 256]          # BOS/EOS are not bytes
        if new:
            out, states = self.model(torch.tensor([new], device=self.device), states)
            logits = self._widen(out[0, -1])
        return (len(seq.token_ids), states, logits), logits

    # Drafts are never BOS/EOS: their widened logits are -inf, so a drafted token is a byte.
    @torch.no_grad()
    def advance(self, state, token):
        new_states, logits = self.advance_many([state], token.reshape(1))
        return new_states[0], logits[0]

    @torch.no_grad()
    def advance_many(self, states, tokens):
        """One batched step of the MatMul-free LM for all sequences (its state is n_layers
        vectors per sequence: they stack)."""
        layers = [torch.cat([st[1][k] for st in states]) for k in range(len(states[0][1]))]
        out, layers = self.model.step(tokens, layers, self.fused)
        new = [(st[0] + 1, [h[j:j + 1] for h in layers], self._widen(out[j])) for j, st in enumerate(states)]
        return new, [st[2] for st in new]


def train_mlgru_draft(d_model: int = 128, n_layers: int = 2, steps: int = 800, seed: int = 0,
                      device=None, progress: bool = True) -> MatMulFreeLM:
    """Notebook 03's MatMul-free LM trained on the same poems as the target, packed."""
    torch.manual_seed(seed)
    model = MatMulFreeLM(d_model=d_model, n_layers=n_layers).to(device or runtime.device())
    train(model, encode(load_corpus()).to(model.embed.weight.device), steps=steps, batch_size=16,
          seq_len=128, seed=seed, progress=progress)
    return model.pack()


def save_mlgru_draft(model: MatMulFreeLM, path=DRAFT_CHECKPOINT) -> Path:
    """Packed 2-bit weights and 16-bit rest, like the target's checkpoint."""
    state = {k: (v.half() if v.is_floating_point() and "w_scale" not in k else v).cpu()
             for k, v in model.state_dict().items()}
    torch.save({"config": {"d_model": model.d_model, "n_layers": model.n_layers}, "state": state}, Path(path))
    return Path(path)


def load_mlgru_draft(path=DRAFT_CHECKPOINT, device=None, dtype=torch.float32) -> MatMulFreeLM:
    """The shipped draft: a MatMul-free LM ready to propose tokens."""
    blob = torch.load(Path(path), map_location="cpu", weights_only=True)
    model = MatMulFreeLM(**blob["config"]).pack()
    model.load_state_dict({k: (v.float() if v.is_floating_point() else v) for k, v in blob["state"].items()})
    model = model.to(device or runtime.device()).eval()
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model


class TransformerDrafter(Drafter):
    """A smaller ternary transformer as the draft, with a contiguous KV cache per
    sequence; rewinding is keeping the cache of the accepted tokens only."""

    def __init__(self, model: TernaryTransformer):
        super().__init__()
        self.model, self.vocab_size = model.eval(), model.cfg.vocab_size
        self.device = model.rope_cos.device

    @torch.no_grad()
    def _run(self, caches, tokens: list[int], start: int):
        new = [[None, None] for _ in caches]

        def attend(layer, q, k, v):
            kc, vc = caches[layer]
            kc = k if kc is None else torch.cat([kc, k])
            vc = v if vc is None else torch.cat([vc, v])
            new[layer] = [kc, vc]
            return attention_with_history(q, kc, vc)

        pos = torch.arange(start, start + len(tokens), device=self.device)
        ids = tokens.reshape(-1) if isinstance(tokens, torch.Tensor) else torch.tensor(tokens, device=self.device)
        h = self.model.hidden_states(ids, pos, attend, reference=True)
        return new, self.model.logits(h[-1])

    def catch_up(self, seq, state):
        n_done, caches, logits = state if state is not None else (
            0, [[None, None] for _ in range(self.model.cfg.n_layers)], None)
        if len(seq.token_ids) > n_done:
            caches, logits = self._run(caches, seq.token_ids[n_done:], n_done)
        return (len(seq.token_ids), caches, logits), logits

    def advance(self, state, token):
        n_done, caches, _ = state
        if n_done + 1 >= self.model.cfg.max_seq_len:
            return state, None
        caches, logits = self._run(caches, token.reshape(1), n_done)
        return (n_done + 1, caches, logits), logits


# -- the engine ----------------------------------------------------------------------------------------
@dataclass
class SpeculationStats:
    """Acceptance per draft position and tokens per target pass."""
    k: int
    proposed: list[int] = field(default_factory=list)   # drafts offered at position i
    accepted: list[int] = field(default_factory=list)   # ... and accepted
    passes: int = 0                                      # sequence-passes that verified drafts
    emitted: int = 0                                     # tokens those passes emitted

    def __post_init__(self):
        self.proposed, self.accepted = [0] * self.k, [0] * self.k

    def record(self, n_draft: int, n_accepted: int, n_emitted: int) -> None:
        for i in range(n_draft):
            self.proposed[i] += 1
            self.accepted[i] += i < n_accepted
        self.passes += 1
        self.emitted += n_emitted

    def acceptance_by_position(self) -> list[float]:
        return [a / p if p else float("nan") for a, p in zip(self.accepted, self.proposed)]

    def acceptance_rate(self) -> float:
        return sum(self.accepted) / max(1, sum(self.proposed))

    def mean_tokens_per_pass(self) -> float:
        return self.emitted / max(1, self.passes)


class SpeculativeLLM(LLM):
    """:class:`~gpulab.engine.engine.LLM` with a draft model: each step, every decoding
    sequence gets up to ``k`` draft tokens checked in the same batched target pass.

    >>> llm = SpeculativeLLM(drafter=MLGRUDrafter(draft_model), k=4)     # doctest: +SKIP
    >>> llm.generate(["Tyger Tyger"], SamplingParams(max_tokens=40))      # doctest: +SKIP

    Where the runner captures CUDA graphs (compiled mode on a GPU, ``cuda_graphs`` on),
    a step of decoding sequences verifies all drafts in one graph replay, and the MLGRU
    draft proposes them in one more (:mod:`.spec_graphs`); other steps run eagerly. With
    ``draft_ahead`` (greedy batches) the next step's drafts are launched right after the
    verify replay, before the host reads its tokens.
    """

    def __init__(self, model=None, config=None, drafter: Drafter | None = None, k: int = 4,
                 accept=accept_draft, rollback=rollback, adaptive: bool = False,
                 draft_cost: float = 0.1, graphs: str = "auto", draft_ahead: bool = True, **overrides):
        """``accept`` (the rule for sampled requests) and ``rollback`` can be swapped for
        other implementations with the same signatures (notebook 08 plugs in the learner's).

        ``adaptive``: each request drafts its own number of tokens, up to ``k``: the
        :func:`best_k` for its acceptance so far (counted per request, recent passes
        weighing more) and ``draft_cost``, a draft step's time over a target pass's.

        ``graphs``: "auto" (CUDA graphs for draft and verify where the runner captures its
        decode graphs), "off" (always eager), or "emulate" (the graph path's buffers and
        bookkeeping with every replay run eagerly: for tests on a CPU).

        ``draft_ahead``: where every drafted sequence of a graph step is greedy, launch
        the next step's drafts on the device (:meth:`MLGRUGraphDrafter.launch_ahead`)
        before reading this step's tokens, so that the GPU drafts while the host reports.
        The same drafts either way."""
        if graphs not in ("auto", "off", "emulate"):
            raise ValueError(f"graphs must be 'auto', 'off' or 'emulate', got {graphs!r}")
        if drafter is None:
            raise ValueError("SpeculativeLLM needs a drafter (MLGRUDrafter or TransformerDrafter)")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"k (draft tokens per step) must be an int >= 1, got {k!r}")
        if not isinstance(draft_ahead, bool):
            raise ValueError(f"draft_ahead must be True or False, got {draft_ahead!r}")
        if isinstance(draft_cost, bool) or not isinstance(draft_cost, (int, float)) or not 0 <= draft_cost < 10:
            raise ValueError(f"draft_cost (a draft step's time over a target pass's) must be in [0, 10), "
                             f"got {draft_cost!r}")
        super().__init__(model, config, **overrides)
        if self.config.multi_step > 1:
            raise ValueError("SpeculativeLLM drafts and verifies every step: multi_step must be 1")
        self.overlap = False           # its step reads every verification's tokens before the next
        self.drafter, self.k, self.accept, self.rollback = drafter, k, accept, rollback
        self.adaptive, self.draft_cost = bool(adaptive), float(draft_cost)
        self.acceptance: dict[int, tuple[float, float]] = {}   # seq_id -> (accepted, rejections), decayed
        self.stats = SpeculationStats(k)
        self.verify_graphs, self.proposer = None, drafter     # proposer: the drafter, or its graphs
        self.pending: PendingDrafts | None = None              # the graph drafter's, not read yet
        self.draft_ahead = draft_ahead
        self.ahead: PendingDrafts | None = None                # next step's, launched before this one landed
        self.ahead_counts = {"launched": 0, "used": 0}
        if graphs == "emulate" or (graphs == "auto" and self.runner.graphs):
            cuda = graphs == "auto"
            n = self.config.max_num_seqs
            self.verify_graphs = VerifyGraphs(self.runner, k, n, cuda)
            if isinstance(drafter, MLGRUDrafter):
                self.proposer = MLGRUGraphDrafter(drafter.model, drafter.vocab_size, k, n, draft_noise, cuda,
                                                  fused=drafter.fused, ahead=self.draft_ahead)

    def request_k(self, seq: Sequence) -> int:
        """Drafts this request proposes per step: ``k``, or its :func:`best_k` when adaptive
        (acceptance estimated as accepted / (accepted + rejections), the geometric law's
        estimate, starting from a prior of 2 accepted per rejection)."""
        if not self.adaptive:
            return self.k
        accepted, rejected = self.acceptance.get(seq.seq_id, (2.0, 1.0))
        return best_k(accepted / (accepted + rejected), self.k, self.draft_cost)

    def _draft_budget(self, seq: Sequence) -> int:
        """Drafts worth proposing: never past max_tokens or the context."""
        left = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens)
        return max(0, min(self.request_k(seq), left - 1))

    def _propose(self) -> dict[Sequence, tuple[list[int], torch.Tensor | None]]:
        """Drafts per sequence (appended to its ``token_ids``). The graph drafter's stay on
        the device (``self.pending``) and the tokens appended are placeholders until
        :meth:`_resolve` reads them: the verify graph takes them on the device."""
        seqs = [s for s in self.scheduler.running if s.num_uncomputed == 1 and s.num_output_tokens > 0]
        ks = [self._draft_budget(s) for s in seqs]
        seqs, ks = [s for s, k in zip(seqs, ks) if k > 0], [k for k in ks if k > 0]
        drafts = {}
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            # the usual case: every drafting sequence's drafts are there, from where its tokens end
            if seqs and all(s in ahead.column and ahead.done[ahead.column[s]] is not None for s in seqs):
                want = dict(zip(seqs, ks))
                ahead.ks = [want.get(s, 0) for s in ahead.seqs]
                self.pending = ahead
                self.ahead_counts["used"] += 1
                for seq, n in zip(ahead.seqs, ahead.ks):
                    if n:
                        seq.token_ids += [PLACEHOLDER] * n
                        drafts[seq] = ([PLACEHOLDER] * n, None)
                return drafts
            # the drafting set changed: read them (their pool rows moved on), then the others
            ready = {s: tokens for s, (tokens, _) in zip(ahead.seqs, ahead.resolve())}
            for seq, k in zip(seqs, ks):
                if seq in ready and seq.seq_id in self.proposer.record:
                    seq.token_ids += ready[seq][:k]
                    drafts[seq] = (ready[seq][:k], None)
            seqs, ks = [s for s in seqs if s not in drafts], [k for s, k in zip(seqs, ks) if s not in drafts]
        if isinstance(self.proposer, MLGRUGraphDrafter) and len(seqs) <= self.proposer.max_batch:
            self.pending = self.proposer.propose_on_device(seqs, ks)
            proposals = [] if self.pending is None else \
                [([PLACEHOLDER] * n, q) for q, n in zip(self.pending.probabilities(), self.pending.ks)]
            seqs = [] if self.pending is None else self.pending.seqs
        else:
            proposals = self.proposer.propose(seqs, ks)
        for seq, (tokens, q) in zip(seqs, proposals):
            if tokens:
                seq.token_ids += tokens
                drafts[seq] = (tokens, q)
        return drafts

    def _resolve(self, drafts: dict, flat: list[int] | None = None) -> None:
        """Read the pending drafts (from ``flat``, already on the host, or now) into the
        placeholders of ``token_ids`` and into ``drafts``."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        for seq, (tokens, q) in zip(pending.seqs, pending.resolve(flat)):
            if seq in drafts:
                n = len(drafts[seq][0])                   # fewer when the budget cut it short
                seq.token_ids[len(seq.token_ids) - n:] = tokens[:n]
                drafts[seq] = (tokens[:n], drafts[seq][1])

    @staticmethod
    def _unpropose(seq: Sequence, tokens: list[int], keep: int) -> None:
        if keep < len(tokens):
            del seq.token_ids[len(seq.token_ids) - (len(tokens) - keep):]

    def step(self, finished_only: bool = False, first_tokens: bool = False):
        t0 = time.perf_counter()
        drafts = self._propose()
        batch = self.schedule()
        ran = dict(batch.items)
        for seq, (tokens, q) in list(drafts.items()):    # preempted, or cut short by the budget
            keep = max(0, ran.get(seq, 0) - 1) if seq.status is Status.RUNNING else 0
            self._unpropose(seq, tokens, keep)
            if keep == 0:
                del drafts[seq]
            else:
                drafts[seq] = (tokens[:keep], None if q is None else q[:keep])
        if not batch.items:
            self._resolve(drafts)
            return []
        prefill = batch.prefill_flags
        if not drafts:                                    # nothing to verify: a plain step
            self._resolve(drafts)
            logits, seqs, plan = self.runner.run(batch.items, batch.copies)
            self.scheduler.postprocess(batch)
            new_tokens = self.sample_tokens(logits, seqs)
        else:
            plan, new_tokens = self._verify_step(batch, drafts)
        outputs = self.emit(batch, prefill, new_tokens, t0, plan, finished_only, first_tokens=first_tokens)
        if self.ahead is not None:
            self.proposer.land_ahead(self.ahead)
        for seq in drafts:                # full pages of accepted tokens join the prefix cache
            if seq.status is Status.RUNNING:
                self.block_manager.commit_full_blocks(seq)
        for seq in list(new_tokens) + batch.preempted:
            if seq.status is not Status.RUNNING:
                self.proposer.forget(seq.seq_id)
                if seq.status is Status.FINISHED:
                    self.acceptance.pop(seq.seq_id, None)
        return outputs

    def abort(self, request_id: str) -> None:
        for seq in self.groups.get(request_id, []):
            self.proposer.forget(seq.seq_id)
            self.acceptance.pop(seq.seq_id, None)
        super().abort(request_id)

    def _verify_step(self, batch: ScheduledBatch, drafts: dict):
        """One target pass over the batch with logits for every row of the drafted
        sequences; returns (the plan, new tokens per sequence)."""
        if self.verify_graphs is not None and self.verify_graphs.fits(batch.items, drafts):
            return self._verify_in_graph(batch, drafts)
        self._resolve(drafts)                              # the eager plan reads the tokens
        self.runner.copy_blocks(batch.copies)
        plan = self.runner.plan(batch.items)
        rows, seqs, spans, r = [], [], {}, 0
        for seq, n in [it for it in batch.items if it[1] == 1] + [it for it in batch.items if it[1] > 1]:
            if seq in drafts:                              # the plan's row order: decodes first
                spans[seq] = (len(rows), len(rows) + n)
                rows += range(r, r + n)
            elif seq.num_computed_tokens + n == seq.num_tokens:
                rows.append(r + n - 1)
                seqs.append(seq)
            r += n
        with torch.no_grad():
            logits = self.runner.forward(dataclasses.replace(
                plan, sample_rows=torch.tensor(rows, dtype=torch.long, device=self.runner.device)))
        self.scheduler.postprocess(ScheduledBatch([it for it in batch.items if it[0] not in drafts]))
        in_span = {i for a, b in spans.values() for i in range(a, b)}
        new_tokens = self.sample_tokens(logits[[i for i in range(len(rows)) if i not in in_span]], seqs)
        for seq, (tokens, q, p, best) in self._on_host(drafts, spans, logits)[0].items():
            new_tokens[seq] = self._verify(seq, tokens, q, p, best)
        return plan, new_tokens

    def _verify_in_graph(self, batch: ScheduledBatch, drafts: dict):
        """:meth:`_verify_step` as one replay of the verify graph: sequence i of the batch
        owns rows i·(k+1) onwards; a sequence without drafts takes its row's token."""
        self.runner.copy_blocks(batch.copies)
        logits, best = self.verify_graphs.run(batch.items, self.pending)
        k1 = self.k + 1
        spans = {seq: (i * k1, i * k1 + n) for i, (seq, n) in enumerate(batch.items)}
        # the results' copy goes first: the drafts ahead then run on the GPU while the host
        # reads them (a copy queued after the drafts would wait for them)
        copy = self._send_to_host(drafts, spans, logits, best)
        pending = self.pending
        if (self.draft_ahead and pending is not None and all(seq.params.greedy for seq in drafts)
                and all(seq in pending.column for seq in drafts)):
            self.ahead = self.proposer.launch_ahead(pending, batch.items, {s: len(t) for s, (t, _) in drafts.items()},
                                                    best)
            self.ahead_counts["launched"] += self.ahead is not None
        plain = [seq for seq, _ in batch.items if seq not in drafts]
        self.scheduler.postprocess(ScheduledBatch([it for it in batch.items if it[0] not in drafts]))
        sampled = [seq for seq in plain if not seq.params.greedy]
        # sampled sequences without drafts draw from the sampler's streams (their own copy)
        drawn = self.sample_tokens(logits[[spans[s][0] for s in sampled]], sampled) if sampled else {}
        on_host, best_ids = self._on_host(drafts, spans, logits, best, copy)
        new_tokens = {seq: drawn[seq] if seq in drawn else [best_ids[spans[seq][0]]] for seq in plain}
        for seq, (tokens, q, p, best_row) in on_host.items():
            new_tokens[seq] = self._verify(seq, tokens, q, p, best_row)
        return GraphStepPlan(), new_tokens

    def _send_to_host(self, drafts: dict, spans: dict, logits: torch.Tensor, best: torch.Tensor | None = None):
        """Start the one device -> host copy of what acceptance needs, per drafted sequence:
        (tokens, q, p) for sampled sequences (p the target's distribution at the k+1
        positions), the target's argmax per position for greedy ones; the argmax of every
        row of ``logits`` (``best``, if already computed); the pending drafts; the fault
        flag. Queued now, in stream order: work launched after it runs on while the host
        waits for the copy only. Returns (host tensor, CUDA event or None, rows of best)."""
        best = logits.argmax(-1) if best is None else best
        sampled = [seq for seq in drafts if not seq.params.greedy]
        # token ids as they are when nothing else comes back; as float64 beside probabilities
        parts = [best if not sampled else best.double()]
        if self.pending is not None:                      # the drafts come back in the same copy
            parts.append(self.pending.flat() if not sampled else self.pending.flat().double())
        for seq in sampled:
            a, b = spans[seq]
            parts += [probabilities(logits[a:b], seq.params).double().flatten(), drafts[seq][1].double().flatten()]
        parts.append(fault_flag(logits.device).to(parts[0].dtype))   # a kernel's recorded faults, last
        flat = torch.cat(parts)
        if not flat.is_cuda:
            return flat, None, best.numel()
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return host, ready, best.numel()

    def _on_host(self, drafts: dict, spans: dict, logits: torch.Tensor, best: torch.Tensor | None = None,
                 copy: tuple | None = None):
        """What acceptance needs, per drafted sequence, on the host (:meth:`_send_to_host`'s
        copy, started now unless ``copy`` is one already under way): (tokens, q, p) for
        sampled sequences, the target's argmax per position for greedy ones. Returns that
        dict and the argmax of every row of ``logits``."""
        flat, ready, n_best = self._send_to_host(drafts, spans, logits, best) if copy is None else copy
        if ready is not None:
            ready.synchronize()                           # the verification's one wait
        if flat[-2]:
            raise_recorded_faults(logits.device)
        best_ids = flat[:n_best].long().tolist()
        at, out = n_best, {}
        if self.pending is not None:
            n = len(self.pending.seqs) * self.pending.drafter.k
            self._resolve(drafts, flat[at:at + n].long().tolist())
            at += n
        for seq, (tokens, q) in drafts.items():
            a, b = spans[seq]
            p_host = q_host = None
            if not seq.params.greedy:
                vocab = logits.shape[-1]
                p_host = flat[at:at + (b - a) * vocab].view(b - a, vocab)
                at += (b - a) * vocab
                q_host = flat[at:at + len(tokens) * vocab].view(len(tokens), vocab)
                at += len(tokens) * vocab
            out[seq] = (tokens, q_host, p_host, best_ids[a:b])
        return out, best_ids

    def _verify(self, seq: Sequence, tokens: list[int], q, p, best: list[int]) -> list[int]:
        """Accept/reject one sequence's drafts, then roll it back to what was accepted."""
        committed = seq.num_tokens - len(tokens)
        if seq.params.greedy:
            out = accept_greedy_ids(tokens, best)
        else:
            out = self.accept(tokens, q, p, _stream(seq, committed, ACCEPT_SALT))
        n_acc = len(out) - 1
        self.stats.record(len(tokens), n_acc, len(out))
        accepted, rejected = self.acceptance.get(seq.seq_id, (2.0, 1.0))
        self.acceptance[seq.seq_id] = (0.8 * accepted + n_acc, 0.8 * rejected + (n_acc < len(tokens)))
        self.rollback(seq, self.block_manager, len(tokens), n_acc)
        del seq.token_ids[committed:]              # emit() appends `out`, checking EOS and max_tokens
        return out


# -- saved GPU results ------------------------------------------------------------------------------------
def load_results(path=RESULTS) -> dict | None:
    """Figures measured by ``tools/speculative_bench.py`` on a GPU, if shipped."""
    path = Path(path)
    return json.loads(path.read_text()) if path.exists() else None


def format_results(result: dict) -> str:
    """One line per (batch size, draft, k): tokens/s, speed-up over the target alone,
    acceptance, tokens per pass (and the requests whose greedy tokens left the target's
    at a near tie of its logits, if any); then the server's overhead, per way of serving
    measured."""
    lines = [f"{result['gpu']}, {result['date']}, torch {result['versions'].get('torch')}, "
             f"triton {result['versions'].get('triton')}; greedy decoding, {result['max_tokens']} new tokens"]
    if result.get("measured"):                     # rows of several runs: which came from where
        lines += textwrap.wrap(f"measured: {result['measured']}", 88)
    lines.append(f"{'batch':>5} {'draft':>17} {'k':>4} {'tok/s':>9} {'speed-up':>8} {'accept':>6} {'tok/pass':>8}")
    for r in result["rows"]:
        k = f"<={r['k']}" if r.get("adaptive") else str(r["k"])      # adaptive: up to k per request
        draft = r["draft"] + (" (eager)" if r.get("graphs") is False else "")   # rows without the key: as measured
        draft += " (no overlap)" if r.get("overlap") is False and r.get("multi_step", 1) == 1 else ""   # host not ahead
        draft += " (stepped)" if r.get("graphs") and r.get("rollout") is False and r.get("graph_draft") else ""
        draft += " (no ahead)" if r.get("graphs") and r.get("draft_ahead") is False else ""   # drafts after reading
        draft += " (int8)" if r.get("draft_weights") == "int8" else ""    # the draft kernels' int8 weights
        draft += f" ({r['multi_step']} steps)" if r.get("multi_step", 1) > 1 else ""   # a window per host step
        flips = r.get("near_tie_flips")                 # requests whose greedy tokens parted at a near tie
        accept = r["acceptance"]                        # NaN for the target alone: nothing drafted
        accept = f"{accept:>6.0%}" if accept == accept else f"{'-':>6}"
        lines.append(f"{r['batch']:>5} {draft:>17} {k:>4} {r['tokens_per_s']:>9.0f} "
                     f"{r['speedup']:>7.2f}x {accept} {r['tokens_per_pass']:>8.2f}"
                     + (f"  ({flips} near-tie flip{'s' * (flips > 1)})" if flips else ""))
    ways = {"server_switch_interval": "engine thread, GIL switch 0.5 ms", "server_engine_process": "engine process",
            "server_api_servers": "API servers", "server_profiled": "API servers, profiled", "server": "engine thread"}
    for key, sv in result.items():          # server rows, in the order measured (a suffix: a variant)
        how = next((how for way, how in ways.items() if key.startswith(way)), None)
        if how is not None and isinstance(sv, dict):
            if sv.get("api_servers", 1) > 1:
                how = f"{sv['api_servers']} {how} + engine process"
            if sv.get("multi_step", 1) > 1:
                how += f", {sv['multi_step']} decode steps a host step"
            if sv.get("scheduler_delay_factor"):
                how += f", admission delay factor {sv['scheduler_delay_factor']:g}"
            load = (f", {sv['rounds']} requests of {sv['max_tokens']} tokens each" if "max_tokens" in sv
                    and "rounds" in sv else "")
            lines.append(f"server ({how}): {sv['clients']} streaming clients{load}, {sv['http_tokens_per_s']:.0f} tok/s "
                         f"through HTTP vs {sv['engine_tokens_per_s']:.0f} in-process ({sv['ratio']:.0%}"
                         + (f"; best of {sv['repeats']} runs each way, medians {sv['ratio_of_medians']:.0%})"
                            if "repeats" in sv else ")")    # older rows: one HTTP run
                         + (f"; time to first token (p50) {sv['http_ttft_p50_s'] * 1e3:.1f} ms through HTTP, "
                            f"{sv['engine_ttft_p50_s'] * 1e3:.1f} ms in-process" if "http_ttft_p50_s" in sv else ""))
    return "\n".join(lines)
