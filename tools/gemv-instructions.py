"""Static instruction counts of the ternary decode GEMVs, compiled without a GPU.

usage (repository root, any machine, no GPU needed):
    PYTHONPATH=$PWD python tools/gemv-instructions.py [--arch 90] [--json OUT.json] [--show-loop NAME] [--few-rows]

Compiles, for one GPU target (default sm_90), the byte-layout GEMV
(``bitlinear.ternary_gemv_kernel``, each of its autotune configs) and the int32x16 GEMV
(``bitlinear.ternary_gemv_x16_kernel``: the dp4a inline-PTX path and its portable twin)
with the argument types and divisibility a K = N = 8192 decode launch has (``--few-rows``:
also ``bitlinear.ternary_mm_small_kernel``, the 2-64-row matmul, at its M = 16 tile), takes the SASS
(``cuobjdump -sass`` from Triton's wheel) and the PTX, finds each kernel's main loop (the
backward branch whose body has the most LOP3: the weight unpacking), and prints per loop iteration and per weight: all instructions,
and the loads, integer logic (LOP3/SHF), multiply-adds (IMAD) and dp4a (IDP4A) in it.

"Per weight" = instructions in the loop × threads per program / weights per iteration,
i.e. warp-instructions issued per 32 weights: what bounds the GEMV once the bytes are not
the limit. These are real counts of the compiled code, not timings: label them "static
instruction counts, no GPU run".
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

# compile-only mode must be chosen before gpulab (and its @triton.jit kernels) is imported
os.environ["TRITON_INTERPRET"] = "0"
os.environ["GPULAB_COMPILE_ONLY"] = "1"
# The PTX is read below: keep every stage (tools/gpu-suite.sh stores binaries only), and
# compile afresh, as a cached binary-only entry would have none.
os.environ["TRITON_STORE_BINARY_ONLY"] = "0"
os.environ["TRITON_ALWAYS_COMPILE"] = "1"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from gpulab import bitlinear as bl  # noqa: E402
from gpulab import runtime  # noqa: E402

DECODE = {"n": 8192, "k": 8192}     # the shape whose launch the signatures mimic


def _compile(kernel, signature, constexprs, options, arch, divisible):
    attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in divisible}
    src = ASTSource(kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def _sass(cubin: bytes) -> str:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")


def sass_instructions(sass: str) -> list[tuple[int, str, str]]:
    """(address, opcode with modifiers, operands) of every SASS instruction."""
    out = []
    for line in sass.splitlines():
        m = _SASS_LINE.search(line)
        if m:
            out.append((int(m.group(1), 16), m.group(3), m.group(4)))
    return out


def _lop3_count(body) -> int:
    return sum(op.startswith("LOP3") for _, op, _ in body)


def main_loop(instrs):
    """The instructions of the main loop: of the loops (a backward branch's target up to the
    branch), the one that unpacks weights, i.e. has the most LOP3 (then the longest). The
    int32x16 kernel's second loop, Σx over x alone, has none."""
    best = None
    for i, (addr, op, operands) in enumerate(instrs):
        if op.startswith("BRA"):
            t = re.search(r"0x([0-9a-f]+)", operands)
            if t and int(t.group(1), 16) <= addr:
                start = int(t.group(1), 16)
                body = [x for x in instrs[:i + 1] if x[0] >= start]
                if best is None or (_lop3_count(body), len(body)) > (_lop3_count(best), len(best)):
                    best = body
    return best or []


def _category(op: str) -> str:
    base = op.split(".")[0]
    if base in ("LDG", "LDGSTS", "LDS", "LD", "LDSM", "LDC", "ULDC"):
        return "loads"
    if base in ("LOP3", "SHF", "LOP", "SHL", "SHR", "PRMT", "BFE", "SGXT"):
        return "logic/shift"
    if base in ("IMAD", "IMADX", "IADD3", "IMUL", "IADD", "IMNMX", "IABS", "VIADD"):
        return "imad/iadd"
    if base in ("IDP", "IDP4A", "IDP2A"):
        return "dp4a"
    return "other"


def ptx_loop_count(ptx: str) -> int:
    """PTX instructions between the label of the longest backward branch and the branch."""
    lines = [ln.split("//")[0].strip() for ln in ptx.splitlines()]
    labels = {}
    for i, ln in enumerate(lines):
        lab = re.match(r"^(\$?[\w$]+):$", ln)
        if lab:
            labels[lab.group(1)] = i
    best = 0
    for i, ln in enumerate(lines):
        m = re.match(r"^(@!?%p\d+\s+)?bra(\.uni)?\s+([\w$]+);", ln)
        if m and m.group(3) in labels and labels[m.group(3)] < i:
            body = [x for x in lines[labels[m.group(3)] + 1:i + 1]
                    if x and not x.endswith(":") and not x.startswith((".", "{", "}"))]
            best = max(best, len(body))
    return best


