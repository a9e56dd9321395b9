"""The dry run's printout: host reads per phase with their source lines, then the findings."""

from __future__ import annotations

from collections import Counter

from .record import CAPTURE
from .run import DryRunReport


def print_report(report: DryRunReport) -> None:
    cfg = report.cfg
    print(f"dry run: {report.world_size} rank(s), precision {cfg.run.precision}, layout {cfg.data.input_layout}, "
          f"cuda_graphs {cfg.run.cuda_graphs}, optimizer {cfg.optim.optimizer}/{cfg.optim.implementation} "
          f"({report.optimizer_class}), "
          f"clip {cfg.optim.clip_mode}, sync_every {cfg.run.sync_every}, eval_cuda_graph {cfg.run.eval_cuda_graph}, "
          f"compile {cfg.run.compile_mode} ({report.compiled_graphs} graph(s) compiled), attention {report.attention}; "
          f"{report.captures} capture(s), {report.replays} replay(s)")
    if report.streams or report.event_records:  # counted by the fake device's stand-ins only
        print(f"  streams: {report.streams} side stream(s) made, {report.event_records} event record(s), "
              f"{report.stream_waits} stream wait(s)")
    phases = list(dict.fromkeys(e.phase for e in report.events))
    for phase in phases:
        reads = Counter(e.where for e in report.events if e.phase == phase and e.kind == "read")
        copies = Counter(f"{e.where} {e.detail}" for e in report.events if e.phase == phase and e.kind == "copy")
        fp8 = f", {report.fp8_gemms.get(phase, 0)} FP8 GEMM(s)" if cfg.run.precision == "fp8" else ""
        replays = f", {report.phase_replays.get(phase, 0)} graph replay(s)" if report.captures else ""
        print(f"  {phase}: {sum(reads.values())} host read(s), {sum(copies.values())} host<->device copy(ies){fp8}"
              f"{replays}")
        for where, n in reads.items():
            print(f"    read x{n}  {where}")
    if report.memory is not None:
        for line in report.memory.lines():
            print(f"  {line}")
    if cfg.run.precision == "fp8":
        print(f"  FP8 GEMMs (torch._scaled_mm) inside CUDA-graph captures: {report.fp8_gemms.get(CAPTURE, 0)}")
    if report.peak_step_bytes is not None:
        print(f"  peak device memory of the build and {report.steps} step(s): {report.peak_step_bytes / 2**30:.2f} GiB "
              "(torch.cuda.max_memory_allocated; eval not included)")
    for failure in report.failures:
        print(f"FAIL: {failure}")
    print("dry run: " + ("FAILED" if report.failures else "passed"))
