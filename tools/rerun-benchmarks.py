"""Re-run saved benchmarks on a GPU and compare them with the results in gpulab/results.

usage: python tools/rerun-benchmarks.py OUTDIR [SPEC ...] [--memory]

For each spec (default: those of notebooks 00-03) it runs ``gpulab bench`` in-process,
writes OUTDIR/SPEC.json (the same format as gpulab/results/SPEC.json, so a result worth
keeping can be copied there) and OUTDIR/compare.json: per case and implementation the
saved and new median and their ratio (new / saved; > 1 is slower). ``--memory`` also
measures the activation memory of RMSNorm + fake quantization into
OUTDIR/memory_rmsnorm_fakequant.json. Nothing in the repository is written.
"""
import json
import sys
from pathlib import Path

import gpulab
from gpulab.grading import normquant as normquant_grading
from gpulab.harness import bench

DEFAULT = ["vector_add", "softmax", "ternary_gemv", "ternary_mm", "ternary_matmul", "rmsnorm_quant",
           "rmsnorm_quant_bwd", "mlgru_scan_recurrent", "mlgru_scan_chunked", "mlgru_scan_backward_recurrent",
           "mlgru_scan_backward_chunked", "mlgru_scan", "mlgru_scan_train"]


def compare(saved: dict | None, new: dict) -> list[dict]:
    old = {(r["case"], r["dtype"], r["impl"]): r["ms"] for r in (saved or {}).get("rows", []) if "ms" in r}
    rows = []
    for r in new["rows"]:
        key = (r["case"], r["dtype"], r["impl"])
        row = {"case": r["case"], "dtype": r["dtype"], "impl": r["impl"], "new_ms": r.get("ms"),
               "saved_ms": old.get(key), "error": r.get("error")}
        if row["new_ms"] and row["saved_ms"]:
            row["new_over_saved"] = row["new_ms"] / row["saved_ms"]
        rows.append(row)
    return rows


def main(argv) -> int:
    if not argv:
        print(__doc__)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    names = [a for a in argv[1:] if not a.startswith("--")] or DEFAULT
    print(gpulab.env_report(), flush=True)
    report = {}
    for name in names:
        result = bench.run(name)
        (out / f"{name}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
        report[name] = compare(bench.load(name), result)
        print(bench.format_table(result), flush=True)
        for r in report[name]:
            if "new_over_saved" in r:
                print(f"  {r['case']:18} {r['impl']:32} new/saved {r['new_over_saved']:.2f}")
    (out / "compare.json").write_text(json.dumps(report, indent=1) + "\n")
    if "--memory" in argv:
        result = normquant_grading.activation_memory()
        (out / "memory_rmsnorm_fakequant.json").write_text(json.dumps(result, indent=1) + "\n")
        print(gpulab.harness.memory.format_memory(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
