"""Temporary: which change makes speculative graphs=auto differ from the target alone."""
import os, sys, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, "tools")
import torch
import speculative_bench as sb
from gpulab.engine import spec_graphs, batch_attention
from gpulab.engine.model import load_checkpoint
from gpulab.engine import speculative as spec
if os.environ.get("NOSPLIT") == "1":
    spec_graphs.plan_kv_split = lambda *a, **k: None
    batch_attention.plan_kv_split = lambda *a, **k: None
t0 = time.time()
target = load_checkpoint(device="cuda", dtype=torch.bfloat16)
draft = spec.load_mlgru_draft(device="cuda", dtype=torch.bfloat16)
try:
    sb.bench_speculation(target, {"mlgru": lambda: spec.MLGRUDrafter(draft)}, 1, 48, (2,), 1)
    print("RESULT OK", os.environ.get("NOSPLIT"), os.environ.get("GPULAB_DIRECT_LAUNCH"), time.time() - t0)
except AssertionError as e:
    print("RESULT FAIL", os.environ.get("NOSPLIT"), os.environ.get("GPULAB_DIRECT_LAUNCH"), e)
