"""Notebook 03, part 2: a tiny MatMul-free language model, trained on bytes of poetry.

Architecture (Zhu et al. 2024, "Scalable MatMul-free Language Modeling"):

    tokens -> embedding -> N x [ x = x + MLGRU(RMSNorm(x));  x = x + GLU(RMSNorm(x)) ]
           -> RMSNorm -> output head -> next-token logits

* token mixer: :class:`gpulab.mlgru.MLGRU` (ternary BitLinear projections around the
  elementwise recurrence h_t = f_t ⊙ h_{t-1} + i_t),
* channel mixer: a GLU, gate_proj (d -> 2I, BitLinear), SiLU(gate) ⊙ up, down_proj
  (I -> d, BitLinear), with I = 256·⌈(8d/3)/256⌉ as in the released code,
* embedding and head stay in full precision, as in the paper.

Generation keeps one [d_model] state per layer and sequence: memory does not grow with
the context, unlike a transformer's KV cache (2 · layers · d_model numbers per token).

Execution paths: on a GPU the scan runs gpulab's Triton kernels (forward and backward)
and BitLinear its fused kernels. On a CPU the model uses plain PyTorch (the log-step scan
``gpulab.mlgru.scan_torch`` and BitLinear's reference path): the interpreter is for
checking kernels, far too slow to train with. A 2-layer, d=64 model then trains on the
bundled corpus at about 10 steps per second on one CPU core (``train`` uses one
thread on a CPU: these ops are too small to gain from more).
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm.auto import tqdm as tqdm_auto
from tqdm.std import tqdm as tqdm_text

from .bitlinear import BitLinear, PackedKernels, unpack_ternary
from .block_step import BlockStepWeights, RolloutWeights, block_step, fits, rollout_fits, stack_blocks, weight_dtype
from .mlgru import MLGRU, ScanLaunchers, require_scan_kernel
from .validate import require_index_range, require_same_device, require_tensor

DATA = Path(__file__).resolve().parent / "data"
VOCAB = 256   # bytes


# -- data ---------------------------------------------------------------------------------
def load_corpus(name: str = "poems.txt") -> str:
    """The bundled public-domain corpus (see gpulab/data/README.md for its sources)."""
    return (DATA / name).read_text(encoding="utf-8")


def encode(text: str) -> torch.Tensor:
    """Byte-level tokenizer: UTF-8 bytes as int64 token ids in [0, 256)."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(tokens) -> str:
    """Token ids back to text (invalid UTF-8 sequences become �)."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.tolist()
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


def batches(data: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator):
    """Endless random windows of seq_len + 1 tokens (inputs and next-token targets)."""
    if data.dim() != 1 or data.numel() < seq_len + 2:
        raise ValueError(f"data must be 1-D with more than seq_len + 1 = {seq_len + 1} tokens, "
                         f"got shape {tuple(data.shape)}")
    offsets = torch.arange(seq_len + 1)
    while True:
        starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=gen)
        yield data[starts[:, None] + offsets]


# -- the model ----------------------------------------------------------------------------
def intermediate_size(d_model: int) -> int:
    return 256 * math.ceil((8 * d_model / 3) / 256)


class GLU(nn.Module):
    """Channel mixer: down(SiLU(gate) ⊙ up) with [gate, up] = gate_proj(x), all BitLinear."""

    def __init__(self, d_model: int, hidden: int | None = None):
        super().__init__()
        hidden = hidden or intermediate_size(d_model)
        self.gate_proj = BitLinear(d_model, 2 * hidden)
        self.down_proj = BitLinear(hidden, d_model)

    def forward(self, x):
        gate, up = self.gate_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    """x + MLGRU(RMSNorm(x)), then x + GLU(RMSNorm(x))."""

    def __init__(self, d_model: int, hidden: int | None = None, variant: str = "paper",
                 scan: str = "auto"):
        super().__init__()
        self.mixer_norm = nn.RMSNorm(d_model, eps=1e-6)
        self.mixer = MLGRU(d_model, variant=variant, scan=scan)
        self.mlp_norm = nn.RMSNorm(d_model, eps=1e-6)
        self.mlp = GLU(d_model, hidden)

    def forward(self, x, h0=None, mask=None):
        y, h = self.mixer(self.mixer_norm(x), h0, mask)
        x = x + y
        return x + self.mlp(self.mlp_norm(x)), h

    def step(self, x_t, h, fused: bool = False):
        """One token: x_t [B, d], state h [B, d] (None: zeros) -> (x_t, h). ``fused``: the
        whole step as one kernel (:mod:`gpulab.block_step`) where :meth:`step_weights` has
        its weights; the same math, rounded to x's dtype once instead of after every op."""
        weights = self.step_weights() if fused else None
        if weights is not None:
            return block_step(x_t, torch.zeros_like(x_t, dtype=torch.float32) if h is None else h, weights)
        y, h = self.mixer.step(self.mixer_norm(x_t), h)
        x_t = x_t + y
        return x_t + self.mlp(self.mlp_norm(x_t)), h

    def step_weights(self) -> BlockStepWeights | None:
        """The fused step's weights, made once per set of packed weights (a repacked or
        retrained block makes them again); None where the fused step does not apply:
        weights not packed (training), packed to another layout or run by other kernels,
        a bias, the "code" variant, or sizes :func:`gpulab.block_step.fits` refuses."""
        m, mlp = self.mixer, self.mlp
        projs = (m.f_proj, m.c_proj, m.g_proj, m.o_proj, mlp.gate_proj, mlp.down_proj)
        if (m.variant != "paper" or m.lower_bound is not None
                or not fits(m.d_model, mlp.down_proj.in_features)
                or len({p.eps for p in projs}) > 1 or self.mixer_norm.eps != self.mlp_norm.eps
                or any(not p.packed or p.kernels is not None or p.bias is not None or p.layout != "uint8x4"
                       for p in projs)):
            return None
        tensors = [self.mixer_norm.weight, self.mlp_norm.weight] + [t for p in projs
                                                                   for t in (p.norm_weight, p.w_packed, p.w_scale)]
        key = tuple((t.data_ptr(), t._version) for t in tensors) + (weight_dtype(),)
        cached = getattr(self, "_step_weights", None)
        if cached is None or cached[0] != key:
            def transposed(p):
                return unpack_ternary(p.w_packed, p.in_features).t().to(weight_dtype()).contiguous()
            norms = torch.stack([w.float() for w in (self.mixer_norm.weight, m.f_proj.norm_weight,
                                                     m.c_proj.norm_weight, m.g_proj.norm_weight,
                                                     m.o_proj.norm_weight, self.mlp_norm.weight,
                                                     mlp.gate_proj.norm_weight)])
            weights = BlockStepWeights(
                norms=norms, down_norm=mlp.down_proj.norm_weight.float().contiguous(),
                scales=torch.cat([p.w_scale.float().reshape(1) for p in projs]),
                w_f=transposed(m.f_proj), w_c=transposed(m.c_proj), w_g=transposed(m.g_proj),
                w_o=transposed(m.o_proj), w_gate=transposed(mlp.gate_proj), w_down=transposed(mlp.down_proj),
                eps_norm=self.mixer_norm.eps, eps_bit=m.f_proj.eps)
            self._step_weights = cached = (key, weights)
        return cached[1]


