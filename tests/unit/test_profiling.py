"""Where a profiled step's GPU sat idle (`vlmctl.profiling.idle_report`), on hand-made Kineto Chrome traces: the
format torch.profiler's `export_chrome_trace` writes (microseconds; a launch and its kernel share a correlation)."""

import gzip
import json

import pytest

from vlmctl.profiling import idle_report


def _x(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 7, "tid": tid, "args": args}


def _trace():
    return {"traceEvents": [
        # host: an optimizer step (a user annotation) holding an aten op that launches kernel 2
        _x("user_annotation", "Optimizer.step#AdamW.step", 1000, 3040),
        _x("cpu_op", "aten::mul", 1200, 2810),
        _x("cpu_op", "aten::add", 0, 500),  # a sibling before it, which must not be charged
        _x("cuda_runtime", "cudaLaunchKernel", 10, 5, correlation=1),
        _x("cuda_runtime", "cudaLaunchKernel", 4000, 5, correlation=2),
        _x("cuda_driver", "cuLaunchKernel", 4100, 5, correlation=3),
        _x("cpu_op", "LigerRMSNormFunction", 4050, 100),
        # GPU: kernel 1 [100, 1100), 3 ms idle, kernel 2 [4100, 4200), a 30 us gap (launch latency, not counted),
        # kernel 3 (a Triton launch through the driver) [4230, 4300), then a kernel without a launch record
        _x("kernel", "gemm_1", 100, 1000, tid=20, correlation=1),
        _x("kernel", "mul_kernel", 4100, 100, tid=20, correlation=2),
        _x("kernel", "rms_norm", 4230, 70, tid=20, correlation=3),
        _x("gpu_memcpy", "Memcpy HtoD", 6300, 200, tid=20, correlation=99),
        # a collective on its own stream: reported apart, not compute
        _x("kernel", "ncclDevKernel_AllGather_RING_LL(ncclDevComm*)", 1100, 2500, tid=21, correlation=50),
    ]}


def test_idle_time_is_charged_to_the_host_code_that_launched_the_next_kernel(tmp_path):
    report = idle_report(_trace())
    assert report.gaps == 2 and report.idle_s == pytest.approx((3000 + 2000) / 1e6)
    assert report.span_s == pytest.approx(6400 / 1e6) and report.compute_s == pytest.approx(1370 / 1e6)
    assert report.busy_s == pytest.approx((1370 + 2500) / 1e6)  # any kernel: the collective's 2.5 ms counted once
    by_host = {where: (s, n) for where, s, n in report.by_host}
    assert by_host == {"Optimizer.step#AdamW.step": (pytest.approx(3e-3), 1),
                       "(launch not recorded)": (pytest.approx(2e-3), 1)}
    assert report.longest[0] == (pytest.approx(3e-3), "Optimizer.step#AdamW.step", "mul_kernel")
    assert report.collectives == [("ncclDevKernel_AllGather_RING_LL", pytest.approx(2.5e-3), 1)]
    text = report.text()
    assert "GPU idle time: 0.005 s in 2 gaps" in text and "before mul_kernel  launched in Optimizer.step" in text
    # the same from a gzipped file, as `vlmctl bench --profile` writes it
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(_trace(), f)
    assert idle_report(path) == report


def test_idle_time_is_split_into_host_collective_and_other_waits():
    """The 3 ms gap before kernel 2 [1100, 4100): its launch came at 4000 (2.9 ms the host behind) and the collective
    [1100, 3600) ran before it, so none of the rest is the collective's; the 2 ms gap before the unrecorded copy
    has no launch: all of it `other`. Then the copy's gap, launched at 5000 while a collective runs to 6300."""
    report = idle_report(_trace())
    assert report.host_s == pytest.approx(2.9e-3)
    assert report.collective_s == pytest.approx(0.0) and report.other_s == pytest.approx(2.1e-3)
    trace = _trace()
    trace["traceEvents"] += [_x("cuda_runtime", "cudaMemcpyAsync", 5000, 5, correlation=99),
                             _x("kernel", "ncclDevKernel_SendRecv(ncclDevComm*)", 5500, 900, tid=21, correlation=51)]
    report = idle_report(trace)
    # gap [4300, 6300): 0.7 ms before the launch at 5000, then 0.5 ms idle, 0.8 ms while the collective ran
    assert report.host_s == pytest.approx((2900 + 700) / 1e6)
    assert report.collective_s == pytest.approx(800 / 1e6) and report.other_s == pytest.approx((100 + 500) / 1e6)
    assert report.host_s + report.collective_s + report.other_s == pytest.approx(report.idle_s)
    assert "by cause: 3.6 ms the host behind" in report.text()


