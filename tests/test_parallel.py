"""gpulab.parallel on real gloo process groups (2 and 3 CPU processes): the launcher,
ring and one-shot all-reduce, the tensor-parallel GLU, dead-rank detection, bus
bandwidth, and the notebook's checks against planted wrong implementations."""
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

import gpulab
from gpulab.grading import parallel as gp
from gpulab.harness.checking import CheckFailure
from gpulab.parallel import bandwidth as bw
from gpulab.parallel import faults, launch
from gpulab.parallel.collectives import (all_reduce_reference, chunk_bounds, one_shot_all_reduce,
                                         ring_all_reduce)
from gpulab.parallel.tensor_parallel import (TensorParallelGLU, compare_outputs, glu_shards,
                                             row_parallel_matmul, row_parallel_matmul_float,
                                             scale_partial_sums, shard_range, ternary_partial_sums,
                                             tp_glu_rank, ulp_distance)
from gpulab.bitlinear import BitLinear, pack_ternary, ternary_matmul, ternary_quantize


# -- the launcher ---------------------------------------------------------------------------------
def _rank_info():
    t = torch.ones(2) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t, {k: os.environ.get(k) for k in launch.MULTICAST_OFF}


def _raise_on_rank_1():
    if dist.get_rank() == 1:
        raise KeyError("bad key on rank 1")
    dist.barrier()


def _hang_on_rank_0():
    if dist.get_rank() == 0:
        time.sleep(60)


def _die_on_rank_1():
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def test_run_ranks_returns_results_in_rank_order_with_multicast_off():
    out = launch.run_ranks(_rank_info, 3, backend="gloo")
    assert [o[0] for o in out] == [0, 1, 2] and all(o[1] == 3 for o in out)
    assert all(torch.equal(o[2], torch.full((2,), 6.0)) for o in out)
    assert all(o[3] == launch.MULTICAST_OFF for o in out)


def test_a_ranks_exception_is_raised_with_its_type_rank_and_traceback():
    with pytest.raises(KeyError) as info:
        launch.run_ranks(_raise_on_rank_1, 2, backend="gloo", collective_timeout_s=10)
    assert info.value.failed_rank == 1
    note = "\n".join(getattr(info.value, "__notes__", []))
    assert "rank 1 of 2" in note and "_raise_on_rank_1" in note and "bad key on rank 1" in note


def test_a_stuck_run_times_out_and_a_dead_rank_is_named():
    t = time.monotonic()
    with pytest.raises(launch.RanksTimedOut, match=r"rank\(s\) \[0\] of 2 were still running"):
        launch.run_ranks(_hang_on_rank_0, 2, backend="gloo", timeout_s=1.5)
    with pytest.raises(launch.RankError, match="rank 1 of 2 killed by SIGKILL") as info:
        launch.run_ranks(_die_on_rank_1, 2, backend="gloo", collective_timeout_s=10)
    assert info.value.exitcode == -signal.SIGKILL
    assert time.monotonic() - t < 20


def test_launcher_rejects_bad_arguments():
    with pytest.raises(ValueError, match="positive int"):
        launch.run_ranks(_rank_info, 0, backend="gloo")
    with pytest.raises(ValueError, match="backend must be"):
        launch.run_ranks(_rank_info, 2, backend="mpi")
    if torch.cuda.device_count() < 2:
        with pytest.raises(ValueError, match="one process per GPU"):
            launch.run_ranks(_rank_info, 2, backend="nccl")


# -- collectives ----------------------------------------------------------------------------------
def test_chunk_bounds_cover_the_tensor_with_sizes_differing_by_one():
    for numel, n in ((10, 3), (2, 4), (0, 2), (12, 4)):
        b = chunk_bounds(numel, n)
        assert b[0][0] == 0 and b[-1][1] == numel and all(b[i][1] == b[i + 1][0] for i in range(n - 1))
        sizes = [e - s for s, e in b]
        assert max(sizes) - min(sizes) <= 1


