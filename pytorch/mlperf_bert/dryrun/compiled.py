"""The compiled GPU step of a config, as Inductor generates it, counted on a machine without a GPU.

    python -m mlperf_bert.dryrun.compiled config_DGXH200_1x8.sh [--config_var NAME=VALUE ...]
        [--layers N] [--gpu H200] [--json FILE] [--top 12]

Runs the config's trainer flags (as run_and_time.sh passes them) through the dry run on the fake
CUDA device, BERT-Large shapes, with the encoder layers and the MLM transform compiled by Inductor
for the config's GPU (`inductor.codegen_only`: real code generation for its compute capability
and SM count, nothing compiled or launched), and reports one training step as the GPU would run
it (the last step that ran Python: under CUDA graphs the capture, otherwise the third):

- Dynamo's graphs (modules Inductor generated, forward and backward) and every graph break, with
  where and why: any break fails the command (exit 1);
- generated kernels by kind (pointwise, reduction, persistent reduction, foreach, template) and
  extern kernels (GEMMs, attention, custom ops, aten fallbacks), launches per step;
- the bytes Inductor counts for each generated kernel (its `kernel_num_gb`), summed by kind, and the
  largest kernels; element-wise bytes are the generated kernels' (GEMMs and attention are timed by
  their FLOPs, `tools/plan.py`).

Without --layers the model is traced at 1 and 2 encoder layers and the step is scaled to
BERT-Large's 24 (one layer = the difference; every layer is the same); --layers N traces N.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..runtime.files import output_file
from .kernels import ELEMENTWISE, EXTERN  # free of torch, as this module's top must be (the fake device loads first)

LAYERS = 24  # BERT-Large
STEPS = 3  # a graphed config captures its second step; an eager one runs its third as its second
TOP = 12


@dataclass(frozen=True)
class KernelLine:
    name: str
    kind: str
    bytes: int  # per launch
    launches: int  # per step


@dataclass
class StepKernels:
    """One training step's compiled work (or one layer's: the difference of two steps)."""

    graphs: int = 0  # Dynamo graphs run (their forward modules)
    modules: int = 0  # Inductor modules run: forward, backward (and inference)
    launches: Counter[str] = field(default_factory=Counter)  # kind -> launches
    bytes: Counter[str] = field(default_factory=Counter)  # kind -> bytes Inductor counts
    extern: Counter[str] = field(default_factory=Counter)  # extern kind -> launches
    unknown_bytes: int = 0  # generated-kernel launches without a byte count
    kernels: dict[str, KernelLine] = field(default_factory=dict)  # name -> its line

    @property
    def elementwise_bytes(self) -> int:
        return sum(self.bytes[kind] for kind in ELEMENTWISE)

    @property
    def elementwise_launches(self) -> int:
        return sum(self.launches[kind] for kind in ELEMENTWISE)

    def scaled(self, other: "StepKernels", factor: int) -> "StepKernels":
        """self + factor x other (other: one layer's)."""
        out = StepKernels(self.graphs + factor * other.graphs, self.modules + factor * other.modules)
        for name in ("launches", "bytes", "extern"):
            mine, theirs = getattr(self, name), getattr(other, name)
            setattr(out, name, Counter({k: mine[k] + factor * theirs[k] for k in set(mine) | set(theirs)}))
        out.unknown_bytes = self.unknown_bytes + factor * other.unknown_bytes
        for key in set(self.kernels) | set(other.kernels):
            a, b = self.kernels.get(key), other.kernels.get(key)
            base = a or b
            assert base is not None
            out.kernels[key] = KernelLine(base.name, base.kind, base.bytes,
                                          (a.launches if a else 0) + factor * (b.launches if b else 0))
        return out

    def minus(self, other: "StepKernels") -> "StepKernels":
        return self.scaled(other, -1)


def step_kernels(log: Any, phase: str) -> StepKernels:
    """The kernels the modules that ran in `phase` launched, times their runs."""
    out = StepKernels()
    for module, runs in log.ran(phase):
        out.modules += runs
        out.graphs += runs if module.kind != "backward" else 0
        for launch in module.launches:
            if launch.kind == EXTERN:
                out.extern[launch.extern or "?"] += runs
                continue
            out.launches[launch.kind] += runs
            out.bytes[launch.kind] += runs * (launch.bytes or 0)
            out.unknown_bytes += runs if launch.bytes is None else 0
            key = f"{module.index}:{launch.name}:{launch.bytes}"  # one op's calls differ in size
            seen = out.kernels.get(key)
            out.kernels[key] = KernelLine(launch.name, launch.kind, launch.bytes or 0,
                                          runs + (seen.launches if seen else 0))
    return out


class Phases:
    """What runs now, for the compile log: the recorder's phase, or the n-th CUDA-graph capture (the build
    captures the training step's graph, then the eval's, as `cost.capture_phase` names them)."""

    def __init__(self, recorder: Any) -> None:
        self.recorder, self.captures, self.capturing = recorder, 0, False

    def __call__(self) -> str:
        from .cost import capture_phase

        capturing = self.recorder.in_capture_now()
        if capturing and not self.capturing:
            self.captures += 1
        self.capturing = capturing
        return capture_phase(self.captures) if capturing else self.recorder.phase


def steady_phase(log: Any, steps: int) -> str:
    """The training step as the GPU runs it: the capture that ran a backward (what every replay runs), else the
    last eager step in which compiled modules ran."""
    from .cost import capture_phase

    for n in range(1, 4):
        if any(module.kind == "backward" for module, _ in log.ran(capture_phase(n))):
            return capture_phase(n)
    for i in range(steps, 0, -1):
        if log.ran(f"step {i}"):
            return f"step {i}"
    raise RuntimeError("no compiled module ran in any training step")


@dataclass
class Report:
    config: str
    gpu: str
    precision: str
    fp8_recipe: str | None
    attention: str  # the resolved attention back-end
    layers: int  # of the step reported
    traced_layers: list[int]
    phase: str
    step: StepKernels
    layer: StepKernels | None  # one encoder layer's share (traced at two depths)
    breaks: list[dict[str, Any]]  # each distinct break: where, reason, count (every trace of it)
    modules_compiled: int

    def to_dict(self, top: int) -> dict[str, Any]:
        def part(k: StepKernels) -> dict[str, Any]:
            largest = sorted(k.kernels.values(), key=lambda line: line.bytes * line.launches, reverse=True)[:top]
            return {"dynamo_graphs": k.graphs, "inductor_modules": k.modules,
                    "launches": dict(k.launches), "bytes": dict(k.bytes), "extern": dict(k.extern),
                    "elementwise_launches": k.elementwise_launches, "elementwise_bytes": k.elementwise_bytes,
                    "unknown_bytes_launches": k.unknown_bytes, "largest": [asdict(line) for line in largest]}

        return {"config": self.config, "gpu": self.gpu, "precision": self.precision, "fp8_recipe": self.fp8_recipe,
                "attention": self.attention, "layers": self.layers, "traced_layers": self.traced_layers, "phase": self.phase,
                "graph_breaks": self.breaks, "modules_compiled": self.modules_compiled,
                "step": part(self.step), "layer": part(self.layer) if self.layer is not None else None}


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def format_report(report: Report, top: int) -> list[str]:
    def block(title: str, k: StepKernels) -> list[str]:
        kinds = ", ".join(f"{kind} {k.launches[kind]} ({_gb(k.bytes[kind])})" for kind in sorted(k.launches))
        extern = ", ".join(f"{kind} {n}" for kind, n in sorted(k.extern.items()))
        return [f"{title}: {k.graphs} Dynamo graphs, {k.modules} Inductor modules run",
                f"  generated kernels: {sum(k.launches.values())} launches: {kinds}",
                f"  element-wise: {k.elementwise_launches} launches, {_gb(k.elementwise_bytes)}"
                + (f" ({k.unknown_bytes} launches without a byte count)" if k.unknown_bytes else ""),
                f"  extern kernels: {sum(k.extern.values())} launches: {extern}"]

    lines = [f"compiled step of {report.config} on a fake {report.gpu}: {report.precision}"
             + (f" ({report.fp8_recipe})" if report.precision == "fp8" else "")
             + f", attention {report.attention}, {report.layers} encoder layers" + (f" (scaled from traces at {report.traced_layers})"
                                                      if report.traced_layers != [report.layers] else "")
             + f", {report.phase}; {report.modules_compiled} modules compiled"]
    lines += [f"graph breaks: {sum(b['count'] for b in report.breaks)}"]
    lines += [f"  {b['count']} x {b['where']}: {b['reason']}" for b in report.breaks]
    if report.layer is not None:
        lines += block("one encoder layer", report.layer)
    lines += block("one step", report.step)
    largest = sorted(report.step.kernels.values(), key=lambda line: line.bytes * line.launches, reverse=True)[:top]
    lines.append(f"largest generated kernels per step (bytes x launches):")
    lines += [f"  {_gb(line.bytes * line.launches):>10}  {line.launches:4d} x {line.kind:<20} {line.name}"
              for line in largest]
    return lines


def _config_env(config: Path, variables: Mapping[str, str]) -> dict[str, str]:
    from .shipped import exports

    if not config.is_file():
        raise ValueError(f"{config}: no such config file")
    return {**exports(config), **variables}


def trace(env: Mapping[str, str], layer_counts: list[int], gpu_name: str | None, config_name: str,
          sources: Path | None = None) -> Report:
    """Compiles and runs the config's step at each layer count in one Inductor session (the second reuses the
    first's modules); the report is for the one count, or scaled to 24 layers from two."""
    from ..config.cli import parse_config
    from ..runtime.distributed import dist_env_from
    from .gpus import GPUS, gpu_of_system
    from .inductor import codegen_only
    from .record import Recorder
    from .run import built_run, run_steps
    from .shipped import BERT_LARGE, quick_build, trainer_argv, world_size

    gpu = GPUS[gpu_name] if gpu_name else gpu_of_system(env.get("DGXSYSTEM", ""))
    size = world_size(env)
    denv = dist_env_from({"RANK": "0", "WORLD_SIZE": str(size)})
    steps = []
    with tempfile.TemporaryDirectory(prefix="compiled_") as scratch, codegen_only(gpu) as log:
        folder = Path(scratch)
        argv = trainer_argv(env, folder)
        for layers in layer_counts:
            (folder / "bert_config.json").write_text(json.dumps({**BERT_LARGE, "num_hidden_layers": layers}))
            cfg = parse_config(argv, size)
            if cfg.run.compile_mode == "none":
                raise ValueError(f"{config_name}: COMPILE_MODE=none compiles nothing: choose a compile mode")
            recorder = Recorder()
            log.phase = Phases(recorder)
            log.clear_calls()
            with quick_build(), built_run(cfg, denv, recorder, compile_backend="inductor",
                                                  gpu=gpu) as (run, _):
                run_steps(run, recorder, STEPS)
                attention = run.eval.model.bert.backend
            steps.append(step_kernels(log, steady_phase(log, STEPS)))
        phase = steady_phase(log, STEPS)
        breaks = [{"where": where, "reason": reason, "count": n}
                  for (where, reason), n in Counter((b.where, b.reason) for b in log.breaks).items()]
        modules = len(log.modules)
        if sources is not None:
            for module in log.modules:
                (sources / f"module_{module.index}_{module.kind}.py").write_text(module.source)
    if len(layer_counts) == 2:
        one, two = steps
        layer = two.minus(one)
        step, layers = one.scaled(layer, LAYERS - layer_counts[0]), LAYERS
    else:
        layer, step, layers = None, steps[0], layer_counts[0]
    return Report(config_name, gpu.name, cfg.run.precision, cfg.run.fp8_recipe, attention, layers, layer_counts,
                  phase, step, layer, breaks, modules)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mlperf_bert.dryrun.compiled",
                                description="Inductor's CUDA code for a config's training step, generated on the fake "
                                            "device and counted: graphs, graph breaks, kernels and their bytes.")
    p.add_argument("config", type=Path, help="a config_*.sh file")
    p.add_argument("--config_var", action="append", default=[], metavar="NAME=VALUE",
                   help="change one of the config's variables (repeatable), e.g. PRECISION=fp8")
    p.add_argument("--layers", type=int, default=None,
                   help="trace this many encoder layers (default: 1 and 2, scaled to BERT-Large's 24)")
    p.add_argument("--gpu", default=None, help="the GPU to generate code for (default: the config's DGXSYSTEM's)")
    p.add_argument("--json", type=output_file, default=None, metavar="FILE",
                   help="write the report here as JSON too (its folder is made)")
    p.add_argument("--top", type=int, default=TOP, help=f"largest kernels listed (default {TOP})")
    p.add_argument("--sources", type=Path, default=None, metavar="DIR",
                   help="write each generated module's code here (module_N_KIND.py), to read its kernels")
    return p.parse_args(argv)


