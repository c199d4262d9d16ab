r"""All-reduce written on point-to-point sends and receives (notebook 10).

All-reduce: every rank r holds a tensor x_r; afterwards every rank holds Σ_r x_r.

**Ring all-reduce** = reduce-scatter, then all-gather, around the ring
r -> r+1 (mod n). Cut the flat tensor into n chunks C_0..C_{n-1} (sizes differ by at
most one element when n does not divide the size: :func:`chunk_bounds`).

* reduce-scatter, steps s = 0..n-2: rank r sends its chunk (r - s) mod n to r+1 and
  receives chunk (r - s - 1) mod n from r-1, which it adds to its own copy. Each chunk
  travels n-1 hops picking up one rank's contribution per hop, so after n-1 steps rank
  r holds the complete sum of chunk (r + 1) mod n.
* all-gather, steps s = 0..n-2: rank r sends chunk (r + 1 - s) mod n (complete) to r+1
  and receives chunk (r - s) mod n from r-1 straight into place.

Each rank sends 2(n-1)/n of the tensor in total, whatever n: the ring is bandwidth-
optimal, which is why bus bandwidth (:mod:`.bandwidth`) multiplies by 2(n-1)/n. It
costs 2(n-1) message latencies, so small messages prefer the **one-shot** all-reduce:
every rank sends its whole tensor to every other rank at once and adds the n tensors
locally (one latency, n-1 times the bytes).

Both leave *bit-identical* results on every rank: the ring computes each chunk's sum on
one rank and copies it, the one-shot adds the n tensors in rank order everywhere.

GPU speed (:func:`ring_all_reduce` with ``pieces``): each step's chunk is cut into
pieces posted together, so the transfer of piece p+1 overlaps the addition of piece p,
and the all-gather of a piece starts as soon as its reduction is done. Sends and
receives of one step go through :func:`torch.distributed.batch_isend_irecv` (one NCCL
group): with two ranks the left and right neighbour are the same GPU, and separate
NCCL send and receive calls to one peer can wait on each other forever.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..validate import require_tensor

PIECE_BYTES = 32 << 20      # pipeline piece on the GPU: big enough to hide ~50 µs of Python
MAX_PIECES = 16


def chunk_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """[start, stop) of each of ``world_size`` chunks covering ``numel`` elements; the first
    ``numel % world_size`` chunks are one element longer (empty chunks when numel < n)."""
    if numel < 0 or world_size < 1:
        raise ValueError(f"need numel >= 0 and world_size >= 1, got {numel}, {world_size}")
    base, extra = divmod(numel, world_size)
    bounds, start = [], 0
    for i in range(world_size):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def all_reduce_reference(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Σ of the ranks' tensors in float64 (what every rank should end up with)."""
    out = torch.zeros(tensors[0].shape, dtype=torch.float64)
    for t in tensors:
        out += t.detach().double().cpu()
    return out


def _require_reducible(tensor):
    require_tensor("tensor", tensor, any_device=True)
    if tensor.dtype == torch.bool or tensor.is_complex():
        raise TypeError(f"tensor must hold real numbers to sum (a float or integer dtype), "
                        f"got {str(tensor.dtype).replace('torch.', '')}")


def _exchange(send: torch.Tensor | None, dst: int, recv: torch.Tensor | None, src: int, group):
    """Post one send and one receive together; returns the works to wait on."""
    ops = []
    if send is not None and send.numel():
        ops.append(dist.P2POp(dist.isend, send, dst, group))
    if recv is not None and recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, src, group))
    return dist.batch_isend_irecv(ops) if ops else []


def _wait(works):
    for w in works:
        w.wait()