def _all_three(inputs):
    r = dist.get_rank()
    out = []
    for x in inputs:
        a, b, c = x[r].clone(), x[r].clone(), x[r].clone()
        ring_all_reduce(a, pieces=3)
        one_shot_all_reduce(b)
        dist.all_reduce(c)
        out.append((a, b, c))
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_ring_and_one_shot_sum_any_size_and_dtype_identically_on_every_rank(n):
    gen = torch.Generator().manual_seed(n)
    inputs = [torch.randn(n, numel, generator=gen).to(dt) for numel in (1, 7, 1001)
              for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16)]
    inputs.append(torch.randint(-100, 100, (n, 5, 3), generator=gen, dtype=torch.int32))
    res = launch.run_ranks(_all_three, n, inputs, backend="gloo")
    for i, x in enumerate(inputs):
        exact = all_reduce_reference(list(x))
        for k in range(3):
            outs = [res[r][i][k] for r in range(n)]
            assert all(torch.equal(o, outs[0]) for o in outs), "ranks disagree"
            assert outs[0].dtype == x.dtype and outs[0].shape == x.shape[1:]
            tol = {torch.float16: 1e-2, torch.bfloat16: 5e-2}.get(x.dtype, 1e-5)
            assert torch.allclose(outs[0].double(), exact, atol=tol * n, rtol=tol)


def _ring_bad_input():
    for bad in (torch.ones(3, dtype=torch.bool), torch.ones(4, 4).t()):
        try:
            ring_all_reduce(bad)
        except (TypeError, ValueError) as e:
            yield str(e)


def _collect_bad_input():
    return list(_ring_bad_input())


def test_ring_rejects_bad_input():
    msgs = launch.run_ranks(_collect_bad_input, 2, backend="gloo")[0]
    assert "real numbers" in msgs[0] and "contiguous" in msgs[1]


# -- the ring check against planted wrong rings ---------------------------------------------------
def _ring(tensor, bounds="balanced", recv_from=-1, gather=True, steps=None, buf_dtype=None, inplace=True,
          scale=1.0, gather_add=False):
    """A learner-style ring (blocking recv, isend) with switches that plant one mistake each."""
    n, r = dist.get_world_size(), dist.get_rank()
    src = tensor if inplace else tensor.clone()
    flat = src.view(-1)
    if bounds == "floor":           # numel // n per chunk: the remainder is dropped
        k = flat.numel() // n
        b = [(i * k, (i + 1) * k) for i in range(n)]
    else:
        b = chunk_bounds(flat.numel(), n)
    nxt, prv = (r + 1) % n, (r + recv_from) % n
    for s in range(n - 1 if steps is None else steps):
        sc, rc = (r - s) % n, (r - s - 1) % n
        buf = torch.empty(b[rc][1] - b[rc][0], dtype=buf_dtype or flat.dtype)
        req = dist.isend(flat[b[sc][0]:b[sc][1]].clone(), nxt)
        dist.recv(buf, prv)
        req.wait()
        flat[b[rc][0]:b[rc][1]].add_(buf.to(flat.dtype))
    if gather:
        for s in range(n - 1):
            sc, rc = (r + 1 - s) % n, (r - s) % n
            buf = torch.empty(b[rc][1] - b[rc][0], dtype=buf_dtype or flat.dtype)
            req = dist.isend(flat[b[sc][0]:b[sc][1]].clone(), nxt)
            dist.recv(buf, prv)
            req.wait()
            dst = flat[b[rc][0]:b[rc][1]]
            dst.add_(buf) if gather_add else dst.copy_(buf)
    if scale != 1.0:
        flat.mul_(scale)
    return src


def _own_order_sum(t):
    """Every rank adds all tensors itself, starting from its own: ranks drift apart."""
    n, r = dist.get_world_size(), dist.get_rank()
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t)
    acc = parts[r].clone()
    for k in range(1, n):
        acc += parts[(r + k) % n]
    t.copy_(acc)


def _stub(t):
    raise NotImplementedError()


def rejects(name, fn, *args) -> str:
    """The diagnosis ``gpulab.check(name, fn, *args)`` gives a wrong implementation."""
    with pytest.raises(CheckFailure) as info:
        gpulab.check(name, fn, *args)
    return str(info.value)


def test_ring_check_accepts_the_package_ring(capsys):
    gpulab.check("ring-all-reduce", ring_all_reduce, (2, 3))
    assert "correct on 2, 3 gloo processes" in capsys.readouterr().out


RING_MUTANTS = {
    "wrong chunk offsets": (lambda t: _ring(t, bounds="floor"), "chunks miss the remainder"),
    "missing all-gather": (lambda t: _ring(t, gather=False), "the all-gather phase is missing"),
    "too few steps": (lambda t: _ring(t, steps=dist.get_world_size() - 2), "missing some ranks' contributions"),
    "all-gather adds": (lambda t: _ring(t, gather_add=True), "a chunk is added twice"),
    "not in place": (lambda t: _ring(t, inplace=False), "leaves `tensor` unchanged"),
    "average": (lambda t: _ring(t, scale=1.0 / dist.get_world_size()), "that is the average"),
    "float32 buffer": (lambda t: _ring(t, buf_dtype=torch.float32), "disagree on the chunk size or the dtype"),
    "own order": (_own_order_sum, "ranks 0 and"),
}


