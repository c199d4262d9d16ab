r"""Choosing each sequence's next token from its logits, per request, reproducibly.

* greedy (temperature 0): the argmax;
* otherwise logits / temperature; top-k keeps the k largest (0 = off); top-p keeps the
  smallest set of most likely tokens whose probabilities sum to at least p (1 = off);
  then one token is drawn with the Gumbel-max trick:

      token = argmax_v (logits_v / T + g_v),     g_v = -log(-log u_v),  u_v ~ U(0, 1)

  which picks v with probability softmax(logits / T)_v over the kept tokens.

The uniforms u of a token come from a generator seeded by (request seed, completion
index, token index) alone, generated on the CPU. So a request's text depends only on
its seed and its logits: not on the batch it shares, the step it lands in, chunk sizes
or preemptions.
"""
from __future__ import annotations

import operator

import torch

from .sequence import Sequence

_MASK64 = (1 << 63) - 1
_temperature = operator.attrgetter("params.temperature")    # 0 = greedy


def token_seed(seed: int, index: int, position: int) -> int:
    """The random stream of one token of one completion."""
    return ((seed * 1_000_003 + index) * 1_000_003 + position) & _MASK64


def gumbel_noise(seqs: list[Sequence], vocab: int) -> torch.Tensor:
    """[len(seqs), vocab] float32 Gumbel noise, each row from its own seeded stream."""
    rows = []
    gen = torch.Generator()
    for s in seqs:
        gen.manual_seed(token_seed(s.seed, s.index, s.num_output_tokens))
        u = torch.rand(vocab, generator=gen, dtype=torch.float64).clamp_(1e-12, 1 - 1e-12)
        rows.append(-torch.log(-torch.log(u)))
    return torch.stack(rows).float()


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf what top-k (per row, 0 = off) and top-p (per row, 1 = off) drop."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab)[:, None]
    drop = rank >= k
    probs = torch.softmax(sorted_logits.masked_fill(drop, -torch.inf), dim=-1)
    before = probs.cumsum(-1) - probs                  # mass of the more likely tokens
    drop |= (before >= top_p[:, None]) & (rank > 0)    # the most likely token always stays
    return logits.scatter(-1, order, sorted_logits.masked_fill(drop, -torch.inf))


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """One token per row of ``logits [B, vocab]`` (float32), row b for ``seqs[b]``."""
    if not seqs:
        return []
    return sample_on_device(logits, seqs).tolist()       # the step's one device -> host copy


def sample_on_device(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """:func:`sample`'s tokens left on the device (long [B]): no host sync."""
    best = logits.argmax(-1)
    if not any(map(_temperature, seqs)):         # all greedy
        return best
    greedy = torch.tensor([s.params.greedy for s in seqs], device=logits.device)
    p = [s.params for s in seqs]
    temp = torch.tensor([x.temperature if x.temperature > 0 else 1.0 for x in p], device=logits.device)
    top_k = torch.tensor([x.top_k for x in p], device=logits.device)
    top_p = torch.tensor([float(x.top_p) for x in p], device=logits.device)
    scaled = filter_top_k_top_p(logits / temp[:, None], top_k, top_p)
    drawn = (scaled + gumbel_noise(seqs, logits.shape[-1]).to(logits.device)).argmax(-1)
    return torch.where(greedy, best, drawn)
