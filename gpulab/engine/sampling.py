r"""Choosing each sequence's next token from its logits, per request, reproducibly.

* greedy (temperature 0): the argmax;
* otherwise logits / temperature; top-k keeps the k largest (0 = off); top-p keeps the
  smallest set of most likely tokens whose probabilities sum to at least p (1 = off);
  then one token is drawn with the Gumbel-max trick:

      token = argmax_v (logits_v / T + g_v),     g_v = -log(-log u_v),  u_v ~ U(0, 1)

  which picks v with probability softmax(logits / T)_v over the kept tokens.

The uniforms u of a token are a hash of (request seed, completion index, token index)
and the vocabulary index v alone, computed where the logits are (:func:`uniforms`). So
a request's text depends only on its seed and its logits: not on the batch it shares,
the step it lands in, chunk sizes or preemptions. (Before 2026-12-05 each row came from
a CPU generator seeded per token: 1.6 ms of host work a step at batch 64 on a 2-core
CPU, five times a greedy step's; the hash is a few elementwise ops on the whole batch,
which a decode window's graph can run too.)
"""
from __future__ import annotations

import functools
import operator

import torch

from .sequence import SamplingParams, Sequence

KEY_MASK = (1 << 62) - 1   # a stream key's bits: a window adds up to k to one on the device
_temperature = operator.attrgetter("params.temperature")    # 0 = greedy


def token_seed(seed: int, index: int, position: int) -> int:
    """The random stream of one token of one completion: a key in [0, 2^62), so that
    ``(token_seed(s, i, p) + j) & KEY_MASK == token_seed(s, i, p + j)`` with no int64
    overflow (a decode window derives its k tokens' keys so, :mod:`.multi_step`)."""
    return ((seed * 1_000_003 + index) * 1_000_003 + position) & KEY_MASK


_M32 = 0xFFFFFFFF


def mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x · c) mod 2^32 for int64 x in [0, 2^32): in 16-bit halves, so that no product
    leaves int64's range (signed overflow is not something to rely on)."""
    return (((((x >> 16) * c) & 0xFFFF) << 16) + (x & 0xFFFF) * c) & _M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' lowbias32: each input bit flips about half of the
    output bits) of int64 x in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniforms(keys: torch.Tensor, n: int) -> torch.Tensor:
    """[len(keys), n] float64 uniforms in (0, 1), u[b, v] a hash of (keys[b], v) alone
    (keys: int64 in [0, 2^62)): the same numbers on any device, in any batch."""
    row = mix32(mix32(keys >> 32) ^ (keys & _M32))                            # [B]
    col = mix32(torch.arange(n, device=keys.device) * 0x9E3779B9 & _M32)       # [n]
    h = mix32(row[:, None] ^ col[None, :])
    return (h.double() + 0.5) * 2.0 ** -32


def gumbel(keys: list[int] | torch.Tensor, vocab: int, device=None) -> torch.Tensor:
    """[len(keys), vocab] float32 Gumbel noise -log(-log u), row b from stream ``keys[b]``
    (a :func:`token_seed`), computed on ``device`` (or where ``keys`` is, a tensor): one
    small copy, then elementwise ops."""
    if not isinstance(keys, torch.Tensor):
        keys = torch.tensor(keys, dtype=torch.int64).to(device)
    return (-torch.log(-torch.log(uniforms(keys, vocab)))).float()


def filters(params: list[SamplingParams]) -> bool:
    """Does any of these requests restrict its candidates (top-k or top-p)?"""
    return any(x.top_k or x.top_p < 1 for x in params)


def draw(logits: torch.Tensor, temp: torch.Tensor, keys: torch.Tensor, greedy: torch.Tensor | None,
         top: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Tokens [B] from ``logits [B, V]`` on the device: the Gumbel-max draw from
    softmax(logits / temp) (top-k, top-p applied when ``top`` = (top_k, top_p) is given),
    the noise of row b from stream ``keys[b]``; the argmax where ``greedy`` (None: no row
    is). No host work: a decode window's graph runs it for each of its steps."""
    scaled = logits / temp[:, None]
    if top is not None:
        scaled = filter_top_k_top_p(scaled, *top)
    drawn = (scaled + gumbel(keys, logits.shape[-1])).argmax(-1)
    return drawn if greedy is None else torch.where(greedy, logits.argmax(-1), drawn)


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
    if not any(map(_temperature, seqs)):         # all greedy
        return logits.argmax(-1)
    p, dev = [s.params for s in seqs], logits.device
    tensor = functools.partial(torch.tensor, device=dev)
    top = (tensor([x.top_k for x in p]), tensor([float(x.top_p) for x in p])) if filters(p) else None  # sort only then
    keys = tensor([token_seed(s.seed, s.index, s.num_output_tokens) for s in seqs])
    greedy = None if all(map(_temperature, seqs)) else tensor([x.greedy for x in p])
    return draw(logits, tensor([x.temperature if x.temperature > 0 else 1.0 for x in p]), keys, greedy, top)