@pytest.mark.parametrize("name", list(RING_MUTANTS))
def test_ring_check_rejects_and_explains(name):
    fn, expected = RING_MUTANTS[name]
    message = rejects("ring-all-reduce", fn, (2, 3), 5.0)
    assert expected in message, message


def test_ring_check_names_swapped_neighbours_that_only_deadlock_from_three_ranks():
    t = time.monotonic()
    message = rejects("ring-all-reduce", lambda x: _ring(x, recv_from=+1), (2, 3), 2.0)
    assert "only shows from 3 ranks on" in message
    assert time.monotonic() - t < 25


def test_ring_check_lets_the_stub_error_through():
    with pytest.raises(NotImplementedError):
        gpulab.check("ring-all-reduce", _stub, (2,))


# -- tensor parallelism ---------------------------------------------------------------------------
def _tp_all_dtypes():
    return {dt: tp_glu_rank(32, 48, 1, dt, seed=5) for dt in (torch.float32, torch.bfloat16)}


@pytest.mark.parametrize("n", [2, 3])
def test_tp_glu_is_bit_identical_to_tp1_with_int32_reduction_and_not_with_float(n):
    res = launch.run_ranks(_tp_all_dtypes, n, backend="gloo", start_method=launch.kernel_start_method())
    for dt in (torch.float32, torch.bfloat16):
        out = res[0][dt]
        assert all(torch.equal(r[dt]["int32"], out["int32"]) for r in res)
        assert compare_outputs(out["tp1"], out["int32"])["identical"]
        floated = compare_outputs(out["tp1"], out["float"])
        assert not floated["identical"] and floated["max_abs_diff"] < 0.05 * float(out["tp1"].abs().max())


@pytest.mark.parametrize("m", [1, 3])        # the GEMV (decode) and the tensor-core path
def test_partial_sums_are_the_exact_integers_and_one_scale_matches_the_matmul(device, m):
    gen = torch.Generator().manual_seed(m)
    x_q = torch.randint(-127, 128, (m, 37), generator=gen, dtype=torch.int8)
    w_t = ternary_quantize(torch.randn(11, 37, generator=gen))[0]
    exact = x_q.int() @ w_t.int().t()
    x_q, packed = x_q.to(device), pack_ternary(w_t).to(device)
    acc = ternary_partial_sums(x_q, packed)
    assert acc.dtype == torch.int32 and torch.equal(acc.cpu(), exact)
    xs, ws = (torch.rand(m, generator=gen) + 0.5).to(device), torch.tensor([1.7], device=device)
    for dt in (torch.float32, torch.bfloat16):
        assert torch.equal(scale_partial_sums(acc, xs, ws, dt), ternary_matmul(x_q, xs, packed, ws, out_dtype=dt))


def test_scale_kernel_passes_its_check():
    gpulab.check("scale_partial_sums", gp.SCALE_PARTIAL_SUMS.implementation)


def test_tp_layers_reject_what_cannot_be_split():
    with pytest.raises(ValueError, match="cannot be split evenly over 3 ranks"):
        shard_range(10, 0, 3)
    gate_up, down = BitLinear(8, 12), BitLinear(6, 8)
    with pytest.raises(ValueError, match="pack the BitLinear first"):
        TensorParallelGLU(gate_up, down, rank=0, world_size=2)
    with pytest.raises(ValueError, match="needs 2 × 6"):
        TensorParallelGLU(BitLinear(8, 10).pack(), down.pack(), rank=0, world_size=2)
    a = torch.zeros(3, dtype=torch.float32)
    with pytest.raises(TypeError, match="one float dtype"):
        ulp_distance(a, a.double())


def _block_cut(gu, dn, r, n):
    s = dn.shape[1] // n
    return gu[r * 2 * s:(r + 1) * 2 * s], dn[:, r * s:(r + 1) * s]


