r"""The model the engine serves: a tiny byte-level ternary transformer, and the plain
reference decoder that defines what the engine must output.

Architecture (the BitNet b1.58 recipe at toy size, on gpulab's kernels):

    tokens -> embedding -> N x [ x = x + o_proj(Attn(RoPE(qkv_proj(x))))
                                 x = x + down_proj(SiLU(gate) ⊙ up),  [gate, up] = gate_up(x) ]
           -> RMSNorm -> head -> logits over 256 bytes + BOS + EOS

* Every projection is a :class:`gpulab.bitlinear.BitLinear`: it normalises its own input
  (RMSNorm with a learned weight, so it *is* the block's pre-norm), quantizes it to int8
  per token and multiplies by ternary weights. Packed for inference, that is the fused
  RMSNorm+quant kernel (notebook 02) followed by the 2-bit ternary matmul (notebook 01).
* Attention: rotary position embeddings (RoPE, rotate-half form) and grouped-query
  attention, ``n_heads`` query heads sharing ``n_kv_heads`` key/value heads.
* Embedding, final norm and head stay in full precision, as in the BitNet papers.

The layers take flat token rows ``x [..., d_model]`` and an ``attend(layer, q, k, v)``
callback: training passes causal attention over [B, T], the reference decoder a
contiguous per-request cache, and the engine's runner paged attention over a whole
batch. So the model is written once and every way of running it shares its weights and
arithmetic.

Packed on gpulab's kernels, a layer is about a dozen launches, and the glue between the
projections is folded into the kernels around it: RoPE of q and k is one kernel, which
also stores k and v into the paged cache (:func:`gpulab.rope.rope_qk_store_kv`); the
residual adds and SiLU·mul run inside the norm-quant kernels of the projections that read
them (:mod:`gpulab.fused_norms`), the last one quantizing the next layer's QKV input.
"""
from __future__ import annotations

import copy
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..bitlinear import BitLinear, unpack_ternary
from ..fused_norms import add_rmsnorm_quant_into, silu_mul_rmsnorm_quant_into
from ..model import load_corpus
from ..normquant import rmsnorm_quant_ref
from ..rope import rope_qk_into, rope_reference as apply_rope      # apply_rope: RoPE in PyTorch ops

BOS, EOS = 256, 257             # specials after the 256 byte values
CHECKPOINT = Path(__file__).resolve().parent.parent / "data" / "ternary_poet.pt"


# -- tokenizer ------------------------------------------------------------------------------
def encode_prompt(text: str, bos: bool = True) -> list[int]:
    """UTF-8 bytes as token ids, after a BOS token."""
    return ([BOS] if bos else []) + list(text.encode("utf-8"))


def decode_tokens(tokens) -> str:
    """Token ids back to text; specials are dropped, invalid UTF-8 becomes �."""
    return bytes(int(t) for t in tokens if int(t) < 256).decode("utf-8", errors="replace")


def corpus_tokens(name: str = "poems.txt") -> torch.Tensor:
    """The corpus as one stream: BOS poem EOS BOS poem EOS ... (a poem starts at the line
    before its "by ..." line)."""
    poems = re.split(r"\n\s*\n(?=[^\n]+\nby )", load_corpus(name).strip())
    ids = []
    for p in poems:
        ids += encode_prompt(p.strip() + "\n") + [EOS]
    return torch.tensor(ids, dtype=torch.long)


# -- configuration --------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 258
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 32
    hidden: int = 384
    max_seq_len: int = 512
    rope_theta: float = 10000.0

    def __post_init__(self):
        for k, v in asdict(self).items():
            if k != "rope_theta" and (not isinstance(v, int) or v < 1):
                raise ValueError(f"ModelConfig.{k} must be a positive int, got {v!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")


TINY = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden=128,
                   max_seq_len=256)       # tests and CPU demos