def _variables(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise ValueError(f"--config_var {pair!r}: expected NAME=VALUE")
        out[name] = value
    return out


def main(argv: list[str] | None = None) -> int:
    opts = parse(sys.argv[1:] if argv is None else argv)
    from .native import load

    load()  # before torch is imported
    from .gpus import GPUS
    from .inductor import triton_problem

    problems = []
    if opts.layers is not None and opts.layers < 1:
        problems.append(f"--layers {opts.layers}: trace at least one layer")
    if opts.gpu is not None and opts.gpu not in GPUS:
        problems.append(f"--gpu {opts.gpu}: one of {sorted(GPUS)}")
    if opts.sources is not None:
        opts.sources.mkdir(parents=True, exist_ok=True)
    try:
        env = _config_env(opts.config, _variables(opts.config_var))
    except ValueError as err:
        problems.append(str(err))
        env = {}
    problems += [p for p in (triton_problem(),) if p]
    if problems:
        for problem in problems:
            print(f"compiled step: {problem}", file=sys.stderr)
        return 2
    from ..config.settings import ConfigError

    try:
        report = trace(env, [opts.layers] if opts.layers else [1, 2], opts.gpu, opts.config.name, opts.sources)
    except (ConfigError, ValueError) as refused:
        print(f"compiled step: {refused}", file=sys.stderr)
        return 2
    print("\n".join(format_report(report, opts.top)))
    if opts.json is not None:
        opts.json.write_text(json.dumps(report.to_dict(opts.top), indent=1) + "\n")
    if report.breaks:
        print(f"compiled step: {len(report.breaks)} distinct graph break(s): every compiled region must be one graph",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    sys.exit(main())
