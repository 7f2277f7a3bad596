"""One step under torch.profiler (`vlmctl bench --profile`), a server's work between two requests (`ThreadProfile`,
`vlmctl serve --profile-dir`), and where the GPU sat idle.

`profile_step` writes a rank's `ops.txt` (the step's wall and GPU-kernel seconds, the idle report, the operator
tables) and its Chrome trace (`trace.json.gz`); `ThreadProfile` writes the same for what one thread did between its
`start` and `stop`. `idle_report` reads such a trace: the GPU time between compute
kernels, charged to the host code that launched the kernel ending each gap. A gap is the GPU waiting for the host
(Python, kernel launches, a host synchronisation, a Triton compilation), or for another rank (a collective the
next kernel depends on); the host code named is where the work resumed, which is what to look at to close it. A
server's thread waits for requests inside a range named by `waits` (`WAIT_FOR_WORK`): the part of a gap it spent
there is the GPU having no work, reported apart. `phase(name)` names a stretch of host code in the trace (a
`record_function` range, made only while a profile records).

The trace format is the one `torch.profiler.profile.export_chrome_trace` writes (Kineto's Chrome trace: events with
`ph: "X"`, `ts` and `dur` in microseconds, `cat` in kernel / gpu_memcpy / gpu_memset on the GPU, cuda_runtime /
cuda_driver for launches, cpu_op / user_annotation for host code; a launch and its kernel share
`args.correlation`). Collective kernels (NCCL) are not compute: they are reported apart, by name.
"""

from __future__ import annotations

import bisect
import contextlib
import gzip
import json
import os
import re
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from vlmctl.files import atomic_write

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
HOST_CATEGORIES = ("cpu_op", "user_annotation")
MIN_GAP_US = 50.0  # shorter gaps are launch latency between back-to-back kernels
WAIT_FOR_WORK = "serve.wait_for_requests"
"""The range a server's decoding thread waits in while no request runs (`vlmctl.serve.engine`)."""
PHASE_PREFIXES = ("engine.", "serve.")
"""The `phase` ranges `ThreadProfile.stop` sums by name: the decoding engine's and the server's."""

# torch is imported inside the functions that use it (`phase`, `profile_step`, `ThreadProfile`): reading a trace
# (`idle_report`) must not pay for its import.


