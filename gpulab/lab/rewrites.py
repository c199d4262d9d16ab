"""Code-level rewrites: small source-to-source transformations a search can apply to a
candidate on top of its genes.

Genes move a kernel within its template; rewrites change the text itself, the way a
person (or a language model) edits a kernel: swap ``exp`` for ``exp2``, a division by a
square root for ``rsqrt``, narrow the index arithmetic, add cache hints. Each rewrite
returns the new source, or None where it does not apply.

Some rewrites are **unsafe**: they make a kernel faster by making it wrong on some
inputs (a block fixed to one row length, a store without its mask, a load without its
neutral ``other``). They are here on purpose: a search that uses them finds out
whether its verifier catches them (notebook 09). ``SAFE`` lists the others.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from ..attention_state import LOG2E


@dataclass(frozen=True)
class Rewrite:
    name: str
    what: str
    apply: Callable[[str], "str | None"]
    safe: bool = True

    def __call__(self, source: str) -> str | None:
        out = self.apply(source)
        return out if out is not None and out != source else None


def _calls(src: str, head: str):
    """(start, open paren, close paren) of each call that starts with ``head`` (e.g. 'tl.exp(')."""
    i = 0
    while True:
        i = src.find(head, i)
        if i < 0:
            return
        if i > 0 and (src[i - 1].isalnum() or src[i - 1] in "._"):
            i += len(head)
            continue
        depth, j = 0, i + len(head) - 1
        while j < len(src):
            if src[j] == "(":
                depth += 1
            elif src[j] == ")":
                depth -= 1
                if depth == 0:
                    break
            j += 1
        yield i, i + len(head) - 1, j
        i = j


def _map_calls(src: str, head: str, fn: Callable[[str], str]) -> str:
    """Replace each call ``head(args)`` by ``fn(args)``, innermost text untouched."""
    out, last = [], 0
    for start, open_, close in list(_calls(src, head)):
        if start < last:
            continue
        out.append(src[last:start])
        out.append(fn(src[open_ + 1:close]))
        last = close + 1
    out.append(src[last:])
    return "".join(out)


def _exp2(src: str) -> str | None:
    if "tl.exp(" not in src:
        return None
    return _map_calls(src, "tl.exp(", lambda a: f"tl.exp2({LOG2E} * ({a}))")


def _rsqrt(src: str) -> str | None:
    if "1.0 / tl.sqrt(" not in src:
        return None
    return _map_calls(src.replace("1.0 / tl.sqrt(", "tl.sqrt("), "tl.sqrt(", lambda a: f"tl.rsqrt({a})")


def _add_kwarg(head: str, kwarg: str, unless: str) -> Callable[[str], "str | None"]:
    def apply(src: str) -> str | None:
        if head not in src:
            return None
        return _map_calls(src, head, lambda a: f"{head}{a}, {kwarg})" if unless not in a else f"{head}{a})")
    return apply


_STREAMED = re.compile(r"\b(offs|rows|rows64)\b")   # addresses that move with the row


def _streamed(head: str, kwarg: str, unless: str) -> Callable[[str], "str | None"]:
    """Add ``kwarg`` to the calls ``head(...)`` whose address depends on the row (data
    read or written once); loads of a weight or bias row that every program reuses are
    left alone, so they stay in L2."""
    def apply(src: str) -> str | None:
        def edit(args: str) -> str:
            address = args.split(",", 1)[0]
            if unless in args or not _STREAMED.search(address):
                return f"{head}{args})"
            return f"{head}{args}, {kwarg})"
        return _map_calls(src, head, edit) if head in src else None
    return apply


def _int32_offsets(src: str) -> str | None:
    return src.replace(".to(tl.int64)", "") if ".to(tl.int64)" in src else None


def _fixed_block(src: str) -> str | None:
    pattern = re.compile(r"triton\.next_power_of_2\(n_cols\)")
    return pattern.sub("256", src) if pattern.search(src) else None


_ROUND_HALF_AWAY = re.compile(
    r"(?P<q>\w+) = tl\.where\((?P<v>\w+) >= 0, tl\.floor\((?P=v) \+ 0\.5\), tl\.ceil\((?P=v) - 0\.5\)\)\n"
    r"(?P<indent>[ \t]*)(?P=q) = tl\.minimum\(tl\.maximum\((?P=q), -128\.0\), 127\.0\)")


def _round_once(src: str) -> str | None:
    # floor(v + 0.5) for v >= 0 is the truncation of |v| + 0.5: one float-to-int conversion
    # instead of floor, ceil and a conversion of each (the quantizer's rounding; the
    # package's rmsnorm_quant does the same, see gpulab.normquant)
    def repl(m):
        q, v, ind = m["q"], m["v"], m["indent"]
        return (f"{q} = (tl.abs({v}) + 0.5).to(tl.int32)\n"
                f"{ind}{q} = tl.minimum(tl.maximum(tl.where({v} < 0, -{q}, {q}), -128), 127)")
    out, n = _ROUND_HALF_AWAY.subn(repl, src)
    return out if n else None


_NORM_THEN_ABSMAX = re.compile(
    r"(?P<ind>[ \t]*)rstd = (?P<inv>1\.0 / tl\.sqrt|tl\.rsqrt)"
    r"\(tl\.sum\((?P<x>\w+) \* (?P=x), axis=1\) / n_cols \+ eps\)\n"
    r"(?P=ind)(?P<y>\w+) = (?P=x) \* rstd\[:, None\] \* (?P<w>\w+)\[None, :\]\n"
    r"(?P=ind)scale = 127\.0 / tl\.maximum\(tl\.max\(tl\.abs\((?P=y)\), axis=1\), 1e-5\)\n"
    r"(?P=ind)(?P<v>\w+) = (?P=y) \* scale\[:, None\]")


def _absmax_beside_norm(src: str) -> str | None:
    # max|x·rstd·w| = rstd·max|x·w|: the absmax need not wait for the norm, so the two
    # reductions are independent (one_reduction then fuses them, as the package's
    # rmsnorm_quant does when compiled)
    def repl(m):
        ind, x, w, v = m["ind"], m["x"], m["w"], m["v"]
        return (f"{ind}xw = {x} * {w}[None, :]\n"
                f"{ind}sum_sq, max_xw = tl.sum({x} * {x}, axis=1), tl.max(tl.abs(xw), axis=1)\n"
                f"{ind}rstd = {m['inv']}(sum_sq / n_cols + eps)\n"
                f"{ind}scale = 127.0 / tl.maximum(max_xw * rstd, 1e-5)\n"
                f"{ind}{v} = xw * (rstd * scale)[:, None]")
    out, n = _NORM_THEN_ABSMAX.subn(repl, src)
    return out if n else None


_SIDE_BY_SIDE = re.compile(
    r"(?P<ind>[ \t]*)(?P<a>\w+), (?P<b>\w+) = tl\.sum\((?P<s>[^()]+), axis=1\), "
    r"tl\.max\((?P<m>tl\.abs\(\w+\)), axis=1\)\n")

# put before the kernels: a reduction with a combine function of its own runs element by
# element in Triton's interpreter (minutes for one big row), so there tl.sum and tl.max stay
_COMBINE = """# compiled, one reduction carries both sums; the interpreter would run it element by element
ONE_REDUCTION = tl.constexpr(not runtime.interpreting())


