set -x
source tools/gpu-env.sh
mkdir -p /tmp/r
TN=8 TT=210 NBS= timeout 260 tools/gpu-suite.sh /tmp/r/suite tests/test_bitlinear.py tests/test_model.py \
  "tests/test_engine.py::test_greedy_matches_reference_under_any_schedule" \
  "tests/test_engine.py::test_triton_bitlinear_kernels_in_the_engine" \
  "tests/test_engine.py::test_static_batching_baseline_matches_reference" \
  "tests/test_engine.py::test_warm_up_runs_every_prefill_size_and_changes_no_output" > /tmp/r/suite.log 2>&1
cp /tmp/r/suite/tests.txt /tmp/r/tests.txt; cp /tmp/r/suite/junit.xml /tmp/r/junit.xml
timeout 60 python3 - > /tmp/r/as_called.txt 2>&1 <<'PY'
import torch, torch.nn.functional as F
from gpulab import bitlinear as bl
from gpulab.harness import bench
for m in (2, 16, 64):
    for n, k in ((8192, 8192), (14336, 4096), (4096, 4096)):
        g = torch.Generator(device="cuda").manual_seed(m)
        w = torch.randint(-1, 2, (n, k), device="cuda", generator=g, dtype=torch.int8)
        x = torch.randint(-128, 128, (m, k), device="cuda", generator=g, dtype=torch.int8)
        xs = torch.rand(m, device="cuda", generator=g) + 0.5
        ws = torch.tensor([0.7], device="cuda"); wp = bl.pack_ternary(w)
        xb = torch.randn(m, k, device="cuda", dtype=torch.bfloat16); wb = w.to(torch.bfloat16)
        for rep in range(2):
            a = bench.time_ms(lambda: bl.ternary_matmul(x, xs, wp, ws)) * 1e3
            f = bench.time_ms(lambda: F.linear(xb, wb)) * 1e3
            h = bench.host_us_per_call(lambda: bl.ternary_matmul(x, xs, wp, ws))
            print(f"M={m} N={n} K={k} rep {rep}: ternary_matmul as called {a:.2f} us, F.linear {f:.2f} us, ratio {f / a:.2f}, host {h:.1f} us/call", flush=True)
PY
tail -5 /tmp/r/tests.txt
cp /tmp/r/tests.txt /tmp/r/junit.xml /tmp/r/as_called.txt /tmp/r/suite.log $OUT/