def _merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted intervals merged where they overlap."""
    out: list[list[float]] = []
    for a, b in spans:
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _union_us(spans: list[tuple[float, float]]) -> float:
    """The length of the union of sorted intervals."""
    return sum(b - a for a, b in _merged(spans))


def _overlap_us(merged: list[tuple[float, float]], a: float, b: float) -> float:
    """How much of [a, b) the merged intervals cover."""
    total, i = 0.0, max(bisect.bisect_right(merged, (a, float("inf"))) - 1, 0)
    while i < len(merged) and merged[i][0] < b:
        lo, hi = max(merged[i][0], a), min(merged[i][1], b)
        total += max(hi - lo, 0.0)
        i += 1
    return total


@dataclass(frozen=True)
class IdleReport:
    """The GPU's idle time in one profiled step (seconds). `busy_s`: wall seconds during which any GPU kernel,
    copy or collective ran (the union of their intervals); `compute_s` the same without collectives. `by_host`:
    (host code, seconds, gaps), largest first;
    `longest`: (seconds, host code, next kernel) of the longest single gaps; `collectives`: (kernel name, seconds,
    calls) of the collective kernels. The idle seconds split by cause (`waiting_s + host_s + collective_s + other_s
    == idle_s`): `waiting_s`, the part of the gaps the host spent in a range of `idle_report`'s `waits` (a server
    with no request to run: no work, not a delay), charged in `by_host` to that range; `host_s`, the rest of each
    gap before the host launched the kernel that ended it (the GPU waiting for
    the host: Python, launches, a sync, a compile); `collective_s`, the rest of a gap while a collective kernel ran
    (the compute stream waiting on communication, or on another rank entering the collective); `other_s`, what is
    left (a kernel queued before the gap that started late: an event on another stream, a copy)."""

    span_s: float
    busy_s: float
    compute_s: float
    idle_s: float
    gaps: int
    by_host: list[tuple[str, float, int]]
    longest: list[tuple[float, str, str]]
    collectives: list[tuple[str, float, int]]
    host_s: float = 0.0
    collective_s: float = 0.0
    other_s: float = 0.0
    waiting_s: float = 0.0

    def text(self, rows: int = 15) -> str:
        if self.span_s <= 0:
            return "GPU idle time: no GPU kernels in the trace"
        lines = [f"GPU idle time: {self.idle_s:.3f} s in {self.gaps} gaps over {MIN_GAP_US:.0f} us between compute "
                 f"kernels, of a {self.span_s:.3f} s span ({self.compute_s:.3f} s of compute kernels); charged to the "
                 "host code that launched the kernel after each gap:"]
        waiting = f"{self.waiting_s * 1e3:.1f} ms waiting for work, " if self.waiting_s else ""
        lines.append(f"  by cause: {waiting}{self.host_s * 1e3:.1f} ms the host behind (the next kernel launched during the gap), "
                     f"{self.collective_s * 1e3:.1f} ms while a collective ran (waiting on communication or another "
                     f"rank), {self.other_s * 1e3:.1f} ms other (a kernel queued before the gap started late)")
        lines += [f"  {s * 1e3:9.1f} ms  {n:5d} gaps  {where}" for where, s, n in self.by_host[:rows]]
        lines.append("Longest gaps:")
        lines += [f"  {s * 1e3:9.1f} ms  before {kernel}  launched in {where}" for s, where, kernel in self.longest]
        if self.collectives:
            lines.append("Collective kernels (they overlap compute or wait for another rank):")
            lines += [f"  {s * 1e3:9.1f} ms  {n:5d} calls  {name}" for name, s, n in self.collectives]
        return "\n".join(lines)


class _HostStack:
    """The host ops of one thread, nested by time: `chain(ts)` lists the ops running at `ts`, outermost first."""

    def __init__(self, ops: list[dict[str, Any]]):
        ops = sorted(ops, key=lambda e: (e["ts"], -e["dur"]))
        self.starts = [e["ts"] for e in ops]
        self.ops = ops
        self.parent: list[int] = []
        stack: list[int] = []
        for i, e in enumerate(ops):
            while stack and ops[stack[-1]]["ts"] + ops[stack[-1]]["dur"] < e["ts"]:
                stack.pop()
            self.parent.append(stack[-1] if stack else -1)
            stack.append(i)

    def chain(self, ts: float) -> list[str]:
        i = bisect.bisect_right(self.starts, ts) - 1
        names = []
        while i >= 0:  # every op enclosing ts encloses the last op started before it: walk up its ancestors
            e = self.ops[i]
            if e["ts"] + e["dur"] >= ts:
                names.append(e["name"])
            i = self.parent[i]
        return names[::-1]


def _where(chain: list[str]) -> str:
    """A readable name for a host op chain: the enclosing non-aten ops (module, autograd node, FSDP, optimizer,
    compiled region), else the outermost two aten ops."""
    named = [n for n in chain if not n.startswith(("aten::", "cuda"))]
    picked = named[-3:] if named else chain[:2]
    return " > ".join(n[:60] for n in picked) or "(no host op)"


def _complete_event(e: Any) -> bool:
    """Whether `e` is a complete event (`ph: "X"`) with numeric `ts` and `dur`, a text `name` and, when present, an
    object of `args` whose `correlation` (when present) is a number or text."""
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    args = e.get("args", {}) if isinstance(e, dict) else None
    return (isinstance(e, dict) and e.get("ph") == "X" and number(e.get("ts")) and number(e.get("dur"))
            and isinstance(e.get("name"), str) and isinstance(args, dict)
            and isinstance(args.get("correlation", 0), (int, float, str)))


def trace_events(trace: dict[str, Any] | str | Path) -> list[dict[str, Any]]:
    """The complete events (`_complete_event`) of a Chrome trace (a dict, or a path to a `.json` or `.json.gz` file;
    format in the module docstring). Raises ValueError for a file that is not such a trace (not JSON, JSON without a
    `traceEvents` list, a truncated gzip stream), OSError for one that cannot be read or unzipped."""
    if not isinstance(trace, dict):
        path = Path(trace)
        try:
            with (gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")) as f:
                trace = json.load(f)
        except EOFError:
            raise ValueError("the gzip stream ends early (a truncated file)") from None
        except RecursionError:
            raise ValueError("JSON nested too deeply") from None
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ValueError("not a Chrome trace: no traceEvents list (write one with torch.profiler's export_chrome_trace)")
    return [e for e in trace["traceEvents"] if _complete_event(e)]


def idle_report(trace: dict[str, Any] | str | Path, *, longest: int = 8, waits: tuple[str, ...] = ()) -> IdleReport:
    """Where one rank's GPU sat idle in a profiled step, from its Chrome trace (a dict, or a path to a `.json` or
    `.json.gz` file; format in the module docstring). `waits`: names of host ranges in which a thread waits for work
    (`WAIT_FOR_WORK`); the part of a gap spent in one is `waiting_s`. Gaps shorter than `MIN_GAP_US` are left out; events that are
    not complete events of that format (not an object, `ts` / `dur` not numbers, a name that is not text) are left
    out too. Raises ValueError for a file that is not such a trace (not JSON, JSON without a `traceEvents` list, a
    truncated gzip stream), OSError for one that cannot be read or unzipped."""
    events = trace_events(trace)
    device = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    collective = [e for e in device if "nccl" in e["name"].lower()]
    compute = sorted((e for e in device if "nccl" not in e["name"].lower()), key=lambda e: e["ts"])
    coll = Counter(); calls = Counter()
    for e in collective:
        name = e["name"].split("(")[0]
        coll[name] += e["dur"]; calls[name] += 1
    collectives = [(name, us / 1e6, calls[name]) for name, us in coll.most_common()]
    busy = _union_us(sorted((e["ts"], e["ts"] + e["dur"]) for e in device)) / 1e6
    if not compute:
        return IdleReport(0.0, busy, 0.0, 0.0, 0, [], [], collectives)
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}
    threads: dict[Any, list[dict[str, Any]]] = {}
    for e in events:
        if e.get("cat") in HOST_CATEGORIES:
            threads.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    stacks = {key: _HostStack(ops) for key, ops in threads.items()}

    by_host = Counter(); count = Counter(); gaps: list[tuple[float, str, str]] = []
    comm = _merged(sorted((c["ts"], c["ts"] + c["dur"]) for c in collective))
    idle_spans = {name: _merged(sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                                       if e.get("cat") in HOST_CATEGORIES and e["name"] == name)) for name in waits}
    cause = Counter()
    end = compute[0]["ts"] + compute[0]["dur"]
    for e in compute[1:]:
        gap = e["ts"] - end
        if gap > MIN_GAP_US:
            launch = launches.get(e.get("args", {}).get("correlation"))
            stack = stacks.get((launch.get("pid"), launch.get("tid"))) if launch else None
            where = _where(stack.chain(launch["ts"])) if stack else "(launch not recorded)"
            waited = 0.0
            for name, spans in idle_spans.items():
                part = _overlap_us(spans, end, e["ts"])
                if part > 0:
                    by_host[name] += part; count[name] += 1; waited += part
            rest = gap - waited
            if rest > 0:
                by_host[where] += rest; count[where] += 1
                gaps.append((rest / 1e6, where, e["name"][:80]))
            late = min(max(launch["ts"] - end - waited, 0.0), rest) if launch else 0.0
            during = min(_overlap_us(comm, end + waited + late, e["ts"]), rest - late)
            cause["waiting"] += waited
            cause["host"] += late; cause["collective"] += during; cause["other"] += rest - late - during
        end = max(end, e["ts"] + e["dur"])
    span = end - compute[0]["ts"]
    compute_busy = _union_us(sorted((e["ts"], e["ts"] + e["dur"]) for e in compute))
    return IdleReport(span / 1e6, busy, compute_busy / 1e6, sum(by_host.values()) / 1e6, len(gaps),
                      [(w, us / 1e6, count[w]) for w, us in by_host.most_common()],
                      sorted(gaps, reverse=True)[:longest], collectives,
                      cause["host"] / 1e6, cause["collective"] / 1e6, cause["other"] / 1e6, cause["waiting"] / 1e6)


def phase(name: str):
    """A host range named `name` in the trace (`torch.profiler.record_function`) while a profile records this thread,
    else a context that does nothing: an unrecorded range still costs about 5 us (measured on the 2-core CPU machine,
    torch 2.13), a share of a decode step of a few milliseconds. Use: `with phase("engine.prefill"): ...`."""
    from torch.autograd import profiler

    if getattr(profiler, "_is_profiler_enabled", True):  # torch's own flag; where it is gone, always name the range
        return profiler.record_function(name)
    return contextlib.nullcontext()


def _write(prof, table, folder: Path, headline: Callable[[IdleReport], str], cuda: bool,
           waits: tuple[str, ...] = ()) -> tuple[IdleReport, str]:
    """Write `prof`'s (a stopped `torch.profiler.profile`) Chrome trace and `ops.txt` (the line `headline(report)`,
    the idle report, the top 40 operators of `table`, its `key_averages()`, by self CPU and by self device time) into
    `folder`, each through a temporary name. Returns (the idle report, `idle_report` with `waits`; the headline)."""
    prof.export_chrome_trace(str(folder / ".trace.tmp.json.gz"))  # torch gzips a path ending in .gz
    os.replace(folder / ".trace.tmp.json.gz", folder / "trace.json.gz")
    report = idle_report(folder / "trace.json.gz", waits=waits)  # every GPU figure from the trace, read once
    line = headline(report)
    text = (line + "\n\n" + report.text() + "\n\n"
            + table.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70) + "\n"
            + table.table(sort_by="self_device_time_total" if cuda else "cpu_time_total", row_limit=40,
                          max_name_column_width=70))
    atomic_write(folder / "ops.txt", text)
    return report, line


def profile_step(step, folder: Path, sync) -> tuple[Any, str]:
    """Run `step()` once under `torch.profiler.profile` (CPU and, on a GPU, CUDA activities) and write to `folder`
    (created): `trace.json.gz`, the Chrome trace (https://ui.perfetto.dev opens it), and `ops.txt`: the step's wall
    seconds, the seconds the GPU ran kernels (`IdleReport.busy_s`: a collective waiting for another rank counts as
    running; the rest is the GPU waiting for the host), where the GPU sat idle (`idle_report`), and the top 40
    operators by self CPU and by self device time. Returns (step's result, the summary line)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    folder.mkdir(parents=True, exist_ok=True)
    sync()
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        t0 = time.perf_counter()
        result = step()
        sync()
        wall = time.perf_counter() - t0
    tokens = result.text_tokens + result.visual_tokens
    _, summary = _write(prof, prof.key_averages(), folder,
                        lambda r: (f"profiled step: {wall:.3f} s wall, GPU kernels {r.busy_s:.3f} s ({100 * r.busy_s / wall:.0f}%), "
                                   f"{tokens} tokens; tables and trace in {folder}"), cuda)
    return result, summary


class ProfileStateError(RuntimeError):
    """A profile started while one records, or stopped while none does."""


class ThreadProfile:
    """torch.profiler over what one thread does between `start()` and `stop()`, both called on that thread (torch
    records the host ops of the thread that started it, and every kernel and copy of the process's GPU), for a
    server's decoding thread (`vlmctl serve --profile-dir`). Each `stop()` writes a new folder under `root`,
    `profile-NNN/`, with `trace.json.gz` and `ops.txt` as `profile_step` writes them; the idle report counts the
    time spent in `WAIT_FOR_WORK` ranges as waiting for work. `max_seconds`: `expired()` is true once a profile has
    recorded that long, so that a profile nobody stops is stopped before its events fill the host's memory.
    `start` raises ProfileStateError while one records, `stop` while none does. Make it on the thread that imported
    torch (see `__init__`)."""

    def __init__(self, root: Path, max_seconds: float = 60.0):
        from torch.profiler import ProfilerActivity, profile

        self.root, self.max_seconds = Path(root), float(max_seconds)
        self._prof: Any = None
        self._started = 0.0
        # Kineto (torch's profiler library) initializes at its first profile, which must run on the thread that
        # imported torch: made first on the worker's thread, it logs "External init callback must run in same thread
        # as registerClient" (and leaves the profiler broken on some devices, vllm-project/vllm-ascend#15294). An
        # empty profile here, on the caller's thread, initializes it.
        with profile(activities=[ProfilerActivity.CPU]):
            pass

    @property
    def active(self) -> bool:
        return self._prof is not None

    def expired(self) -> bool:
        return self.active and time.perf_counter() - self._started >= self.max_seconds

    def remaining(self) -> float | None:
        """Seconds until `expired()` (None while nothing records)."""
        return max(self.max_seconds - (time.perf_counter() - self._started), 0.0) if self.active else None

    def start(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        if self.active:
            raise ProfileStateError("a profile is already recording")
        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])]
        self._prof = profile(activities=activities)
        self._prof.__enter__()
        self._started = time.perf_counter()

    def stop(self) -> dict[str, Any]:
        """Stop recording and write the folder. Returns {"folder", "seconds" (recorded), "gpu_busy_seconds",
        "gpu_idle_seconds" (between compute kernels), "waiting_seconds" (of those, with no request to run),
        "phase_seconds" (the thread's seconds in each `phase` range), "summary" (the headline and the idle report)}."""
        import torch

        if not self.active:
            raise ProfileStateError("no profile is recording")
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the kernels launched so far end inside the trace
        prof, self._prof = self._prof, None
        seconds = time.perf_counter() - self._started
        prof.__exit__(None, None, None)
        self.root.mkdir(parents=True, exist_ok=True)
        taken = (re.fullmatch(r"profile-(\d+)", p.name) for p in self.root.iterdir())
        number = 1 + max((int(m.group(1)) for m in taken if m), default=0)
        folder = self.root / f"profile-{number:03d}"
        folder.mkdir()
        table = prof.key_averages()  # once: a served minute's events take seconds to average
        phases = phase_seconds(table)
        shares = "\n".join(f"  {s * 1e3:9.1f} ms  {100 * s / max(seconds, 1e-9):5.1f}%  {name}"
                            for name, s in sorted(phases.items(), key=lambda kv: -kv[1]))
        def headline(r: IdleReport) -> str:
            line = (f"profiled {seconds:.3f} s of serving, GPU kernels {r.busy_s:.3f} s "
                    f"({100 * r.busy_s / max(seconds, 1e-9):.0f}%); tables and trace in {folder}")
            return line + (f"\nthe thread's time by phase (nested phases count in their parents too):\n{shares}" if shares else "")

        report, line = _write(prof, table, folder, headline, torch.cuda.is_available(), waits=(WAIT_FOR_WORK,))
        return {"folder": str(folder), "seconds": round(seconds, 3), "gpu_busy_seconds": round(report.busy_s, 4),
                "gpu_idle_seconds": round(report.idle_s, 4), "waiting_seconds": round(report.waiting_s, 4),
                "phase_seconds": {name: round(s, 4) for name, s in phases.items()},
                "summary": line + "\n" + report.text()}


def phase_seconds(table) -> dict[str, float]:
    """The host seconds in each `phase` range (names starting with `PHASE_PREFIXES`) of a profile's `key_averages()`
    rows (`.key`, `.cpu_time_total` in microseconds). On CUDA a range also has a device-side row of the same name
    with no host time (torch.profiler's `gpu_user_annotation`): the host row's time is kept, whichever comes first."""
    phases: dict[str, float] = {}
    for e in table:
        if e.key.startswith(PHASE_PREFIXES):
            phases[e.key] = max(phases.get(e.key, 0.0), e.cpu_time_total / 1e6)
    return phases


def main(argv: list[str] | None = None) -> int:
    """`python -m vlmctl.profiling TRACE [TRACE ...]`: print the idle report (`idle_report`) of each Chrome trace.
    Exit code 2 for a file that cannot be read as one."""
    import sys

    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print("usage: python -m vlmctl.profiling TRACE.json[.gz] [...]", file=sys.stderr)
        return 2
    for path in paths:
        try:
            report = idle_report(path)
        except (OSError, ValueError) as exc:  # json's decode error is a ValueError
            print(f"{path}: {exc}", file=sys.stderr)
            return 2
        print(f"{path}\n{report.text()}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