def _old_variants():
    out = []
    for cfg in bl._gemv_configs():       # every autotune config: which one wins is measured on the GPU
        kw = cfg.kwargs
        out.append(dict(
            name=f"uint8x4 BLOCK_N={kw['BLOCK_N']} BLOCK_Q={kw['BLOCK_Q']} w{cfg.num_warps} s{cfg.num_stages}",
            kernel=bl.ternary_gemv_kernel,
            signature={"x_ptr": "*i8", "xs_ptr": "*fp32", "w_ptr": "*u8", "ws_ptr": "*fp32", "y_ptr": "*bf16",
                       "N": "i32", "K": "i32", "Q": "i32", "stride_xm": "i32", "stride_wn": "i32",
                       "stride_ym": "i32", "BLOCK_N": "constexpr", "BLOCK_Q": "constexpr"},
            constexprs=dict(kw),
            options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages},
            divisible=("x_ptr", "xs_ptr", "w_ptr", "ws_ptr", "y_ptr", "N", "K", "Q", "stride_xm",
                       "stride_wn", "stride_ym"),
            weights_per_iter=kw["BLOCK_N"] * kw["BLOCK_Q"] * 4, threads=32 * cfg.num_warps))
    return out


X16_SWEEP = [bl.X16_CONFIG] + [c for c in ({"BLOCK_N": 16, "BLOCK_G": 64, "num_warps": 4},
            {"BLOCK_N": 32, "BLOCK_G": 32, "num_warps": 4}, {"BLOCK_N": 8, "BLOCK_G": 128, "num_warps": 4},
            {"BLOCK_N": 32, "BLOCK_G": 64, "num_warps": 4}, {"BLOCK_N": 64, "BLOCK_G": 64, "num_warps": 4},
            {"BLOCK_N": 32, "BLOCK_G": 64, "num_warps": 8}) if c != bl.X16_CONFIG]   # the default first, once


def _new_variants(configs=None):
    out = []
    for cfg in configs or X16_SWEEP:
        for asm in (True, False):
            out.append(dict(
                name=(f"int32x16 {'dp4a' if asm else 'portable'} BLOCK_N={cfg['BLOCK_N']} "
                      f"BLOCK_G={cfg['BLOCK_G']} w{cfg['num_warps']}"),
                kernel=bl.ternary_gemv_x16_kernel,
                signature={"x_ptr": "*i32", "xs_ptr": "*fp32", "w_ptr": "*i32", "ws_ptr": "*fp32",
                           "y_ptr": "*bf16", "part_ptr": "*bf16", "M": "i32", "N": "i32", "G": "i32",
                           "XW": "i32", "G_SPLIT": "i32", "stride_xm": "i32", "stride_wn": "i32",
                           "stride_ym": "i32", "BLOCK_N": "constexpr", "BLOCK_G": "constexpr",
                           "EVEN": "constexpr", "PARTIAL": "constexpr", "USE_ASM": "constexpr"},
                constexprs={"BLOCK_N": cfg["BLOCK_N"], "BLOCK_G": cfg["BLOCK_G"], "EVEN": True, "PARTIAL": False,
                            "USE_ASM": asm},
                options={"num_warps": cfg["num_warps"]},
                divisible=("x_ptr", "xs_ptr", "w_ptr", "ws_ptr", "y_ptr", "part_ptr", "N", "G", "XW",
                           "G_SPLIT", "stride_xm", "stride_wn", "stride_ym"),
                weights_per_iter=cfg["BLOCK_N"] * cfg["BLOCK_G"] * 16, threads=32 * cfg["num_warps"]))
    return out


def _small_variants():
    """The few-rows kernel (``bitlinear.ternary_mm_small_kernel``) at M = 16, K = N = 8192,
    with the tile ``small_mm_config`` picks there on an H200, inline PTX and portable twin."""
    cfg = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_Q": 256, "num_warps": 4, "num_stages": 4}
    return [dict(
        name=f"few rows {'PTX' if asm else 'portable'} 16x{cfg['BLOCK_N']}x{cfg['BLOCK_Q']} w4 s4",
        kernel=bl.ternary_mm_small_kernel,
        signature={"x_ptr": "*i8", "xs_ptr": "*fp32", "w_ptr": "*u8", "ws_ptr": "*fp32", "y_ptr": "*bf16",
                   "part_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "Q": "i32", "Q_SPLIT": "i32",
                   "stride_xm": "i32", "stride_wn": "i32",
                   "stride_ym": "i32", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_Q": "constexpr",
                   "USE_ASM": "constexpr", "DOT_INT8": "constexpr", "PARTIAL": "constexpr"},
        constexprs={"BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"], "BLOCK_Q": cfg["BLOCK_Q"],
                    "USE_ASM": asm, "DOT_INT8": True, "PARTIAL": False},
        options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]},
        divisible=("x_ptr", "xs_ptr", "w_ptr", "ws_ptr", "y_ptr", "part_ptr", "N", "K", "Q", "Q_SPLIT",
                   "stride_xm", "stride_wn", "stride_ym"),
        weights_per_iter=cfg["BLOCK_N"] * cfg["BLOCK_Q"] * 4, threads=32 * cfg["num_warps"])
        for asm in (True, False)]


