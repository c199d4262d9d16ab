#!/usr/bin/env bash
# call 4 (2026-12-04): the Triton kernel Inductor writes for F.rms_norm on 4096 x 14336 bf16 (84% of
# the bandwidth on its own bytes in call 3, where rmsnorm_quant's one-row-per-program kernel reaches 72%)
source tools/gpu-env.sh; R=/tmp/r; mkdir -p $R/out
export TORCH_LOGS=output_code TORCH_COMPILE_DEBUG=0
timeout -k 5 120 python3 - > $R/out/inductor_rms_norm.txt 2>&1 <<'PY'
import torch, torch.nn.functional as F
from triton.testing import do_bench
for rows, cols in ((4096, 14336), (8192, 8192)):
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16); w = torch.randn(cols, device="cuda", dtype=torch.bfloat16)
    f = torch.compile(lambda x, w: F.rms_norm(x, (cols,), w, 1e-6), dynamic=False)
    f(x, w); torch.cuda.synchronize()
    print(f"TIMING {rows}x{cols}: {do_bench(lambda: f(x, w)) * 1e3:.1f} us")
PY
cp $R/out/* $OUT/
