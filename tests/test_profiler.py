"""`gpulab profile`: Nsight Compute's raw CSV is summarised into what a learner should
look at; without a GPU the saved H200 report is shown."""
import json

import pytest

import gpulab
from gpulab.harness import profiler

HEADER = ["ID", "Process ID", "Process Name", "Kernel Name", "Block Size", "Grid Size",
          "gpu__time_duration.sum", "dram__bytes.sum.per_second", "dram__bytes_read.sum",
          "dram__bytes_write.sum", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
          "sm__throughput.avg.pct_of_peak_sustained_elapsed",
          "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
          "sm__warps_active.avg.pct_of_peak_sustained_active", "sm__maximum_warps_per_active_cycle_pct",
          "launch__registers_per_thread", "launch__grid_size", "launch__block_size",
          "launch__occupancy_limit_registers", "launch__occupancy_limit_shared_mem",
          "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
          "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",
          "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
          "sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active",
          "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active"]
UNITS = ["", "", "", "", "", "", "usecond", "Tbyte/second", "Mbyte", "Mbyte", "%", "%", "%", "%", "%",
         "register/thread", "", "", "block", "block", "inst", "inst", "inst", "%", "%"]
ROW = ["0", "4242", "python", "softmax_kernel", "(128, 1, 1)", "(4096, 1, 1)", "21.5", "3.61",
       "67.11", "33.55", "84.2", "31.0", "0", "71.3", "100", "32", "4,096", "128", "16", "8",
       "6.0", "1.5", "0.5", "22.1", "12.9"]


def csv_text():
    quote = lambda row: ",".join(f'"{c}"' for c in row)
    return "==PROF== Connected to process 4242\n" + "\n".join(map(quote, (HEADER, UNITS, ROW))) + "\n"


def test_ncu_raw_csv_is_parsed_in_base_units():
    (rec,) = profiler.parse_ncu_csv(csv_text())
    assert rec["Kernel Name"] == "softmax_kernel"
    assert rec["gpu__time_duration.sum"] == pytest.approx(21500)            # ns
    assert rec["dram__bytes.sum.per_second"] == pytest.approx(3.61e12)      # bytes/s
    assert rec["launch__grid_size"] == 4096


def test_summary_names_what_to_look_at():
    (rec,) = profiler.parse_ncu_csv(csv_text())
    k = profiler.summarise_ncu(rec)
    assert k["dram_pct_of_peak"] == 84.2 and k["sm_pct_of_peak"] == 31.0 and k["tensor_pct_of_peak"] == 0
    assert k["achieved_occupancy_pct"] == 71.3 and k["occupancy_limited_by"] == "shared_mem"
    assert [name for name, _ in k["top_stalls"]] == ["long_scoreboard", "wait", "barrier"]
    assert k["top_stalls"][0][1] == pytest.approx(75.0)
    assert list(k["pipe_utilisation_pct"]) == ["lsu", "fma"]
    assert profiler.verdict(k).startswith("bandwidth-bound")
    report = {"kernel": "softmax", "tool": "Nsight Compute", "gpu": "NVIDIA H200", "date": "2026-12-01",
              "case": "4096x4096", "dtype": "bfloat16", "kernels": [k], "source": "saved report"}
    text = profiler.format_report(report)
    assert "3.61 TB/s, 84% of peak" in text and "long scoreboard 75%" in text
    assert "71% achieved of 100% theoretical, limited by shared mem" in text
    assert all(len(line) <= 88 for line in text.splitlines())


def test_latency_bound_verdict_names_the_top_stall():
    k = {"dram_pct_of_peak": 20.0, "sm_pct_of_peak": 15.0, "top_stalls": [("long_scoreboard", 60.0)]}
    assert "latency-bound" in profiler.verdict(k) and "long scoreboard" in profiler.verdict(k)


def test_ncu_runs_the_case_once_in_a_profiling_range():
    spec = gpulab.get_spec("softmax")
    case = profiler.pick_case(spec, "4096x4096")
    cmd = profiler.ncu_command("softmax", case, profiler.DTYPES["bf16"])
    assert cmd[:3] == ["ncu", "--csv", "--page"] and "--profile-from-start" in cmd
    assert cmd[-6:] == ["--child", "softmax", "--case", "4096x4096", "--dtype", "bfloat16"]
    with pytest.raises(ValueError, match="no benchmark case 'nope'; its cases: '4096x256'"):
        profiler.pick_case(spec, "nope")
    with pytest.raises(ValueError, match="no benchmark cases"):
        profiler.pick_case(gpulab.get_spec("split_kv_reduce"), None)


@pytest.mark.skipif(gpulab.mode() == "compiled", reason="on a GPU the kernel is profiled live")
def test_on_a_cpu_the_saved_report_is_shown(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(profiler, "PROFILES", tmp_path)
    assert profiler.show("softmax") is None
    assert "no saved profile of softmax" in capsys.readouterr().out
    (rec,) = profiler.parse_ncu_csv(csv_text())
    saved = {"kernel": "softmax", "tool": "Nsight Compute", "gpu": "NVIDIA H200", "date": "2026-12-01",
             "case": "4096x4096", "dtype": "bfloat16", "kernels": [profiler.summarise_ncu(rec)]}
    (tmp_path / "softmax.json").write_text(json.dumps(saved))
    report = profiler.show("softmax")
    assert report["source"].startswith("saved report")
    assert "softmax — Nsight Compute on NVIDIA H200" in capsys.readouterr().out
    assert profiler.main(["--list"]) == 0 and "softmax" in capsys.readouterr().out


def test_shipped_profiles_are_complete():
    for name in profiler.saved():
        r = profiler.load(name)
        assert r["kernels"] and r["tool"] in ("Nsight Compute", "torch.profiler"), name
        profiler.format_report({**r, "source": "saved"})
