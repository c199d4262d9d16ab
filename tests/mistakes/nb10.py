"""Notebook 10: the ring all-reduce, the GLU's tensor-parallel shards and the row-parallel
matmul. The checks run gloo processes (forked for the ring, tiny TP sizes): a mistake
caught at 2 ranks costs about 0.1 s (ring) or 0.3 s (TP); a deadlock would cost the
check's timeout, so the catalogue leaves swapped neighbours to tests/test_parallel.py."""
import torch
import torch.distributed as dist

from gpulab.grading import parallel as _parallel_checks  # noqa: F401  (registers the checks)
from gpulab.parallel import tensor_parallel as tp

from . import Mistake


def _ring(mistake=""):
    """The notebook's solution cell with one mistake."""
    def ring_all_reduce(tensor):
        n, r = dist.get_world_size(), dist.get_rank()
        if n == 1:
            return tensor
        flat = (tensor.clone() if mistake == "works on a copy" else tensor).view(-1)
        base, extra = divmod(flat.numel(), n)
        if mistake == "floor chunks":
            starts = [c * base for c in range(n + 1)]
        else:
            starts = [c * base + min(c, extra) for c in range(n + 1)]
        nxt, prv = (r + 1) % n, (r - 1) % n

        def step(send_chunk, recv_chunk, add):
            a, b = starts[send_chunk], starts[send_chunk + 1]
            c, d = starts[recv_chunk], starts[recv_chunk + 1]
            buf = torch.empty_like(flat[c:d])
            req = dist.isend(flat[a:b].clone(), nxt) if b > a else None
            if d > c:
                dist.recv(buf, prv)
                if add:
                    flat[c:d].add_(buf)
                else:
                    flat[c:d].copy_(buf)
            if req is not None:
                req.wait()

        for s in range(n - 2 if mistake == "one step short" else n - 1):
            step((r - s) % n, (r - s - 1) % n, add=True)
        if mistake != "no all-gather":
            for s in range(n - 1):
                if mistake == "all-gather from own chunk":
                    step((r - s) % n, (r - s - 1) % n, add=False)
                else:
                    step((r + 1 - s) % n, (r - s) % n, add=mistake == "all-gather adds")
        if mistake == "average":
            flat /= n
        return flat.view_as(tensor) if mistake == "works on a copy" else tensor
    return ring_all_reduce


def _shard(mistake=""):
    def shard_glu(w_gate_up, w_down, rank, world_size):
        hidden = w_down.shape[1]
        share = hidden // world_size
        a, b = rank * share, (rank + 1) * share
        if mistake == "split on the input dim":
            d = w_gate_up.shape[1] // world_size
            return w_gate_up[:, rank * d:(rank + 1) * d], w_down[:, a:b]
        if mistake == "gate_up cut as one block":
            return w_gate_up[2 * a:2 * b], w_down[:, a:b]
        if mistake == "w_down rows":
            d = w_down.shape[0] // world_size
            return torch.cat([w_gate_up[a:b], w_gate_up[hidden + a:hidden + b]]), w_down[rank * d:(rank + 1) * d]
        if mistake == "up half at the next rank's slice":
            q = (rank + 1) % world_size
            return torch.cat([w_gate_up[a:b], w_gate_up[hidden + q * share:hidden + (q + 1) * share]]), w_down[:, a:b]
        if mistake == "w_down columns of the next rank":
            q = (rank + 1) % world_size
            return torch.cat([w_gate_up[a:b], w_gate_up[hidden + a:hidden + b]]), w_down[:, q * share:(q + 1) * share]
        if mistake == "up rows first":
            return torch.cat([w_gate_up[hidden + a:hidden + b], w_gate_up[a:b]]), w_down[:, a:b]
        return torch.cat([w_gate_up[a:b], w_gate_up[hidden + a:hidden + b]]), w_down[:, a:b]
    return shard_glu


def _matmul(mistake=""):
    def row_parallel_matmul(x_q, x_scale, w_packed, w_scale, out_dtype=torch.float32, group=None):
        acc = tp.ternary_partial_sums(x_q, w_packed)
        if mistake == "scaled before the sum":
            y = tp.scale_partial_sums(acc, x_scale, w_scale, out_dtype)
            dist.all_reduce(y, group=group)
            return y
        if mistake != "no all-reduce":
            dist.all_reduce(acc, group=group)
        if mistake == "no scale":
            return acc.to(out_dtype)
        if mistake == "int32 returned":
            return acc
        y = tp.scale_partial_sums(acc, x_scale, w_scale, out_dtype)
        if mistake == "divided by the world size":
            y = y / dist.get_world_size(group)
        return y
    return row_parallel_matmul


def _r(name, mistake, expect):
    return Mistake("10/check-ring-all-reduce", "ring-all-reduce", name, _ring(mistake), expect)


def _s(name, mistake, expect):
    return Mistake("10/check-glu-shards", "glu-shards", name, _shard(mistake), expect)


def _m(name, mistake, expect):
    return Mistake("10/check-row-parallel-matmul", "row-parallel-matmul", name, _matmul(mistake), expect)


MISTAKES = [
    _r("chunks by floor division (remainder dropped)", "floor chunks", ("chunks miss the remainder",)),
    _r("no all-gather phase", "no all-gather", ("the all-gather phase is missing",)),
    _r("reduce-scatter one step short", "one step short", ("missing some ranks' contributions",)),
    _r("all-gather adds instead of copying", "all-gather adds", ("a chunk is added twice",)),
    _r("all-gather starts from the rank's own chunk", "all-gather from own chunk", ("(r + 1) mod n",)),
    _r("sum written into a copy", "works on a copy", ("leaves `tensor` unchanged",)),
    _r("divides by the world size (average)", "average", ("that is the average",)),
    _s("w_gate_up split on its input dim", "split on the input dim", ("dim 0",)),
    _s("[gate; up] cut as one block", "gate_up cut as one block", ("cut as one block",)),
    _s("w_down split by rows", "w_down rows", ("take columns",)),
    _s("up rows of another rank's units", "up half at the next rank's slice", ("same slice [a, b) of both",)),
    _s("w_down columns of another rank's units", "w_down columns of the next rank", ("w_down columns are units",)),
    _s("up rows before gate rows", "up rows first", ("gate first",)),
    _m("no all-reduce", "no all-reduce", ("the all-reduce is missing",)),
    _m("scaled to floats before the all-reduce", "scaled before the sum", ("all-reduce the *int32* partial sums",)),
    _m("partial sums never scaled", "no scale", ("never scaled",)),
    _m("int32 sums returned", "int32 returned", ("in out_dtype",)),
    _m("divided by the world size", "divided by the world size", ("averages (ReduceOp.AVG, or a division",)),
]
