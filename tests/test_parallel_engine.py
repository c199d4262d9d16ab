"""The serving engine's model at TP=2 and TP=3 on gloo CPU processes: the unchanged
engine serves it with rank-local KV caches, and every rank's greedy tokens (and logits,
bit for bit) equal the unsharded model's at TP=1."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gpulab.bitlinear import unpack_ternary
from gpulab.engine.model import TINY, ModelConfig, TernaryTransformer
from gpulab.parallel import launch
from gpulab.parallel.tensor_parallel_model import (TensorParallelTransformer, engine_model, prompt_logits,
                                                   require_tp_model, tp_engine_rank)

TORCH_PATHS = {"linear": "torch", "attention": "torch", "num_blocks": 24, "block_size": 8}
SIX_HEADS = ModelConfig(d_model=48, n_layers=2, n_heads=12, n_kv_heads=6, head_dim=8, hidden=96,
                        max_seq_len=128)      # splits over 2, 3 and 6 ranks; GQA groups of 2
PROMPTS = ("Tyger Tyger, burning bright", "a", "Shall I compare thee to a summer's day?")


def check_served(res, n, cfg):
    want = res[0]["tp1"]["tokens"]
    assert all(len(t) == 6 for t in want)
    for r in res:
        assert r["world_size"] == n
        assert r["tp1"]["tokens"] == want, "TP=1 differs between ranks"
        assert r["tp"]["tokens"] == want, f"rank {r['rank']}: TP={n} tokens differ from TP=1"
        for run in (r["tp"], r["tp1"]):
            assert run["idle"] and run["pages_free"] == run["pages_total"], "pages left over"
            assert run["decode_steps"] >= 5 and run["per_token_ms_p50"] > 0
        # the unchanged runner allocated a cache of this rank's KV heads only
        assert r["tp"]["kv_cache_shape"][3] == cfg.n_kv_heads // n
        assert r["tp1"]["kv_cache_shape"][3] == cfg.n_kv_heads


@pytest.mark.parametrize("cfg,n", [(TINY, 2), (SIX_HEADS, 3)], ids=["tiny-tp2", "six-heads-tp3"])
def test_engine_at_tp_n_serves_the_tokens_of_tp1_and_frees_every_page(cfg, n):
    # on a GPU machine the ranks use the GPU: spawned, not forked
    # spawned ranks import torch and gpulab: on a loaded GPU host (the compiled suite's 16
    # workers) that alone took over a minute, so the bound is a hang guard, not a timing
    res = launch.run_ranks(tp_engine_rank, n, PROMPTS, 6, cfg, 3, torch.float32, TORCH_PATHS, backend="gloo",
                           start_method=launch.kernel_start_method(), timeout_s=300)
    check_served(res, n, cfg)


def test_engine_at_tp2_on_gpulabs_kernels_matches_tp1():
    """linear="triton": the BitLinear kernels (interpreted here), as on a GPU."""
    engine = dict(TORCH_PATHS, linear="triton")
    res = launch.run_ranks(tp_engine_rank, 2, ("Tyger",), 2, TINY, 3, torch.float32, engine, warmup=False,
                           backend="gloo", start_method=launch.kernel_start_method())
    assert res[0]["tp"]["tokens"] == res[1]["tp"]["tokens"] == res[0]["tp1"]["tokens"]
    assert res[0]["tp"]["idle"] and res[1]["tp"]["idle"]


def _logits_tp_and_tp1(cfg, text):
    model = engine_model(cfg, seed=5, device="cpu", dtype=torch.float32)
    return prompt_logits(TensorParallelTransformer(model), text), prompt_logits(model, text)


@pytest.mark.parametrize("n", [1, 2])
def test_tp_logits_are_bit_identical_to_tp1_on_every_rank(n):
    res = launch.run_ranks(_logits_tp_and_tp1, n, TINY, "Tyger Tyger, burning bright", backend="gloo")
    for tp, tp1 in res:
        assert tp.shape == tp1.shape and torch.equal(tp, tp1)


def test_each_rank_holds_whole_heads_of_q_k_v_in_gqa_order():
    model = engine_model(SIX_HEADS, seed=1, device="cpu", dtype=torch.float32)
    c, d = SIX_HEADS, SIX_HEADS.d_model
    full = unpack_ternary(model.blocks[0].qkv_proj.w_packed, d)
    q_rows, kv_rows = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    for rank in range(3):
        tp = TensorParallelTransformer(model, rank=rank, world_size=3)
        assert (tp.cfg.n_heads, tp.cfg.n_kv_heads, tp.cfg.hidden) == (4, 2, 32) and tp.full_cfg == SIX_HEADS
        local = unpack_ternary(tp.blocks[0].qkv_proj.w_packed, d)
        qs, ks = 4 * c.head_dim, 2 * c.head_dim
        want = torch.cat([full[rank * qs:(rank + 1) * qs],                              # query heads 4r..4r+3
                          full[q_rows + rank * ks:q_rows + (rank + 1) * ks],            # KV heads 2r, 2r+1
                          full[q_rows + kv_rows + rank * ks:q_rows + kv_rows + (rank + 1) * ks]])
        assert torch.equal(local, want)
        assert tp.blocks[0].o_proj.k_range == (rank * 32, (rank + 1) * 32)


def test_tp_model_rejects_what_cannot_be_split():
    packed = engine_model(TINY, device="cpu", dtype=torch.float32)
    cases = [
        (lambda: TensorParallelTransformer(TernaryTransformer(TINY), rank=0, world_size=2), ValueError,
         "pack the model first"),
        (lambda: TensorParallelTransformer(packed, rank=0, world_size=3), ValueError,
         "n_heads=4 query heads cannot be split over 3 ranks"),
        (lambda: TensorParallelTransformer(packed, rank=0, world_size=4), ValueError,
         "n_kv_heads=2 KV heads cannot be split over 4 ranks"),
        (lambda: require_tp_model(engine_model(ModelConfig(d_model=32, n_layers=1, n_heads=2, n_kv_heads=2,
                                                           head_dim=8, hidden=33), device="cpu"), 2),
         ValueError, "hidden size 33 cannot be split over 2 ranks"),
        (lambda: TensorParallelTransformer(packed, rank=2, world_size=2), ValueError,
         r"rank must be an int in \[0, 2\)"),
        (lambda: TensorParallelTransformer(packed, rank=0, world_size=0), ValueError, "positive int"),
        (lambda: TensorParallelTransformer(torch.nn.Linear(2, 2), rank=0, world_size=2), TypeError,
         "TernaryTransformer"),
    ]
    for build, exc, match in cases:
        with pytest.raises(exc, match=match):
            build()
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="no process group"):
        TensorParallelTransformer(packed)


def test_the_two_gpu_bench_rehearses_on_gloo(tmp_path):
    """tools/tp-engine-bench.py --dry-run-gloo: the GPU script's code paths on CPU ranks."""
    path = Path(__file__).resolve().parent.parent / "tools" / "tp-engine-bench.py"
    spec = importlib.util.spec_from_file_location("tp_engine_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main([str(tmp_path), "--dry-run-gloo"]) == 0
    rows = json.loads((tmp_path / "tp_engine.json").read_text())["rows"]
    assert len(rows) == 2 and all(r["ok"] and r["tokens_identical_to_tp1"] and r["pages_freed"] for r in rows)
    summary = json.loads((tmp_path / "tp_engine_summary.json").read_text())
    assert summary["targets"]["tp_tokens_identical_to_tp1"]["ok"]