# -- layers ---------------------------------------------------------------------------------
def rope_tables(cfg: ModelConfig, device=None):
    """cos, sin [max_seq_len, head_dim / 2] for rotate-half RoPE, float32."""
    inv = cfg.rope_theta ** (-torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
    ang = torch.arange(cfg.max_seq_len, dtype=torch.float64)[:, None] * inv[None, :]
    return ang.cos().float().to(device), ang.sin().float().to(device)


def packed_bitlinear_reference(layer: BitLinear, x: torch.Tensor) -> torch.Tensor:
    """What a packed BitLinear computes, in PyTorch ops only: RMSNorm + int8 absmax
    quantization, the integer product with the unpacked ternary weights, one scale."""
    x_q, x_s = rmsnorm_quant_ref(x, layer.norm_weight, layer.eps)
    w_t = unpack_ternary(layer.w_packed, layer.in_features).float()
    acc = x_q.float() @ w_t.t()       # integers, exact in float32 for these sizes
    return (acc / (x_s[..., None] * layer.w_scale.float())).to(x.dtype)


def run_bitlinear(layer: BitLinear, x: torch.Tensor, reference: bool = False) -> torch.Tensor:
    """The layer's own forward (Triton kernels once packed) or the PyTorch reference."""
    if reference and layer.packed:
        return packed_bitlinear_reference(layer, x)
    return layer(x)


Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# layer -> (slots long [rows], k_cache, v_cache [S, Hkv, D]): where a layer's new K, V go
KVCache = Callable[[int], tuple]


def store_kv(dest: tuple, k: torch.Tensor, v: torch.Tensor) -> None:
    """k, v [..., Hkv, D] into rows ``slots`` of the caches, dest = (slots, k_cache,
    v_cache) as :class:`KVCache` gives it (PyTorch's index_copy_: the path without the
    fused RoPE kernel)."""
    slots, kc, vc = dest
    kc.index_copy_(0, slots, k.reshape(-1, *k.shape[-2:]))
    vc.index_copy_(0, slots, v.reshape(-1, *v.shape[-2:]))


class TransformerBlock(nn.Module):
    # False: a packed block runs the unfused ops after attention too (for comparisons:
    # tools/engine_step_profile.py --unfused)
    fused_norms: bool = True

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.qkv_proj = BitLinear(cfg.d_model, q + 2 * kv)
        self.o_proj = BitLinear(q, cfg.d_model)
        self.gate_up = BitLinear(cfg.d_model, 2 * cfg.hidden)
        self.down_proj = BitLinear(cfg.hidden, cfg.d_model)

    def forward(self, x, cos, sin, attend, layer: int, reference: bool = False, kv_cache: KVCache | None = None):
        q, k, v = self.pre_attention(x, cos, sin, reference, None if kv_cache is None else kv_cache(layer))
        o = attend(layer, q, k, v)                       # [..., n_heads, head_dim]
        return self.post_attention(x, o, reference)

    def pre_attention(self, x, cos, sin, reference: bool = False, kv_dest: tuple | None = None,
                      x_quantized: tuple | None = None):
        """The block's work before attention: q [..., Hq, D], k, v [..., Hkv, D] of rows x
        (QKV projection, RoPE on q and k). Row by row: a row's output depends on its own
        input only (what lets the runner pad a step to a CUDA graph's bucket). ``kv_dest``
        = (slots [rows], k_cache, v_cache [S, Hkv, D]): also store row r's k and v into
        slot slots[r] of the caches (the rows flattened). ``x_quantized`` = (x_q, x_scale):
        x already normalised and quantized for the QKV projection (by the block before,
        :meth:`post_attention_to`), so its matmul alone runs.

        Packed and outside autograd, RoPE is one kernel (:mod:`gpulab.rope`) instead of about
        sixteen PyTorch ops: k turned in place in the projection's output (a view, as v is),
        q into a contiguous tensor (attention's public functions and hooks take one), and
        the same kernel stores k and v into the cache."""
        c = self.cfg
        qkv = (run_bitlinear(self.qkv_proj, x, reference) if x_quantized is None
               else self.qkv_proj.forward_quantized(*x_quantized, x.dtype))
        q, k, v = qkv.split([c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim,
                             c.n_kv_heads * c.head_dim], dim=-1)
        q = q.unflatten(-1, (c.n_heads, c.head_dim))
        k = k.unflatten(-1, (c.n_kv_heads, c.head_dim))
        v = v.unflatten(-1, (c.n_kv_heads, c.head_dim))
        # the kernel where it can run: packed, outside autograd, one row of angles per token
        if reference or not self.qkv_proj.packed or qkv.requires_grad or cos.shape[:-1] != q.shape[:-2]:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            if kv_dest is not None:
                store_kv(kv_dest, k, v)
            return q, k, v
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        # view, not reshape: never a copy, so k turns in place in qkv
        rope_qk_into(q.view(-1, c.n_heads, c.head_dim), k.view(-1, c.n_kv_heads, c.head_dim),
                     cos.reshape(-1, cos.shape[-1]), sin.reshape(-1, sin.shape[-1]),
                     q_out.view(-1, c.n_heads, c.head_dim), None,
                     *(() if kv_dest is None else (v.view(-1, c.n_kv_heads, c.head_dim), *kv_dest)))
        return q_out, k, v

    def post_attention(self, x, o, reference: bool = False):
        """The block's work after attention (row by row too): the output projection of
        o [..., Hq, D] added to the residual x, then the MLP and its residual.

        Packed on gpulab's kernels, the residual add and SiLU·mul are fused into the norms
        of the projections that read them (:mod:`gpulab.fused_norms`): three kernels fewer
        a layer, and the MLP's hidden activations never written."""
        return self.post_attention_to(x, o, None, reference)[0]

    def post_attention_to(self, x, o, next_qkv: BitLinear | None, reference: bool = False):
        """:meth:`post_attention`, then the next block's QKV input: (x, (x_q, x_scale)) where
        the last residual add can also normalise and quantize x for ``next_qkv`` (the fused
        path, ``next_qkv`` taking a quantized input: one kernel instead of the add and the
        next block's norm-quant), else (x, None)."""
        if (not reference and self.fused_norms and self.gate_up.takes_quantized_input
                and self.down_proj.takes_quantized_input):
            return self.post_attention_fused(x, o, next_qkv)
        lin = lambda m, t: run_bitlinear(m, t, reference)  # noqa: E731
        x = x + lin(self.o_proj, o.flatten(-2))
        gate, up = lin(self.gate_up, x).chunk(2, dim=-1)
        return x + lin(self.down_proj, F.silu(gate) * up), None

    def post_attention_fused(self, x, o, next_qkv: BitLinear | None = None):
        """post_attention's arithmetic with the add and SiLU·mul inside the norm kernels:
        x + o_proj(o) and its quantization for gate_up in one kernel, SiLU(gate) ⊙ up and
        its quantization for down_proj in another (their launchers: the shapes are the
        model's own, and a decode step's host time counts), and where ``next_qkv`` takes a
        quantized input the last residual add with its norm-quant too. Returns (x, the
        next QKV input (x_q, x_scale) or None)."""
        gu, dn = self.gate_up, self.down_proj
        attn = self.o_proj(o.flatten(-2))
        x2, attn2 = x.reshape(-1, x.shape[-1]), attn.view(-1, attn.shape[-1])
        rows, dev = x2.shape[0], x.device
        s = torch.empty(x2.shape, dtype=x.dtype, device=dev)
        s_q = torch.empty(x2.shape, dtype=torch.int8, device=dev)
        s_scale = torch.empty(rows, dtype=torch.float32, device=dev)
        add_rmsnorm_quant_into(x2, attn2, gu.norm_weight, s, s_q, s_scale, gu.eps)
        gate_up = gu.forward_quantized(s_q, s_scale, x.dtype)
        h_q = torch.empty((rows, dn.in_features), dtype=torch.int8, device=dev)
        h_scale = torch.empty(rows, dtype=torch.float32, device=dev)
        silu_mul_rmsnorm_quant_into(gate_up, dn.norm_weight, h_q, h_scale, dn.eps)
        down = dn.forward_quantized(h_q, h_scale, x.dtype)
        if next_qkv is None or not next_qkv.takes_quantized_input:
            return (s + down).view(x.shape), None
        x_next = torch.empty(x2.shape, dtype=x.dtype, device=dev)
        x_q = torch.empty(x2.shape, dtype=torch.int8, device=dev)
        x_scale = torch.empty(rows, dtype=torch.float32, device=dev)
        add_rmsnorm_quant_into(s, down, next_qkv.norm_weight, x_next, x_q, x_scale, next_qkv.eps)
        return x_next.view(x.shape), (x_q.view(x.shape), x_scale.view(x.shape[:-1]))


class TernaryTransformer(nn.Module):
    """A byte-level decoder-only transformer with ternary (BitLinear) projections.

    >>> model = TernaryTransformer(TINY)
    >>> model(torch.tensor([encode_prompt("Tyger")])).shape   # training forward
    torch.Size([1, 6, 258])
    """

    def __init__(self, cfg: ModelConfig = ModelConfig()):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model, eps=1e-6)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        nn.init.normal_(self.embed.weight, std=0.02)
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def packed(self) -> bool:
        return self.blocks[0].qkv_proj.packed

    def hidden_states(self, tokens: torch.Tensor, positions: torch.Tensor, attend: Attend,
                      reference: bool = False, kv_cache: KVCache | None = None) -> torch.Tensor:
        """Final-norm hidden states of tokens [...] at positions [...] (same shape).
        ``kv_cache``: where each layer's K, V go, stored before ``attend`` runs (which then
        finds them in the cache); None: ``attend`` keeps them itself."""
        x = self.embed(tokens)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        x_quantized = None             # layer i's QKV input, quantized by layer i - 1's last kernel
        for i, block in enumerate(self.blocks):
            q, k, v = block.pre_attention(x, cos, sin, reference, None if kv_cache is None else kv_cache(i),
                                          x_quantized)
            o = attend(i, q, k, v)                       # [..., n_heads, head_dim]
            x, x_quantized = block.post_attention_to(x, o, self.next_qkv(i), reference)
        return self.norm(x)

    def next_qkv(self, i: int) -> BitLinear | None:
        """The QKV projection after block i's (None after the last block)."""
        return self.blocks[i + 1].qkv_proj if i + 1 < len(self.blocks) else None

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(h).float()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Training/teacher-forcing forward: tokens [B, T] -> logits [B, T, vocab]."""
        if tokens.dim() != 2 or tokens.shape[1] > self.cfg.max_seq_len:
            raise ValueError(f"tokens must be [B, T] with T <= {self.cfg.max_seq_len}, got {tuple(tokens.shape)}")
        pos = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        return self.logits(self.hidden_states(tokens, pos, causal_attention))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, self.cfg.vocab_size), tokens[:, 1:].reshape(-1))

    def pack(self) -> "TernaryTransformer":
        """Every BitLinear to 2-bit packed inference weights (one-way)."""
        for m in self.modules():
            if isinstance(m, BitLinear):
                m.pack()
        return self.eval()


def causal_attention(layer: int, q, k, v):
    """q [B, T, Hq, D], k, v [B, T, Hkv, D] -> [B, T, Hq, D] (training path)."""
    g = q.shape[-2] // k.shape[-2]
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.repeat_interleave(g, -2).transpose(1, 2),
                                       v.repeat_interleave(g, -2).transpose(1, 2), is_causal=True)
    return o.transpose(1, 2)


# -- sizes and checkpoints ------------------------------------------------------------------
def model_sizes(model: TernaryTransformer) -> dict:
    """Bytes of the weights with every parameter in bf16, and as served: ternary
    projections packed at 2 bits (+ one float32 scale each), the rest (embedding, head,
    norm weights) kept in 16 bits."""
    ternary = packed = 0
    ternary_ids = set()
    for m in model.modules():
        if isinstance(m, BitLinear):
            ternary += m.in_features * m.out_features
            packed += m.out_features * -(-m.in_features // 4) + 4
            if m.weight is not None:
                ternary_ids.add(id(m.weight))
    other = sum(p.numel() for p in model.parameters() if id(p) not in ternary_ids)
    return {"ternary_params": ternary, "other_params": other,
            "bf16_bytes": 2 * (ternary + other), "packed_bytes": packed + 2 * other}


def format_sizes(model: TernaryTransformer) -> str:
    s = model_sizes(model)
    return (f"{s['ternary_params'] / 1e6:.2f} M ternary weights: {s['bf16_bytes'] / 1e6:.2f} MB in bf16, "
            f"{s['packed_bytes'] / 1e6:.2f} MB with 2-bit packing "
            f"({s['bf16_bytes'] / s['packed_bytes']:.1f}x smaller; embedding, head and norms stay 16-bit)")


def save_checkpoint(model: TernaryTransformer, path=CHECKPOINT) -> Path:
    """Packed 2-bit weights + 16-bit rest + the config, in one torch file."""
    if not model.packed:
        raise ValueError("pack the model first (model.pack()): checkpoints hold 2-bit weights")
    state = {k: (v.half() if v.is_floating_point() and "w_scale" not in k else v).cpu()
             for k, v in model.state_dict().items()}
    path = Path(path)
    torch.save({"config": asdict(model.cfg), "state": state}, path)
    return path


def load_checkpoint(path=CHECKPOINT, device=None, dtype=torch.float32) -> TernaryTransformer:
    """A packed model ready to serve; float weights in ``dtype`` on ``device``."""
    blob = torch.load(Path(path), map_location="cpu", weights_only=True)
    model = TernaryTransformer(ModelConfig(**blob["config"])).pack()
    state = {k: (v.float() if v.is_floating_point() else v) for k, v in blob["state"].items()}
    model.load_state_dict(state)
    return prepare_for_serving(model, device, dtype)


def prepare_for_serving(model: TernaryTransformer, device=None, dtype=torch.float32) -> TernaryTransformer:
    """Packed, in eval mode, float parameters in ``dtype`` (scales and RoPE tables stay float32)."""
    model = model.pack().to(device)
    for name, p in model.named_parameters():
        p.data = p.data.to(dtype)
    return model


# -- the reference decoder ------------------------------------------------------------------
@torch.no_grad()
def reference_generate(model: TernaryTransformer, prompt: list[int], max_tokens: int,
                       stop_at_eos: bool = True) -> list[int]:
    """Greedy decoding of one request with a contiguous KV cache, PyTorch ops only.

    This defines the engine's expected output: whatever the schedule, the engine's greedy
    tokens must equal these. Returns the generated tokens (without the prompt)."""
    cfg = model.cfg
    if not prompt or len(prompt) >= cfg.max_seq_len:
        raise ValueError(f"prompt must have 1..{cfg.max_seq_len - 1} tokens, got {len(prompt)}")
    dev = model.rope_cos.device
    caches = [[None, None] for _ in range(cfg.n_layers)]

    def attend(layer, q, k, v):                      # q [T, Hq, D]; k, v [T, Hkv, D]
        kc, vc = caches[layer]
        kc = k if kc is None else torch.cat([kc, k])
        vc = v if vc is None else torch.cat([vc, v])
        caches[layer] = [kc, vc]
        return attention_with_history(q, kc, vc)

    out: list[int] = []
    tokens, start = list(prompt), 0
    while len(out) < max_tokens and len(tokens) < cfg.max_seq_len:
        new = torch.tensor(tokens[start:], device=dev)
        pos = torch.arange(start, len(tokens), device=dev)
        h = model.hidden_states(new, pos, attend, reference=True)
        nxt = int(model.logits(h[-1]).argmax())
        out.append(nxt)
        tokens.append(nxt)
        start = len(tokens) - 1
        if stop_at_eos and nxt == EOS:
            break
    return out


def attention_with_history(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale=None) -> torch.Tensor:
    """The last T = len(q) of N keys are the queries' own tokens: query i sees keys
    0 .. N - T + i (causal with an offset). q [T, Hq, D], k, v [N, Hkv, D] -> [T, Hq, D]."""
    t, n = q.shape[0], k.shape[0]
    g = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = torch.einsum("thd,nhd->htn", q.float(), k.float().repeat_interleave(g, 1)) * scale
    allowed = torch.arange(n, device=q.device)[None, :] <= (n - t + torch.arange(t, device=q.device))[:, None]
    p = torch.softmax(s.masked_fill(~allowed, -math.inf), dim=-1)
    return torch.einsum("htn,nhd->thd", p, v.float().repeat_interleave(g, 1)).to(q.dtype)


# -- comparing greedy outputs -----------------------------------------------------------------
# Greedy tokens are an argmax: where the model's two best candidates are nearly tied, any
# other rounding (another kernel, reduction order or GEMM shape; bf16 activations) may pick
# the other one, and from there the outputs part. What counts as "nearly" is relative to
# the largest logit there: 1e-3 for float32 work (TF32 dots, reordered sums), and for
# 16-bit activations about four roundings of the largest logit (a rounding is at most
# 2^-8 of a value in bf16, 2^-11 in fp16). The gap is judged on float32 logits: a bf16
# reference is as noisy as the paths it judges (on the H200, 2026-12-03, one position's
# top two were 0.41 apart in a float32 copy of the model and 0.625 in its bf16 reference:
# the activations' roundings had flipped int8 codes of the quantized inputs).
NEAR_TIE = {torch.float32: 1e-3, torch.bfloat16: 2 ** -6, torch.float16: 2 ** -9}
# A 16-bit model's rounding, as first_flip perturbs its reference forward with it: the unit
# roundoff of the dtype (8 and 11 significant bits), in JITTER_SAMPLES perturbed forwards.
# The drift is the largest move among them, so it is an estimate from below: with 16 the
# H200 (2026-12-03, fifth run) found 0.348 at the position whose 0.41 gap the target alone
# had flipped between processes; 64 forwards of a short prompt cost a fraction of a second.
UNIT_ROUNDOFF = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}
JITTER_SAMPLES = 64


@torch.no_grad()
def next_token_logits(model: TernaryTransformer, tokens: list[int], jitter: float = 0.0,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """Logits [vocab] (float32) of the token after ``tokens``: the reference forward
    (PyTorch ops only, contiguous attention), in the model's own dtype. ``jitter``: each
    attention output scaled elementwise by 1 + U(−jitter, jitter), a rounding-sized
    perturbation (how far another kernel's roundings may move the logits)."""
    dev = model.rope_cos.device

    def attend(layer, q, k, v):
        o = attention_with_history(q, k, v)
        if jitter:
            noise = torch.rand(o.shape, generator=generator, device="cpu", dtype=torch.float64)
            o = (o.double() * (1 + jitter * (2 * noise.to(o.device) - 1))).to(o.dtype)
        return o

    h = model.hidden_states(torch.tensor(tokens, device=dev), torch.arange(len(tokens), device=dev),
                            attend, reference=True)
    return model.logits(h[-1])


@dataclass
class TokenFlip:
    """Where two greedy outputs for one prompt first differ, judged by the reference's
    float32 logits after the prompt and the tokens both share."""
    position: int             # index into the generated tokens
    got: int | None           # None: one output is a prefix of the other (no token flipped)
    want: int | None
    gap: float                # float32 reference logit of ``want`` minus that of ``got`` (nan if no flip)
    margin: float             # the float32 reference's best minus its second-best logit there
    tolerance: float          # the largest |gap| that counts as a near tie there
    drift: float = 0.0        # how far 16-bit rounding moved that gap (its own forward, perturbed ones; 0 in float32)

    @property
    def near_tie(self) -> bool:
        return self.got is not None and abs(self.gap) <= self.tolerance

    def describe(self) -> str:
        if self.got is None:
            return f"the outputs agree up to token {self.position}, then one of them stops"
        kind = "a near tie" if self.near_tie else "NOT a near tie"
        drift = f", moved up to {self.drift:.3g} by 16-bit rounding" if self.drift else ""
        return (f"token {self.position} is {self.got}, not {self.want}: the float32 reference's logits differ "
                f"by {self.gap:.3g} there{drift} (top-2 margin {self.margin:.3g}, tolerance "
                f"{self.tolerance:.3g}): {kind}")


def first_flip(model: TernaryTransformer, prompt: list[int], got: list[int], want: list[int],
               rel_tol: float | None = None) -> TokenFlip | None:
    """None if ``got == want`` (generated tokens after ``prompt``); else where they first
    differ, with the reference's logits there in float32 (a float32 copy of a 16-bit
    model: the same weights, exact arithmetic but for float32's roundings).

    A near tie is a gap of at most rel_tol · max(1, max |logit|) (default
    :data:`NEAR_TIE` of the model's dtype) or, for a 16-bit model, of at most the drift:
    the most the gap moved in the model's own reference forward in its dtype and in
    :data:`JITTER_SAMPLES` more whose attention outputs carry rounding-sized noise
    (:data:`UNIT_ROUNDOFF`, seeded): other 16-bit computations of the same logits. Every
    BitLinear quantizes its input to int8, so
    a rounding that flips one int8 code moves the logits by far more than a rounding of the
    logits themselves; the drift measures that at the position at hand instead of guessing
    it. (On the H200, 2026-12-03, the target alone gave either token from one process to
    the next at a position whose float32 gap was 0.27 on the CPU and 0.41 on the GPU; on
    the CPU the perturbed bf16 forwards put that gap anywhere from 0.13 to 0.88.)"""
    if got == want:
        return None
    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    tokens = list(prompt) + list(want[:i])
    dtype = model.embed.weight.dtype
    exact = model if dtype == torch.float32 else prepare_for_serving(copy.deepcopy(model), dtype=torch.float32)
    logits = next_token_logits(exact, tokens)
    if rel_tol is None:
        rel_tol = NEAR_TIE.get(dtype, NEAR_TIE[torch.float32])
    tolerance = rel_tol * max(1.0, float(logits.abs().max()))
    top = logits.topk(2).values
    margin = float(top[0] - top[1])
    if i == min(len(got), len(want)):
        return TokenFlip(i, None, None, float("nan"), margin, tolerance)
    gap = float(logits[want[i]] - logits[got[i]])
    drift = 0.0
    if exact is not model:
        gaps = [next_token_logits(model, tokens)]
        generator = torch.Generator().manual_seed(0)
        gaps += [next_token_logits(model, tokens, UNIT_ROUNDOFF.get(dtype, 2 ** -8), generator)
                 for _ in range(JITTER_SAMPLES)]
        drift = max(abs(float(g[want[i]] - g[got[i]]) - gap) for g in gaps)
    return TokenFlip(i, got[i], want[i], gap, margin, max(tolerance, drift), drift)