def test_the_part_of_a_gap_the_host_spent_waiting_for_work_is_reported_apart():
    """A server's thread waits for requests in a `waits` range [1200, 3200) inside the 3 ms gap [1100, 4100) before
    kernel 2 (launched at 4000): 2 ms of it the GPU had no work; of the remaining 1 ms, the 0.9 ms before the launch
    (0.1 ms before the wait, 0.8 ms after it) the host was behind, and the 0.1 ms after it is other."""
    from vlmctl.profiling import WAIT_FOR_WORK

    trace = _trace()
    trace["traceEvents"].append(_x("user_annotation", WAIT_FOR_WORK, 1200, 2000))
    plain, report = idle_report(trace), idle_report(trace, waits=(WAIT_FOR_WORK,))
    assert plain.waiting_s == 0 and report.idle_s == plain.idle_s
    assert report.waiting_s == pytest.approx(2e-3)
    by_host = {where: (s, n) for where, s, n in report.by_host}
    assert by_host[WAIT_FOR_WORK] == (pytest.approx(2e-3), 1)
    assert by_host["Optimizer.step#AdamW.step"] == (pytest.approx(1e-3), 1)
    assert report.host_s == pytest.approx(0.9e-3)
    assert report.waiting_s + report.host_s + report.collective_s + report.other_s == pytest.approx(report.idle_s)
    assert "by cause: 2.0 ms waiting for work, 0.9 ms the host behind" in report.text()


def test_a_gap_before_a_driver_launch_is_charged_to_its_enclosing_op():
    trace = _trace()
    # kernel 3 now starts 1 ms after kernel 2 ends: its Triton launch (cuLaunchKernel) sits in LigerRMSNormFunction
    next(e for e in trace["traceEvents"] if e["name"] == "rms_norm")["ts"] = 5200
    by_host = {where: n for where, _, n in idle_report(trace).by_host}
    assert by_host["LigerRMSNormFunction"] == 1


def test_a_trace_without_gpu_kernels_and_a_file_that_is_not_a_trace(tmp_path):
    cpu_only = {"traceEvents": [_x("cpu_op", "aten::mm", 0, 10)]}
    report = idle_report(cpu_only)
    assert report.span_s == 0 and report.busy_s == 0 and report.text() == "GPU idle time: no GPU kernels in the trace"
    (tmp_path / "x.json").write_text(json.dumps({"events": []}))
    with pytest.raises(ValueError, match="not a Chrome trace"):
        idle_report(tmp_path / "x.json")


def test_the_module_prints_the_report_of_each_trace_and_exits_2_on_a_bad_file(tmp_path, capsys):
    from vlmctl.profiling import main

    good = tmp_path / "trace.json"
    good.write_text(json.dumps(_trace()))
    assert main([str(good)]) == 0
    assert "GPU idle time: 0.005 s in 2 gaps" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text("{not json")
    assert main([str(good), str(tmp_path / "bad.json")]) == 2
    assert "bad.json" in capsys.readouterr().err
    assert main([]) == 2


def test_a_thread_profile_started_on_another_thread_records_it_without_kinetos_thread_error(tmp_path):
    """Kineto initializes at the first profile of the process, which must run on the thread that imported torch:
    `ThreadProfile` makes that first profile itself, so a worker thread's profile starts cleanly and records the
    worker's ops. In a fresh process, since a profile made earlier in this one would hide the error."""
    import subprocess
    import sys

    script = f"""
import threading, torch
from vlmctl.profiling import ThreadProfile, phase
profile = ThreadProfile({str(tmp_path)!r})
def work():
    profile.start()
    with phase("engine.decode_step"):
        torch.ones(8).sum()
    print(sorted(profile.stop()["phase_seconds"]))
thread = threading.Thread(target=work)
thread.start()
thread.join()
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "External init callback" not in done.stderr
    assert done.stdout.strip().endswith("['engine.decode_step']")
    assert (tmp_path / "profile-001" / "trace.json.gz").is_file()


def test_phase_seconds_keeps_a_ranges_host_time_beside_its_device_row():
    """On CUDA, `key_averages()` has two rows per range name: the host's and a device-side one with no host time. The
    host's time is kept in either order; names outside the phases are left out."""
    from types import SimpleNamespace

    from vlmctl.profiling import phase_seconds

    row = lambda key, us: SimpleNamespace(key=key, cpu_time_total=us)  # noqa: E731
    table = [row("engine.prefill", 1_227_400.0), row("engine.prefill", 0.0), row("engine.admit", 0.0),
             row("engine.admit", 1_719_800.0), row("aten::linear", 5_000.0)]
    assert phase_seconds(table) == {"engine.prefill": 1.2274, "engine.admit": 1.7198}