def measure(variant, arch=90):
    """Compile one variant for sm_<arch>; its main loop's counts, in total and per weight."""
    c = _compile(variant["kernel"], variant["signature"], variant["constexprs"], variant["options"],
                 arch, variant["divisible"])
    sass = _sass(c.asm["cubin"])
    loop = main_loop(sass_instructions(sass))
    cats = Counter(_category(op) for _, op, _ in loop)
    ops = Counter(op.split(".")[0] for _, op, _ in loop)
    per = variant["threads"] / variant["weights_per_iter"]
    return {
        "kernel": variant["name"], "arch": f"sm_{arch}",
        "weights_per_iteration": variant["weights_per_iter"], "threads": variant["threads"],
        "sass_loop_instructions": len(loop),
        "sass_per_weight": round(len(loop) * per, 4),
        "per_weight": {k: round(v * per, 4) for k, v in sorted(cats.items())},
        "loop_opcodes": dict(ops.most_common()),
        "ptx_loop_instructions": ptx_loop_count(c.asm["ptx"]),
        "ptx_per_weight": round(ptx_loop_count(c.asm["ptx"]) * per, 4),
        "registers": getattr(c.metadata, "num_regs", None) or getattr(c, "n_regs", None),
        "_sass_loop": "\n".join(f"{a:05x} {op} {ops_};" for a, op, ops_ in loop),
    }


def table(rows) -> str:
    head = (f"{'kernel':<44} {'SASS/iter':>9} {'SASS/w':>7} {'PTX/w':>6} {'loads/w':>7} "
            f"{'lop/shf/w':>9} {'imad/w':>7} {'dp4a/w':>7} {'other/w':>7}")
    out = [head, "-" * len(head)]
    for r in rows:
        p = r["per_weight"]
        out.append(f"{r['kernel']:<44} {r['sass_loop_instructions']:>9} {r['sass_per_weight']:>7.3f} "
                   f"{r['ptx_per_weight']:>6.3f} {p.get('loads', 0):>7.3f} {p.get('logic/shift', 0):>9.3f} "
                   f"{p.get('imad/iadd', 0):>7.3f} {p.get('dp4a', 0):>7.3f} {p.get('other', 0):>7.3f}")
    return "\n".join(out)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="GPU target, e.g. 75, 80, 90 (default 90)")
    ap.add_argument("--json", type=Path, default=None, help="write the rows as JSON here")
    ap.add_argument("--show-loop", default=None, help="print the SASS main loop of kernels whose name contains this")
    ap.add_argument("--quick", action="store_true", help="one config per kernel (the defaults)")
    ap.add_argument("--few-rows", action="store_true",
                    help="also the few-rows ternary matmul (M = 16 tile; sm_80+: it needs int8 dots)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    variants = _old_variants() + _new_variants()
    if args.quick:
        variants = _old_variants()[:1] + _new_variants([bl.X16_CONFIG])
    if args.few_rows:
        variants += _small_variants()
    rows = [measure(v, args.arch) for v in variants]
    print(f"static instruction counts, no GPU run: triton {triton.__version__}, sm_{args.arch}, "
          f"main loop of each GEMV, signatures of a K=N={DECODE['k']} decode launch")
    print(table(rows))
    if args.show_loop:
        for r in rows:
            if args.show_loop in r["kernel"]:
                print(f"\n== {r['kernel']}\n{r['_sass_loop']}")
    if args.json:
        doc = {"kernel": "ternary_gemv (uint8x4) vs ternary_gemv_x16 (int32x16)",
               "what": "static instruction counts, no GPU run",
               "date": datetime.date.today().isoformat(), "target": f"sm_{args.arch}",
               "versions": runtime.versions(),
               "method": ("triton.compile for the target without a GPU; SASS from cuobjdump -sass; "
                          "main loop = the backward branch with the most LOP3 (PTX: the longest); per weight = loop instructions x "
                          "threads per program / weights per loop iteration"),
               "rows": [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
