r"""The serving engine's model at tensor-parallel degree n, bit-identical to TP=1.

Rank r of n holds, in every block,

* **attention, column-parallel by heads**: query heads [r·Hq/n, (r+1)·Hq/n) and KV heads
  [r·Hkv/n, (r+1)·Hkv/n) of qkv_proj. Contiguous head ranges keep each GQA group (Hq/Hkv
  query heads sharing one KV head) on one rank, so attention needs no communication:
  each rank runs it on its own heads over its own KV cache;
* **o_proj, row-parallel**: the heads' outputs are all-gathered (o_proj's BitLinear
  normalises and quantizes the *whole* row, as at TP=1), each rank multiplies its K/n
  inputs, and the int32 partial sums are all-reduced before the one scale;
* **the GLU MLP**: :class:`~gpulab.parallel.tensor_parallel.TensorParallelGLU`;
* embedding, final norm and LM head replicated: every rank computes the same logits.

Per block: two all-gathers of activations and two int32 all-reduces. Every output
element of every projection is the same integer sum and the same scale as at TP=1, and
attention per head is the same arithmetic, so hidden states and logits equal TP=1's bit
for bit, on every rank.

Serving: the model's ``cfg`` describes the *rank-local* shape (``n_heads``,
``n_kv_heads`` and ``hidden`` divided by n; ``full_cfg`` keeps the whole model's), so the
engine's unchanged :class:`~gpulab.engine.runner.ModelRunner` allocates a paged KV cache
of the local KV heads and runs attention on the local heads. Every rank runs its own
:class:`~gpulab.engine.engine.LLM` with the same scheduler on the same requests: the
schedules agree (they depend only on the requests and the tokens), the logits agree, so
greedy sampling agrees and the collectives of every step line up. Sampling with a
temperature agrees too when each request carries an explicit ``seed`` (the engine draws
a random one otherwise, differently on each rank).

    model = load_checkpoint(device=..., dtype=...)        # on every rank
    tp = TensorParallelTransformer(model)                 # inside run_ranks(fn, 2)
    LLM(tp).generate(prompts)                             # rank-local pages, same tokens
"""
from __future__ import annotations

import time
from dataclasses import asdict, replace

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import runtime
from ..bitlinear import BitLinear
from ..engine.engine import LLM, EngineConfig
from ..engine.model import (ModelConfig, TernaryTransformer, apply_rope, attention_with_history, encode_prompt,
                            load_checkpoint, prepare_for_serving, store_kv)
from ..engine.sequence import SamplingParams
from .tensor_parallel import ColumnParallelBitLinear, RowParallelBitLinear, TensorParallelGLU, gather_parts