@triton.jit
def sum_and_max(s0, m0, s1, m1):
    return s0 + s1, tl.maximum(m0, m1)


"""


def _one_reduction(src: str) -> str | None:
    # a sum and a max over the same rows, side by side: one tl.reduce carries both (two
    # values per step), one pass and one set of barriers instead of two
    m = _SIDE_BY_SIDE.search(src)
    if not m or "from gpulab import runtime" not in src or "@triton.jit" not in src:
        return None
    ind, a, b = m["ind"], m["a"], m["b"]
    both = (f"{ind}if ONE_REDUCTION:\n"
            f"{ind}    {a}, {b} = tl.reduce(({m['s']}, {m['m']}), 1, sum_and_max)\n"
            f"{ind}else:\n{ind}    {m.group(0)[len(ind):]}")
    src = src[:m.start()] + both + src[m.end():]
    first = src.index("@triton.jit")
    return src[:first].rstrip("\n") + "\n\n\n" + _COMBINE + src[first:]


_VECTOR_LOAD = re.compile(r"^(?P<ind>[ \t]*)(?P<v>\w+) = (?P<rhs>tl\.load\((?P<p>\w+) \+ cols\b[^\n]*)\n", re.M)
_JIT_DEF = re.compile(r"@triton\.jit\ndef (?P<f>\w+)\((?P<args>[^)]*)\):\n")
_FIRST_LOAD = re.compile(r"^(?P<ind>[ \t]*)\w+ = tl\.load\([^\n]*\n", re.M)


def _params(args: str) -> list[str]:
    """Parameter names of an argument list: 'x_ptr, w, R: tl.constexpr' -> ['x_ptr', 'w', 'R']."""
    return [a.split(":")[0].strip() for a in args.split(",")]


def _row_before_weights(src: str) -> str | None:
    # A kernel loads a vector every row reuses (the weights) and passes it to the helper
    # that loads the rows. Compiled, the vector's load and its layout change through shared
    # memory (barriers) then come before the rows' loads from HBM, which wait for them.
    # Loaded in the helper, right after the row, the row's loads go out first.
    load = _VECTOR_LOAD.search(src)
    if not load:
        return None
    v, ptr = load["v"], load["p"]
    kernel = src.rfind("@triton.jit", 0, load.start())           # the function that loads it
    helper = next((h for h in _JIT_DEF.finditer(src) if h.start() != kernel and v in _params(h["args"])
                   and {"cols", "cmask"} <= set(_params(h["args"]))), None)
    if helper is None or ptr in _params(helper["args"]):
        return None
    at = _params(helper["args"]).index(v)
    end = src.find("\n@triton.jit", helper.end())
    end = len(src) if end < 0 else end
    body = src[helper.end():end]
    row = _FIRST_LOAD.search(body)                                 # the helper's first load: the row
    if row is None:
        return None
    body = body[:row.end()] + f"{row['ind']}{v} = {load['rhs']}\n" + body[row.end():]
    args = [ptr if i == at else a.strip() for i, a in enumerate(helper["args"].split(","))]
    new_helper = f"@triton.jit\ndef {helper['f']}({', '.join(args)}):\n" + body
    out = src[:helper.start()] + new_helper + src[end:]
    # the kernel's own load goes (where it now stands), and its calls pass the pointer
    where = load.start() + (len(new_helper) - (end - helper.start()) if load.start() > helper.start() else 0)
    head, tail = out[:where], out[where + len(load.group(0)):]

    def pass_pointer(call_args: str) -> str:
        parts = call_args.split(",")
        if len(parts) > at and parts[at].strip() == v:
            parts[at] = parts[at].replace(v, ptr)
        return f"{helper['f']}(" + ",".join(parts) + ")"
    return head + _map_calls(tail, f"{helper['f']}(", pass_pointer)


def _drop_store_mask(src: str) -> str | None:
    if "tl.store(" not in src:
        return None
    return _map_calls(src, "tl.store(", lambda a: "tl.store(" + re.sub(r",\s*mask=[^,()]+$", "", a.strip()) + ")")


def _drop_load_other(src: str) -> str | None:
    if "other=" not in src:
        return None
    return _map_calls(src, "tl.load(", lambda a: "tl.load(" + re.sub(r",\s*other=.*$", "", a, flags=re.S) + ")")


REWRITES: dict[str, Rewrite] = {r.name: r for r in [
    Rewrite("exp2", "tl.exp(v) -> tl.exp2(log2(e) * v): the GPU's native base-2 exponential", _exp2),
    Rewrite("rsqrt", "1.0 / tl.sqrt(v) -> tl.rsqrt(v): one reciprocal square root", _rsqrt),
    Rewrite("evict_first", 'tl.load(...) -> tl.load(..., eviction_policy="evict_first"): streamed data '
            "leaves L2 first", _add_kwarg("tl.load(", 'eviction_policy="evict_first"', "eviction_policy")),
    Rewrite("stream_loads", 'evict_first on the loads of data read once (addresses that move with the '
            'row), none on reused rows such as a weight: those stay in L2',
            _streamed("tl.load(", 'eviction_policy="evict_first"', "eviction_policy")),
    Rewrite("stream_stores", 'cache_modifier=".cs" on the stores of data written once: streamed past the '
            'caches', _streamed("tl.store(", 'cache_modifier=".cs"', "cache_modifier")),
    Rewrite("round_once", "round half away from zero with one float-to-int conversion (|v| + 0.5, "
            "truncated, sign restored) instead of floor, ceil and a select", _round_once),
    Rewrite("absmax_beside_norm", "RMSNorm then absmax: Σx² and max|x·w| side by side (max|y| = "
            "rstd·max|x·w|) instead of the absmax waiting for the norm", _absmax_beside_norm),
    Rewrite("one_reduction", "a sum and a max over the same rows, side by side, as one reduction "
            "carrying both (tl.reduce with a two-value combine; compiled only)", _one_reduction),
    Rewrite("row_before_weights", "a vector every row reuses (the weights) loaded in the row function "
            "after the row, not before it in the kernel: the row's loads from HBM go out first",
            _row_before_weights),
    Rewrite("int32_offsets", "drop the int64 casts of offsets: cheaper index math, fine below 2^31 elements",
            _int32_offsets),
    Rewrite("fixed_block", "a block of 256 columns instead of the row length: no recompilation per width "
            "(UNSAFE: longer rows are cut short)", _fixed_block, safe=False),
    Rewrite("drop_store_mask", "stores without their mask: no predication (UNSAFE: writes past the end)",
            _drop_store_mask, safe=False),
    Rewrite("drop_load_other", "masked loads without `other=`: masked lanes read 0 (UNSAFE for max and "
            "exp of masked lanes)", _drop_load_other, safe=False),
]}
SAFE = tuple(n for n, r in REWRITES.items() if r.safe)
UNSAFE = tuple(n for n, r in REWRITES.items() if not r.safe)


def apply_all(source: str, names) -> str | None:
    """Apply rewrites in order; None if one of them does not apply."""
    for n in names:
        source = REWRITES[n](source)
        if source is None:
            return None
    return source


def applicable(source: str, names=None) -> list[str]:
    return [n for n in (names or REWRITES) if REWRITES[n](source) is not None]