def _pieces(n_elems: int, element_size: int, pieces: int | None, piece_bytes: int | None, device) -> int:
    if pieces is not None:
        if not isinstance(pieces, int) or pieces < 1:
            raise ValueError(f"pieces must be a positive int, got {pieces!r}")
        return pieces
    if piece_bytes is None and device.type != "cuda":
        return 1                    # gloo: each message is a blocking copy anyway
    size = piece_bytes or PIECE_BYTES
    if size < 1:
        raise ValueError(f"piece_bytes must be >= 1, got {piece_bytes!r}")
    return max(1, min(MAX_PIECES, (n_elems * element_size) // size))


def _split(start: int, stop: int, k: int) -> list[tuple[int, int]]:
    return [(start + a, start + b) for a, b in chunk_bounds(stop - start, k)]


def ring_all_reduce(tensor: torch.Tensor, group=None, pieces: int | None = None,
                    piece_bytes: int | None = None) -> torch.Tensor:
    """Sum ``tensor`` over all ranks of ``group``, in place (like ``dist.all_reduce``), with
    a ring of sends and receives: reduce-scatter then all-gather (module docstring).

    Any number of ranks, any size (chunks differ by one element when n does not divide
    it), any float (or integer) dtype; returns ``tensor``. ``pieces`` cuts every chunk into that many
    pipelined pieces; by default chunks are cut into pieces of about ``piece_bytes`` (32 MB,
    at most 16 pieces) on a GPU, and not cut on a CPU."""
    _require_reducible(tensor)
    n = dist.get_world_size(group)
    r = dist.get_rank(group)
    if n == 1 or tensor.numel() == 0:
        return tensor
    to_global = (lambda k: dist.get_global_rank(group, k)) if group is not None else (lambda k: k)
    nxt, prv = to_global((r + 1) % n), to_global((r - 1) % n)
    flat = tensor.view(-1)
    bounds = chunk_bounds(flat.numel(), n)
    longest = bounds[0][1] - bounds[0][0]
    k = _pieces(longest, flat.element_size(), pieces, piece_bytes, flat.device)
    pieces_of = [_split(a, b, k) for a, b in bounds]          # pieces_of[chunk][p] = (start, stop)
    # two scratch buffers: step s receives into one while step s-1's pieces are added from the other
    scratch = [torch.empty(longest, dtype=flat.dtype, device=flat.device) for _ in range(2 if n > 2 else 1)]

    def rs_post(s, p):
        send_c, recv_c = (r - s) % n, (r - s - 1) % n
        a, b = pieces_of[send_c][p]
        c, d = pieces_of[recv_c][p]
        off = c - bounds[recv_c][0]
        buf = scratch[s % len(scratch)][off:off + (d - c)]
        return _exchange(flat[a:b], nxt, buf, prv, group), (c, d, buf)

    def ag_post(s, p):
        send_c, recv_c = (r + 1 - s) % n, (r - s) % n
        a, b = pieces_of[send_c][p]
        c, d = pieces_of[recv_c][p]
        return _exchange(flat[a:b], nxt, flat[c:d], prv, group)

    # reduce-scatter, pipelined over pieces; the last step hands each piece to the all-gather
    pending = [rs_post(0, p) for p in range(k)]
    gather = [None] * k
    for s in range(n - 1):
        nxt_pending = [None] * k
        for p in range(k):
            works, (c, d, buf) = pending[p]
            _wait(works)
            flat[c:d].add_(buf)
            if s + 1 < n - 1:
                nxt_pending[p] = rs_post(s + 1, p)
            else:
                gather[p] = ag_post(0, p)
        pending = nxt_pending
    # all-gather: step s+1 forwards what step s received
    for s in range(1, n - 1):
        for p in range(k):
            _wait(gather[p])
            gather[p] = ag_post(s, p)
    for p in range(k):
        _wait(gather[p])
    return tensor


def one_shot_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``tensor`` over all ranks in place, in one round: every rank sends its whole
    tensor to every other rank and adds the n tensors in rank order (so every rank gets
    the same bits). One message latency instead of 2(n-1); (n-1)× the bytes of a ring."""
    _require_reducible(tensor)
    n = dist.get_world_size(group)
    r = dist.get_rank(group)
    if n == 1 or tensor.numel() == 0:
        return tensor
    to_global = (lambda k: dist.get_global_rank(group, k)) if group is not None else (lambda k: k)
    flat = tensor.view(-1)
    received = torch.empty((n, flat.numel()), dtype=flat.dtype, device=flat.device)
    ops = []
    for k in range(n):
        if k != r:
            ops.append(dist.P2POp(dist.isend, flat, to_global(k), group))
            ops.append(dist.P2POp(dist.irecv, received[k], to_global(k), group))
    _wait(dist.batch_isend_irecv(ops))
    received[r].copy_(flat)
    total = received[0].clone()
    for k in range(1, n):
        total += received[k]
    flat.copy_(total)
    return tensor


def torch_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """The library's all-reduce (NCCL's kernels on a GPU, gloo's on a CPU), same calling
    convention as the ones above."""
    dist.all_reduce(tensor, group=group)
    return tensor


ALL_REDUCES = {"torch.distributed": torch_all_reduce, "ring": ring_all_reduce, "one-shot": one_shot_all_reduce}


def agreement_rank(sizes: list[int], dtype: torch.dtype, pieces: tuple = (None,)) -> list[dict]:
    """Rank function: ring and one-shot against the library's all-reduce on random data of
    each size (elements), on this rank's device; how many elements differ and by how much."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    rank, n = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    rows = []
    for numel in sizes:
        x = torch.randn(numel, generator=gen, device=device).to(dtype)
        ref = x.clone()
        dist.all_reduce(ref)
        variants = {f"ring pieces={p or 'auto'}": (lambda t, p=p: ring_all_reduce(t, pieces=p)) for p in pieces}
        variants["one-shot"] = one_shot_all_reduce
        for name, fn in variants.items():
            y = fn(x.clone())
            same = torch.tensor([float((y == ref).all())], device=device)
            dist.all_reduce(same, op=dist.ReduceOp.MIN)
            diff = (y.double() - ref.double()).abs()
            rows.append({"impl": name, "numel": numel, "identical_on_all_ranks": bool(same.item()),
                         "max_abs_diff": float(diff.max()), "max_ref": float(ref.double().abs().max()),
                         "world_size": n})
    return rows
