"""A request's state as the engine sees it: its tokens, how many of them already have
keys and values in the KV cache, the pages that hold them, and how to sample.

A sequence's life: WAITING (queued) -> RUNNING (has pages; prefilled in one or more
chunks, then decoded one token per step) -> FINISHED. Preemption sends a RUNNING
sequence back to WAITING with its pages released: its prompt and the tokens generated
so far are recomputed when it is admitted again (recompute, not swap).
"""
from __future__ import annotations

import enum
import math
import random
from dataclasses import dataclass, field

from .model import encode_prompt


class RequestError(ValueError):
    """A request the engine refuses (bad prompt, bad sampling parameters, too big):
    raised by ``add_request``; ``generate`` reports it on that request's output only."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each new token of one request.

    temperature 0 is greedy (argmax). Otherwise logits / temperature, then top-k
    (0 = off) and top-p (nucleus; 1 = off) restrict the candidates, and one token is
    drawn with a random stream keyed by (seed, sample index, token index): the same
    seed gives the same text whatever else the engine is doing.
    """
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 64
    seed: int | None = None
    n: int = 1
    stop_at_eos: bool = True

    def validate(self, vocab_size: int) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise RequestError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 0 <= self.top_k <= vocab_size:
            raise RequestError(f"top_k must be an int in [0, {vocab_size}] (0 = off), got {self.top_k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise RequestError(f"top_p must be in (0, 1] (1 = off), got {p!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise RequestError(f"n (completions per prompt) must be an int >= 1, got {self.n!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise RequestError(f"seed must be an int or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One stream of tokens: a request's prompt and one completion of it."""
    seq_id: int
    request_id: str
    token_ids: list[int]                  # prompt + generated, grows by one per decode
    num_prompt_tokens: int
    params: SamplingParams
    seed: int                             # params.seed, or drawn at random when None
    index: int = 0                        # which of the request's n completions
    arrival_time: float = 0.0
    status: Status = Status.WAITING
    num_computed_tokens: int = 0          # tokens whose K and V are in the cache
    num_cached_tokens: int = 0            # of those, found in the prefix cache at admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # prefix-cache keys of its leading full pages
    num_registered_blocks: int = 0        # leading pages of block_table already in the prefix cache
    finish_reason: str | None = None      # "eos", "length" (max_tokens or context), "abort"
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to run through the model before the next one can be sampled."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


def draw_seed() -> int:
    return random.getrandbits(62)


def validate_request(prompt, params, vocab_size: int, max_model_len: int) -> list[int]:
    """A request's prompt token ids (a str is encoded as BOS + its UTF-8 bytes), or a
    :class:`RequestError` that says what to change."""
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("the prompt is empty: give at least one character (or token)")
        ids = encode_prompt(prompt)
    # the checks over every token run in C (set, map, min, max): a 2K-token prompt is
    # checked in microseconds, where a Python loop took a few hundred (a request's TTFT)
    elif isinstance(prompt, (list, tuple)) and all(issubclass(t, int) and not issubclass(t, bool)
                                                   for t in set(map(type, prompt))):
        ids = list(prompt)
        if not ids:
            raise RequestError("the prompt is empty: give at least one token")
        if min(ids) < 0 or max(ids) >= vocab_size:
            bad = next(t for t in ids if not 0 <= t < vocab_size)
            raise RequestError(f"prompt token {bad} is outside the vocabulary [0, {vocab_size})")
    else:
        raise RequestError(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}")
    if not isinstance(params, SamplingParams):
        raise RequestError(f"params must be SamplingParams, got {type(params).__name__}")
    params.validate(vocab_size)
    if len(ids) >= max_model_len:
        raise RequestError(f"the prompt has {len(ids)} tokens, but the model's context is {max_model_len}: "
                           f"shorten it to at most {max_model_len - 1} tokens (one position is needed "
                           f"for the first new token)")
    return ids
