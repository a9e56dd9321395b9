"""Runs small programs on the fake CUDA device and prints what the recorder saw, as JSON.

Its own process: the fake device must be loaded before torch is imported, and the test
process has torch already.
"""

from __future__ import annotations

import json
import sys

from mlperf_bert.dryrun.native import load

load()

import torch  # noqa: E402  (after the fake CUDA device)

from mlperf_bert.dryrun import cuda_standins  # noqa: E402
from mlperf_bert.dryrun.run import _FakeCudaMode, built_run  # noqa: E402
from mlperf_bert.dryrun.record import Recorder  # noqa: E402


def program() -> None:
    """A capture with a host read and a host->device copy inside, then the same outside."""
    weights = torch.ones(4, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        flag = (weights.sum() > 0).item()  # host read inside the capture
        weights.copy_(torch.ones(4))  # host tensor copied in inside the capture
    graph.replay()
    torch.cuda.synchronize()
    sums = torch.stack([weights.sum(), weights.amax()]).tolist()  # one read of two values
    assert flag is False and len(sums) == 2
    assert weights.device.type == "cuda" and weights.shape == (4,)


def built_optimizer() -> None:
    """`build_run` of the trainer flags after argv[2] with apex importable (faked): prints the step's optimizer."""
    import pytest

    from tests.harness.fakes import apex as fake_apex
    from mlperf_bert.config.cli import parse_config
    from mlperf_bert.runtime.distributed import DistEnv

    fake_apex.install(pytest.MonkeyPatch())
    cfg = parse_config(sys.argv[2:], 1)
    with built_run(cfg, DistEnv(0, 1, 0, 1, "127.0.0.1", 0), Recorder(phase="build")) as (run, _):
        print(json.dumps({"optimizer": type(run.step.optimizer).__name__, "step": type(run.step).__name__}))


def scaled_step() -> None:
    """An fp16 step with DeviceLossScaler, captured in a graph: forward, backward, step, update."""
    from mlperf_bert.optim.capturable import capturable
    from mlperf_bert.optim.loss_scale import DeviceLossScaler
    from mlperf_bert.optim.optimizers import build_optimizer, parameter_groups

    model = torch.nn.Linear(8, 4, device="cuda")
    optimizer = capturable(build_optimizer(parameter_groups(model, 0.01), "lamb", 1e-3, (0.9, 0.999), 1e-6,
                                           0.01, 1.0, "foreach"))
    scaler = DeviceLossScaler("cuda")
    x = torch.randn(2, 8, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).float().square().mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    graph.replay()
    scaler.read()  # the window's one read: scale and step counts together


PROGRAMS = {"program": program, "scaled_step": scaled_step}


def main() -> None:
    if sys.argv[1:2] == ["built_optimizer"]:  # the dry run's own recorder and fake device
        built_optimizer()
        return
    recorder = Recorder(phase="probe")
    with cuda_standins.install(recorder) as log, _FakeCudaMode.make(), recorder:
        PROGRAMS[sys.argv[1] if len(sys.argv) > 1 else "program"]()
    events = [{"kind": e.kind, "where": e.where, "in_capture": e.in_capture, "values": e.values, "detail": e.detail}
              for e in recorder.events]
    json.dump({"events": events, "captures": log.captures, "replays": log.replays, "syncs": len(log.syncs)},
              sys.stdout)


if __name__ == "__main__":
    main()