# -- validation -----------------------------------------------------------------------------
def require_tp_model(model, world_size: int, rank: int | None = None) -> None:
    """Raise a clear error when ``model`` cannot be split over ``world_size`` ranks."""
    if not isinstance(model, TernaryTransformer):
        raise TypeError(f"tensor parallelism splits a gpulab.engine.model.TernaryTransformer, "
                        f"got {type(model).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size (the TP degree) must be a positive int, got {world_size!r}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size):
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
    layers = [m for m in model.modules() if isinstance(m, BitLinear)]
    if not all(m.packed for m in layers):
        raise ValueError("pack the model first (model.pack(), or load_checkpoint): tensor parallelism "
                         "splits the 2-bit inference weights")
    if any(m.bias is not None for m in layers):
        raise ValueError("the model has BitLinear biases: the engine's model has none, and this split "
                         "does not handle them")
    cfg, n = model.cfg, world_size
    if cfg.n_heads % n:
        raise ValueError(f"n_heads={cfg.n_heads} query heads cannot be split over {n} ranks: each rank "
                         f"holds whole heads, so n_heads must be divisible by the TP degree")
    if cfg.n_kv_heads % n:
        raise ValueError(f"n_kv_heads={cfg.n_kv_heads} KV heads cannot be split over {n} ranks: each rank "
                         f"holds whole KV heads with their query heads (GQA groups stay on one rank), "
                         f"so n_kv_heads must be divisible by the TP degree")
    if cfg.hidden % n:
        raise ValueError(f"the MLP's hidden size {cfg.hidden} cannot be split over {n} ranks: "
                         f"it must be divisible by the TP degree")


def local_config(cfg: ModelConfig, world_size: int) -> ModelConfig:
    """The rank-local shape: heads, KV heads and MLP units divided by the TP degree."""
    return replace(cfg, n_heads=cfg.n_heads // world_size, n_kv_heads=cfg.n_kv_heads // world_size,
                   hidden=cfg.hidden // world_size)


# -- the model ------------------------------------------------------------------------------
class TensorParallelBlock(nn.Module):
    """One transformer block's share on one rank (see the module docstring)."""

    def __init__(self, block, full_cfg: ModelConfig, group, rank: int, world_size: int):
        super().__init__()
        self.cfg, self.group = local_config(full_cfg, world_size), group
        q, kv = full_cfg.n_heads * full_cfg.head_dim, full_cfg.n_kv_heads * full_cfg.head_dim
        self.attention_width = q
        self.qkv_proj = ColumnParallelBitLinear.from_bitlinear(block.qkv_proj, (q, kv, kv), group, rank, world_size)
        self.o_proj = RowParallelBitLinear.from_bitlinear(block.o_proj, group, rank, world_size)
        self.mlp = TensorParallelGLU(block.gate_up, block.down_proj, group, rank=rank, world_size=world_size)

    def forward(self, x, cos, sin, attend, layer: int, reference: bool = False, kv_cache=None):
        c = self.cfg
        q, k, v = self.qkv_proj(x, reference).split(
            [c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.n_kv_heads * c.head_dim], dim=-1)
        q = apply_rope(q.unflatten(-1, (c.n_heads, c.head_dim)), cos, sin)
        k = apply_rope(k.unflatten(-1, (c.n_kv_heads, c.head_dim)), cos, sin)
        v = v.unflatten(-1, (c.n_kv_heads, c.head_dim))
        if kv_cache is not None:                                    # this rank's heads into its cache
            store_kv(kv_cache(layer), k, v)
        o = attend(layer, q, k, v)                                  # [..., local heads, head_dim]
        o = gather_parts(o.flatten(-2), (self.attention_width,), self.group)     # every head, TP=1 order
        x = x + self.o_proj(o, reference)
        return x + self.mlp(x, reference)


class TensorParallelTransformer(nn.Module):
    """Rank's share of a packed :class:`~gpulab.engine.model.TernaryTransformer`, with the
    interface the engine uses (``cfg``, ``packed``, ``embed``, ``rope_cos``,
    ``hidden_states``, ``logits``). ``cfg`` is the rank-local shape, ``full_cfg`` the
    model's. ``rank``/``world_size`` default to ``group``'s (the process group must then
    exist); passing them builds the shard without one (to inspect it), but running it
    needs the group."""

    def __init__(self, model: TernaryTransformer, group=None, rank: int | None = None,
                 world_size: int | None = None):
        super().__init__()
        if rank is None or world_size is None:
            if not dist.is_initialized():
                raise RuntimeError("no process group: build the tensor-parallel model inside a rank function "
                                   "(gpulab.parallel.run_ranks(fn, n)), or pass rank and world_size")
            rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        require_tp_model(model, world_size, rank)
        self.full_cfg, self.cfg = model.cfg, local_config(model.cfg, world_size)
        self.group, self.rank, self.world_size = group, rank, world_size
        self.embed, self.norm, self.head = model.embed, model.norm, model.head       # replicated
        self.blocks = nn.ModuleList(TensorParallelBlock(b, model.cfg, group, rank, world_size)
                                    for b in model.blocks)
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    @property
    def packed(self) -> bool:
        return True

    def extra_repr(self) -> str:
        c = self.cfg
        return (f"rank {self.rank} of {self.world_size}: {c.n_heads} query heads, {c.n_kv_heads} KV heads, "
                f"{c.hidden} MLP units of {self.full_cfg.n_heads}, {self.full_cfg.n_kv_heads}, "
                f"{self.full_cfg.hidden}")

    def hidden_states(self, tokens: torch.Tensor, positions: torch.Tensor, attend,
                      reference: bool = False, kv_cache=None) -> torch.Tensor:
        """Final-norm hidden states [..., d_model], replicated on every rank;
        ``attend(layer, q, k, v)`` sees this rank's heads only, and ``kv_cache`` (as
        :meth:`TernaryTransformer.hidden_states`'s) is this rank's cache."""
        x = self.embed(tokens)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, attend, i, reference, kv_cache)
        return self.norm(x)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(h).float()


# -- serving at TP=n ------------------------------------------------------------------------
PROMPTS = ("Tyger Tyger, burning bright", "Shall I compare thee", "a", "The sea is calm tonight")


def engine_model(cfg: ModelConfig | dict | None = None, seed: int = 0, device=None, dtype=None) -> TernaryTransformer:
    """The model to serve, the same on every rank: the shipped checkpoint (``cfg=None``)
    or a random packed model of shape ``cfg`` drawn from ``seed``."""
    device = runtime.device() if device is None else device
    dtype = runtime.default_dtype() if dtype is None else dtype
    if cfg is None:
        return load_checkpoint(device=device, dtype=dtype)
    cfg = ModelConfig(**cfg) if isinstance(cfg, dict) else cfg
    device = torch.device(device)
    cuda = [torch.cuda.current_device() if device.index is None else device.index] if device.type == "cuda" else []
    # drawn on the device (fast for big models); the same generator on every rank's GPU
    with torch.random.fork_rng(devices=cuda), device:
        torch.manual_seed(seed)
        model = TernaryTransformer(cfg)
        with torch.no_grad():
            for m in model.modules():       # norm weights away from 1, as after training
                if isinstance(m, BitLinear):
                    m.norm_weight.mul_(1 + 0.3 * torch.randn_like(m.norm_weight))
            model.norm.weight.mul_(1 + 0.3 * torch.randn_like(model.norm.weight))
    return prepare_for_serving(model, device, dtype)


def serve_greedy(model, prompts, max_tokens: int, engine: dict | None = None, warmup: bool = True) -> dict:
    """Serve ``prompts`` greedily through :class:`LLM`; tokens, per-token latency (decode
    steps: one token per running sequence) and whether every page came back."""
    llm = LLM(model, EngineConfig(**(engine or {})))
    if warmup:      # kernels compiled, caches and graphs warm; prefix pages cached
        llm.generate(list(prompts), SamplingParams(max_tokens=2))
    first = len(llm.metrics.steps)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(list(prompts), SamplingParams(max_tokens=max_tokens, stop_at_eos=False))
    wall = time.perf_counter() - t
    steps = llm.metrics.steps[first:]
    decode = sorted(s.end - s.start for s in steps if s.prefill_tokens == 0 and s.decode_tokens)
    errors = [o.error for o in outs if o.error]
    if errors:
        raise ValueError(f"the engine refused a request: {errors[0]}")
    return {"tokens": [o.token_ids for o in outs], "texts": [o.text for o in outs],
            "decode_steps": len(decode), "graph_steps": sum(s.graph for s in steps),
            "per_token_ms_p50": 1e3 * decode[len(decode) // 2] if decode else None,
            "per_token_ms_min": 1e3 * decode[0] if decode else None,
            "per_token_ms_mean": 1e3 * sum(decode) / len(decode) if decode else None,
            "wall_s": wall, "idle": llm.idle(), "pages_free": llm.block_manager.num_free,
            "pages_total": llm.config.num_blocks, "kv_cache_shape": list(llm.runner.k_cache.shape)}


def tp_engine_rank(prompts=PROMPTS, max_tokens: int = 8, cfg: ModelConfig | dict | None = None, seed: int = 0,
                   dtype: torch.dtype | None = None, engine: dict | None = None, compare_tp1: bool = True,
                   warmup: bool = True) -> dict:
    """Rank function (:func:`gpulab.parallel.run_ranks`): the same model on every rank,
    served greedily at TP=n (this group's size) and, with ``compare_tp1``, unsharded on
    this rank's device alone (TP=1). ``engine``: EngineConfig fields (e.g.
    ``{"linear": "torch", "attention": "torch"}`` for the PyTorch paths)."""
    dtype = runtime.default_dtype() if dtype is None else dtype
    model = engine_model(cfg, seed, runtime.device(), dtype)
    out = {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "dtype": str(dtype).replace("torch.", ""),
           "model": asdict(model.cfg), "engine": dict(engine or {}), "max_tokens": max_tokens,
           "prompts": list(prompts)}
    with torch.no_grad():
        out["tp"] = serve_greedy(TensorParallelTransformer(model), prompts, max_tokens, engine, warmup)
        if compare_tp1:
            out["tp1"] = serve_greedy(model, prompts, max_tokens, engine, warmup)
    return out


def prompt_logits(model, text: str) -> torch.Tensor:
    """Logits [T, vocab] of a prompt in one forward, attention over the prompt itself
    (PyTorch paths): the quickest whole-model comparison of TP=n and TP=1."""
    dev = model.rope_cos.device
    tokens = torch.tensor(encode_prompt(text), device=dev)
    with torch.no_grad():
        h = model.hidden_states(tokens, torch.arange(len(tokens), device=dev),
                                lambda layer, q, k, v: attention_with_history(q, k, v), reference=True)
        return model.logits(h)