def _down_rows(gu, dn, r, n):
    d = dn.shape[0]
    return glu_shards(gu, dn, r, n)[0], dn[r * d // n:(r + 1) * d // n]


def _up_misaligned(gu, dn, r, n):
    h = dn.shape[1]
    s, q = h // n, (r + 1) % n
    return torch.cat([gu[r * s:(r + 1) * s], gu[h + q * s:h + (q + 1) * s]]), dn[:, r * s:(r + 1) * s]


def _down_misaligned(gu, dn, r, n):
    s, q = dn.shape[1] // n, (r + 1) % n
    return glu_shards(gu, dn, r, n)[0], dn[:, q * s:(q + 1) * s]


def _same_units_everywhere(gu, dn, r, n):
    return glu_shards(gu, dn, 0, n)


def _no_reduce(x_q, x_scale, w_packed, w_scale, out_dtype=torch.float32, group=None):
    return ternary_matmul(x_q, x_scale, w_packed, w_scale, out_dtype=out_dtype)


def test_tp_checks_accept_the_package_split_and_reduction(capsys):
    gpulab.check("glu-shards", glu_shards, 2, (1,), (torch.float32,))
    gpulab.check("row-parallel-matmul", row_parallel_matmul, 2, (1,), (torch.float32,))
    out = capsys.readouterr().out
    assert "glu_shards: shards right" in out and "row_parallel_matmul: TP=2 output bit-identical" in out


@pytest.mark.parametrize("shard,expected", [
    (_block_cut, "cut as one block"), (_down_rows, "take columns"), (_up_misaligned, "same slice [a, b) of both"),
    (_down_misaligned, "w_down columns are units"), (_same_units_everywhere, "on no rank")])
def test_tp_check_explains_a_wrong_split_without_starting_ranks(shard, expected):
    t = time.monotonic()
    message = rejects("glu-shards", shard)
    assert expected in message, message
    assert time.monotonic() - t < 2


@pytest.mark.parametrize("matmul,expected", [(row_parallel_matmul_float, "all-reduce the *int32* partial sums"),
                                             (_no_reduce, "the all-reduce is missing")])
def test_tp_check_explains_a_wrong_reduction(matmul, expected):
    message = rejects("row-parallel-matmul", matmul, 2, (1,), (torch.float32,))
    assert expected in message, message


def test_tp_check_draws_other_inputs_where_a_float_reduction_happens_to_be_exact():
    """Seed 6 (float32, one row): the float reduction gives TP=1's bits; the check must
    still catch it, on inputs that tell the reductions apart."""
    message = rejects("row-parallel-matmul", row_parallel_matmul_float, 2, (1,), (torch.float32,), 30.0, 6)
    assert "all-reduce the *int32* partial sums" in message, message


# -- faults ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode,reason", [("kill", "peer lost"), ("stall", "timeout")])
def test_a_dead_or_stalled_rank_is_detected_within_the_timeout(mode, reason):
    t = time.monotonic()
    r = faults.dead_rank_demo(2, victim=1, mode=mode, timeout_s=1.0, backend="gloo")
    assert r["detected"] and r["reasons"] == [reason]
    assert r["detect_s"] < 1.0 + 2.0          # gloo sees a kill at once, a stall at the deadline
    assert "rank 0 of 2" in r["messages"][0]
    if mode == "kill":
        assert "SIGKILL" in r["victim_end"]
    else:
        assert r["detect_s"] >= 1.0
    assert time.monotonic() - t < 15


def test_all_reduce_within_rejects_a_bad_timeout():
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        faults.all_reduce_within(torch.ones(1), 0)


# -- bus bandwidth --------------------------------------------------------------------------------
def test_bus_bandwidth_follows_nccl_tests_conventions():
    assert bw.algbw_gbps(2e9, 1.0) == 2.0
    assert bw.busbw_gbps(2e9, 1.0, 2) == 2.0                 # 2(n-1)/n = 1 for two ranks
    assert bw.busbw_gbps(2e9, 1.0, 4) == pytest.approx(3.0)  # 1.5 for four
    assert bw.busbw_gbps(2e9, 1.0, 4, "all_gather") == pytest.approx(1.5)
    with pytest.raises(ValueError, match="op must be one of"):
        bw.busbw_gbps(1, 1, 2, "alltoall")


def test_a_small_gloo_sweep_and_the_saved_results_read_and_plot():
    import matplotlib
    matplotlib.use("Agg")
    r = bw.measure(2, backend="gloo", sizes=[4096, 65536], budget_s=0.01)
    assert {row["impl"] for row in r["rows"]} == {"gloo", "ring", "one-shot"}
    assert r["device"].startswith("CPU") and "gloo" in r["label"]
    assert "64 KB" in bw.table(r) and bw.regimes(r, "ring")["peak_busbw_GBps"] > 0
    for name in ("collectives_busbw_cpu_gloo", "collectives_busbw"):
        saved = bw.load_result(name)
        if saved is not None:
            bw.plot(saved)
            assert saved["rows"] and saved["label"]