class MatMulFreeLM(nn.Module):
    """A small MatMul-free LM over bytes.

    >>> model = MatMulFreeLM(d_model=64, n_layers=2)
    >>> logits, states = model(encode("Tyger Tyger")[None])   # [1, 11, 256], 2 x [1, 64]
    """

    def __init__(self, vocab_size: int = VOCAB, d_model: int = 128, n_layers: int = 2,
                 hidden: int | None = None, variant: str = "paper", scan: str | ScanLaunchers = "auto"):
        super().__init__()
        require_scan_kernel("scan", scan)
        self.vocab_size, self.d_model, self.n_layers = vocab_size, d_model, n_layers
        self.embed = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList(Block(d_model, hidden, variant, scan) for _ in range(n_layers))
        self.norm = nn.RMSNorm(d_model, eps=1e-6)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        nn.init.normal_(self.embed.weight, std=0.02)

    def _check_tokens(self, tokens):
        require_tensor("tokens", tokens, ndim=2, dtype=torch.long, contiguous=False)
        if tokens.shape[1] == 0:
            raise ValueError("tokens has no time steps: pass at least one token per sequence")
        require_index_range("tokens", tokens, 0, self.vocab_size, "token ids must be < vocab_size")

    def forward(self, tokens: torch.Tensor, states: list | None = None, lengths: torch.Tensor | None = None):
        """tokens [B, T] (int64) -> (logits [B, T, vocab] float32, per-layer states [B, d]).

        ``lengths`` [B] (integers in [1, T]): rows of different lengths, right-padded to T;
        each row's states are those after its own ``lengths[b]`` tokens (one batched pass
        instead of one per row; the logits past a row's length mean nothing)."""
        self._check_tokens(tokens)
        mask = None
        if lengths is not None:
            require_tensor("lengths", lengths, shape=tokens.shape[:1], contiguous=False,
                           dtypes=(torch.int32, torch.int64))
            require_same_device(tokens=tokens, lengths=lengths)
            require_index_range("lengths", lengths, 1, tokens.shape[1] + 1,
                                "each row's length must be between 1 and the padded length T")
            mask = torch.arange(tokens.shape[1], device=tokens.device) < lengths[:, None]
        x = self.embed(tokens)
        new_states = []
        for k, block in enumerate(self.blocks):
            x, h = block(x, None if states is None else states[k], mask)
            new_states.append(h)
        return self.head(self.norm(x)).float(), new_states

    def rollout_weights(self) -> RolloutWeights | None:
        """The weights :func:`gpulab.block_step.draft_rollout` reads (k greedy tokens in one
        kernel), made again when a block's step weights or the embedding or head change;
        None where a block's fused step does not apply (:meth:`Block.step_weights`), the
        blocks' epsilons differ (the kernel takes one pair) or the vocabulary is not one
        :func:`gpulab.block_step.rollout_fits` takes."""
        blocks = [b.step_weights() for b in self.blocks]
        if (any(b is None for b in blocks) or len({(b.eps_norm, b.eps_bit) for b in blocks}) > 1
                or not rollout_fits(self.d_model, blocks[0].hidden, self.vocab_size)):
            return None
        tensors = (self.embed.weight, self.head.weight, self.norm.weight)
        key = tuple((t.data_ptr(), t._version) for t in tensors)
        cached = getattr(self, "_rollout_weights", None)        # (blocks' weights, key, weights)
        if cached is None or cached[1] != key or any(a is not b for a, b in zip(cached[0], blocks)):
            weights = RolloutWeights(embed=self.embed.weight.detach().contiguous(),
                                     norm=self.norm.weight.detach().float().contiguous(),
                                     head=self.head.weight.detach().contiguous(),
                                     blocks=stack_blocks(blocks), eps=self.norm.eps)
            cached = self._rollout_weights = (blocks, key, weights)
        return cached[2]

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over a batch of windows [B, T + 1]."""
        logits, _ = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, self.vocab_size), tokens[:, 1:].reshape(-1))

    def state_numel(self, batch: int = 1) -> int:
        """Numbers of recurrent state kept during generation: n_layers · d_model per sequence."""
        return batch * self.n_layers * self.d_model

    def step(self, token: torch.Tensor, states: list, fused: bool = False):
        """One token per sequence, token [B] -> (logits [B, vocab], new states).
        ``fused``: each block's step as one kernel where it applies (:meth:`Block.step`)."""
        x = self.embed(token)
        new_states = []
        for block, h in zip(self.blocks, states):
            x, h = block.step(x, h, fused)
            new_states.append(h)
        return self.head(self.norm(x)).float(), new_states

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Continue ``prompt`` [B, T0] by ``max_new_tokens`` sampled tokens; returns
        [B, T0 + max_new_tokens]. The prompt runs through the scan once; then each new
        token updates n_layers states of [B, d_model]: constant memory per sequence.
        temperature 0 means greedy."""
        self._check_tokens(prompt)
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if top_k is not None and not 1 <= top_k <= self.vocab_size:
            raise ValueError(f"top_k must be in [1, {self.vocab_size}], got {top_k}")
        B, T0 = prompt.shape
        out = torch.empty(B, T0 + max_new_tokens, dtype=torch.long, device=prompt.device)
        out[:, :T0] = prompt
        if max_new_tokens == 0:
            return out
        logits, states = self(prompt)
        logits = logits[:, -1]
        for k in range(max_new_tokens):
            token = _sample(logits, temperature, top_k, generator)
            out[:, T0 + k] = token
            if k + 1 < max_new_tokens:
                logits, states = self.step(token, states)
        return out

    def pack(self, kernels: PackedKernels | None = None) -> "MatMulFreeLM":
        """Switch every BitLinear to packed 2-bit inference weights, quantized, packed and
        run by ``kernels`` (default gpulab's)."""
        for m in self.modules():
            if isinstance(m, BitLinear):
                m.pack(kernels=kernels)
        return self

    def set_scan(self, scan: str | ScanLaunchers) -> "MatMulFreeLM":
        """Which scan every MLGRU runs: an ``mlgru_scan`` kernel name or a
        :class:`gpulab.mlgru.ScanLaunchers` pair (your own forward and backward)."""
        require_scan_kernel("scan", scan)
        for block in self.blocks:
            block.mixer.scan = scan
        return self


def _sample(logits, temperature, top_k, generator):
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


# -- training -----------------------------------------------------------------------------
def train(model: MatMulFreeLM, data: torch.Tensor, steps: int = 300, batch_size: int = 16,
          seq_len: int = 64, lr: float = 3e-3, seed: int = 0, progress: bool = True) -> list[float]:
    """AdamW on random windows of ``data`` (1-D token ids); returns the loss of every step.
    A linear warm-up over the first 10% of steps, then cosine decay to 10% of ``lr``."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    stream = batches(data, batch_size, seq_len, gen)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    warm = max(1, steps // 10)

    def schedule(s):
        if s < warm:
            return (s + 1) / warm
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (s - warm) / max(1, steps - warm)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    losses = []
    bar = range(steps)
    if progress:
        bar = _progress_bar(bar)
    # On a CPU this model's ops are small: one thread avoids the cost of threads waiting
    # on each other (large when other processes share the cores, as in CI).
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    model.train()
    try:
        for _ in bar:
            tokens = next(stream).to(device)
            loss = model.loss(tokens)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
            if progress:   # shown at the bar's next timed refresh, not one message per step
                bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    finally:
        torch.set_num_threads(threads)
        model.eval()
    return losses


def _progress_bar(iterable):
    """tqdm: a widget in Jupyter when ipywidgets works, else the text bar. Refreshed at
    most twice a second: each refresh is a message to the notebook, and a flood of them
    (thousands of steps) overflows the kernel's output queue, which drops messages."""
    try:
        return tqdm_auto(iterable, desc="training", leave=True, mininterval=0.5)
    except Exception:   # e.g. "IProgress not found" with a mismatched ipywidgets
        return tqdm_text(iterable, desc="training", leave=True, mininterval=0.5)
