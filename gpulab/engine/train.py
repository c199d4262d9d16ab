"""``gpulab train``: train the engine's ternary transformer on the bundled poems and save
a packed 2-bit checkpoint.

Training runs the BitLinear layers with fake quantization and the straight-through
estimator (notebook 02's fused kernels on a GPU, their PyTorch reference on a CPU), in
float32, with :func:`gpulab.model.train`'s AdamW and warm-up + cosine schedule. The
result is packed (2 bits per ternary weight, one scale per matrix) and saved with the
embedding, head and norm weights in 16 bits.

    gpulab train                          # the shipped configuration (about 8 CPU minutes)
    gpulab train --config tiny --steps 50 # the test-sized model, seconds
"""
from __future__ import annotations

import argparse
import time

import torch

from .. import runtime
from ..model import train
from .model import (CHECKPOINT, TINY, ModelConfig, TernaryTransformer, corpus_tokens, decode_tokens,
                    encode_prompt, format_sizes, reference_generate, save_checkpoint)

CONFIGS = {"default": ModelConfig(), "tiny": TINY}


def train_model(cfg: ModelConfig = ModelConfig(), steps: int = 1500, batch_size: int = 16, seq_len: int = 128,
                lr: float = 3e-3, seed: int = 0, device=None, progress: bool = True):
    """A trained, packed :class:`TernaryTransformer` and its losses."""
    torch.manual_seed(seed)
    device = device or runtime.device()
    model = TernaryTransformer(cfg).to(device)
    losses = train(model, corpus_tokens().to(device), steps=steps, batch_size=batch_size, seq_len=seq_len,
                   lr=lr, seed=seed, progress=progress)
    return model.pack(), losses


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="gpulab train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), default="default")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(CHECKPOINT), help=f"checkpoint path (default {CHECKPOINT})")
    args = ap.parse_args(argv)
    cfg = CONFIGS[args.config]
    if args.seq_len >= cfg.max_seq_len:
        ap.error(f"--seq-len must be < the model's context {cfg.max_seq_len}")
    print(f"training {args.config} {cfg} for {args.steps} steps on {runtime.device()}")
    t0 = time.perf_counter()
    model, losses = train_model(cfg, args.steps, args.batch_size, args.seq_len, args.lr, args.seed)
    tail = losses[-50:]
    print(f"done in {time.perf_counter() - t0:.0f} s; loss {losses[0]:.3f} -> {sum(tail) / len(tail):.3f} "
          f"(mean of the last {len(tail)} steps, nats per byte)")
    print(format_sizes(model))
    model = model.cpu()
    for prompt in ("Shall I compare thee", "The "):
        out = reference_generate(model, encode_prompt(prompt), 120)
        print(f"--- {prompt!r} ->\n{prompt}{decode_tokens(out)}")
    path = save_checkpoint(model, args.out)
    print(f"saved {path} ({path.stat().st_size / 1e6:.2f} MB)")
    return 0
