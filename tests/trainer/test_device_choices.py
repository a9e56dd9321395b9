"""Every choice a device may not serve is refused at start-up with one line (exit 2, nothing written):
--device against the GPUs a node shows, --precision against the GPU's tensor cores, and the whole set
`startup.device_problems` walks. What only a run can find ends it with one line, exit 2 and run_stop
aborted in its MLPerf log. GPUs are described through torch.cuda's functions (no GPU needed)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch._inductor import cpp_builder

from mlperf_bert.config.settings import ConfigError
from mlperf_bert.hooks.events import Hook, StepEnd
from mlperf_bert.main import main
from mlperf_bert.model import attention
from mlperf_bert.model.attention import resolve_backend
from mlperf_bert.model.bert import BertConfig
from mlperf_bert.model.compiling import TRITON_INSTALL, compile_problem
from mlperf_bert.config.settings import PRECISIONS
from mlperf_bert.model.precision import precision_problem
from mlperf_bert.runtime.distributed import DistEnv
from mlperf_bert.startup import check_device_request, device_problems
from tests.harness.broken_packages import BREAKAGES, write_package
from tests.harness.demo import trainer_args

# GPUs by compute capability: what each lacks.
GPUS = {"V100": (7, 0), "T4": (7, 5), "A100": (8, 0), "L4": (8, 9), "H100": (9, 0)}


def describe_gpus(monkeypatch: pytest.MonkeyPatch, count: int, capability: tuple[int, int] = (9, 0),
                  name: str = "NVIDIA H100") -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


@pytest.mark.parametrize("gpu", GPUS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_every_precision_on_every_gpu_generation(monkeypatch: pytest.MonkeyPatch, gpu: str, precision: str) -> None:
    describe_gpus(monkeypatch, 1, GPUS[gpu], f"NVIDIA {gpu}")
    problem = precision_problem(precision, torch.device("cuda", 0))
    if precision == "bf16" and GPUS[gpu] < (8, 0):
        assert problem == (f"--precision bf16 needs bf16 tensor cores (compute capability >= 8.0: Ampere or newer), "
                           f"but NVIDIA {gpu} is {GPUS[gpu][0]}.{GPUS[gpu][1]}: use --precision fp16 or fp32 on this "
                           "GPU")
    else:
        assert problem is None  # fp8's own limit (8.9) is `fp8_unavailable`'s
    assert precision_problem(precision, torch.device("cpu")) is None  # the CPU runs (or emulates) them all


def _denv(local_world: int) -> DistEnv:
    return DistEnv(0, local_world, 0, local_world, "127.0.0.1", 29500)


@pytest.mark.parametrize("requested, gpus, ranks, refused", [
    ("cuda", 0, 1, "--device cuda, but no CUDA device is visible here"),
    ("cuda", 4, 8, "8 ranks on this node, but it shows 4 GPUs: start at most 4 (DGXNGPU, torchrun's "
                   "--nproc_per_node), one rank per GPU"),
    ("auto", 2, 3, "3 ranks on this node, but it shows 2 GPUs"),
    ("cuda", 8, 8, None), ("auto", 4, 2, None),
    ("cuda", 1, 8, None),  # a launcher that gives each rank its own GPU: each sees one
    ("auto", 0, 8, None), ("cpu", 2, 8, None),  # CPU ranks need no GPU each
])
def test_the_device_request_against_the_gpus_of_the_node(monkeypatch: pytest.MonkeyPatch, requested: str, gpus: int,
                                                         ranks: int, refused: str | None) -> None:
    describe_gpus(monkeypatch, gpus)
    if refused is None:
        check_device_request(requested, _denv(ranks))
        return
    with pytest.raises(ConfigError) as err:
        check_device_request(requested, _denv(ranks))
    assert str(err.value).startswith(refused)


def _cfg(demo_data: Path, tmp_path: Path, *flags: str):
    from mlperf_bert.config.cli import build_parser, config_from_args

    return config_from_args(build_parser().parse_args(trainer_args(demo_data, tmp_path, "--do_train", *flags)), 1)


@pytest.mark.parametrize("flags, gpu, refused", [
    (["--attention_backend", "varlen"], None, "--attention_backend varlen runs GPU kernels only"),
    (["--attention_backend", "varlen_cudnn"], None, "--attention_backend varlen_cudnn runs GPU kernels only"),
    (["--optimizer_impl", "apex"], None, "--optimizer_impl apex runs apex's CUDA kernels"),
    (["--precision", "bf16"], "V100", "--precision bf16 needs bf16 tensor cores"),
    (["--precision", "fp8"], "A100", "--precision fp8 needs FP8 tensor cores"),
    (["--precision", "fp32", "--attention_backend", "varlen"], "H100", "--attention_backend varlen takes fp16 / bf16"),
    (["--precision", "fp16", "--attention_backend", "varlen"], "T4", "--attention_backend varlen needs a GPU of "
                                                                     "compute capability >= 8.0"),
    (["--precision", "fp16"], "V100", None), (["--precision", "bf16"], "A100", None), ([], None, None),
])
def test_start_up_walks_every_choice_against_the_device(demo_data: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch, flags: list[str],
                                                       gpu: str | None, refused: str | None) -> None:
    if gpu is not None:
        describe_gpus(monkeypatch, 1, GPUS[gpu], f"NVIDIA {gpu}")
    cfg = _cfg(demo_data, tmp_path, *flags)
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    bert = BertConfig.from_json(demo_data / "bert_config.json")
    problems = [p for p in device_problems(cfg, bert, device) if p is not None]
    assert (problems[0] if problems else None) == refused or problems[0].startswith(refused), problems


# Each threshold at the compute capability it names and just below it: varlen and bf16 from 8.0 (A100), fp8 from
# 8.9 (L4), in every precision they take (flags, capability, what start-up refuses or None).
THRESHOLDS = [
    (["--precision", "bf16", "--attention_backend", "varlen"], (8, 0), None),
    (["--precision", "fp16", "--attention_backend", "varlen"], (8, 0), None),
    (["--precision", "fp16", "--attention_backend", "varlen"], (7, 9), "--attention_backend varlen needs a GPU of "
                                                                       "compute capability >= 8.0 (Ampere or newer), "
                                                                       "but NVIDIA X is 7.9"),
    (["--precision", "bf16"], (8, 0), None),
    (["--precision", "bf16"], (7, 9), "--precision bf16 needs bf16 tensor cores (compute capability >= 8.0"),
    (["--precision", "fp8", "--fp8_recipe", "delayed", "--attention_backend", "varlen"], (8, 9), None),
    (["--precision", "fp8"], (8, 9), None),
    (["--precision", "fp8", "--fp8_recipe", "delayed"], (8, 8), "--precision fp8 needs FP8 tensor cores (compute "
                                                                "capability >= 8.9: Ada, Hopper, Blackwell), but "
                                                                "NVIDIA X is 8.8"),
    (["--precision", "fp8"], (8, 8), "--precision fp8 needs FP8 tensor cores"),
]


@pytest.mark.parametrize("flags, capability, refused", THRESHOLDS)
def test_each_device_threshold_at_its_boundary_and_just_below(demo_data: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch, flags: list[str],
                                                               capability: tuple[int, int],
                                                               refused: str | None) -> None:
    describe_gpus(monkeypatch, 1, capability, "NVIDIA X")
    monkeypatch.setattr(attention, "_flash_attn_varlen", lambda: None)
    monkeypatch.setattr(attention, "flash_kernel_available", lambda: True)  # torch's kernel, as a CUDA build has
    cfg = _cfg(demo_data, tmp_path, *flags)
    bert = BertConfig.from_json(demo_data / "bert_config.json")
    problems = [p for p in device_problems(cfg, bert, torch.device("cuda", 0)) if p is not None]
    assert problems == [] if refused is None else problems[0].startswith(refused), problems
    if "varlen" in flags and refused is None:  # auto takes the varlen kernels from the threshold on
        assert resolve_backend("auto", torch.device("cuda", 0), 64, precision=flags[1], head_dim=bert.head_dim) \
            == "varlen"


@pytest.mark.parametrize("mode", ["default", "max-autotune-no-cudagraphs"])
def test_compiling_needs_triton_on_a_gpu_and_a_cpp_compiler_on_the_cpu(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      mode: str) -> None:
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert compile_problem("none", gpu) is None and compile_problem("none", cpu) is None
    monkeypatch.setitem(sys.modules, "triton", None)  # not installed
    assert compile_problem(mode, gpu) == (f"--compile_mode {mode} on a GPU needs Triton, which is not installed: "
                                          f"{TRITON_INSTALL}, or use --compile_mode none")
    monkeypatch.delitem(sys.modules, "triton")
    monkeypatch.syspath_prepend(str(write_package(tmp_path, "triton", BREAKAGES["ImportError"])))
    problem = compile_problem(mode, gpu)
    assert problem is not None and "needs Triton, which is installed but fails to import (ImportError: " in problem
    assert compile_problem(mode, cpu) is None  # this machine has g++

    def no_compiler() -> None:
        raise RuntimeError("Could not find a C++ compiler (tried g++, clang++)")

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", no_compiler)
    assert compile_problem(mode, cpu) == (
        f"--compile_mode {mode} on the CPU compiles C++ kernels, but Inductor finds no C++ compiler (RuntimeError: "
        "Could not find a C++ compiler (tried g++, clang++)): install g++ (or set CXX to one), or use --compile_mode "
        "none")


class FailsAtStep(Hook):
    """A problem only the run can find (a bad value in a shard it reads), at one step."""

    def step_end(self, event: StepEnd) -> None:
        if event.step == 2:
            raise ValueError("part_00001.hdf5: row 7 has a token id past the vocabulary: fix the shard")


def test_a_problem_found_only_while_training_is_one_line_exit_2_and_run_stop_aborted(demo_data: Path, tmp_path: Path,
                                                                                    capsys: pytest.CaptureFixture
                                                                                    ) -> None:
    code = main(trainer_args(demo_data, tmp_path, "--do_train"), hooks=[FailsAtStep()])
    assert code == 2
    assert capsys.readouterr().err.splitlines()[-1] == ("error: part_00001.hdf5: row 7 has a token id past the "
                                                        "vocabulary: fix the shard")
    events = [json.loads(line.split(":::MLLOG ", 1)[1]) for line in (tmp_path / "mlperf.log").read_text().splitlines()]
    keys = [e["key"] for e in events]
    assert "run_start" in keys and keys[-1] == "run_stop" and keys.count("run_stop") == 1
    # the samples of the last step the log's hook saw (step 1: the failing hook runs before it at step 2)
    assert (events[-1]["metadata"]["status"], events[-1]["metadata"]["epoch_num"]) == ("aborted", 8)


@pytest.mark.parametrize("recipe, refused", [("delayed", False), ("tensorwise", True), ("rowwise", True)])
def test_start_up_asks_for_torchao_only_for_its_own_recipes(demo_data: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch, recipe: str,
                                                          refused: bool) -> None:
    """The delayed recipe is this repository's own (torch._scaled_mm): without torchao it still trains."""
    from mlperf_bert.model import fp8

    monkeypatch.setattr(fp8, "torchao_missing", lambda: "torchao does not import: pip install torchao")
    cfg = _cfg(demo_data, tmp_path, "--precision", "fp8", "--fp8_recipe", recipe)
    bert = BertConfig.from_json(demo_data / "bert_config.json")
    problems = [p for p in device_problems(cfg, bert, torch.device("cpu")) if p is not None]
    assert problems == (["torchao does not import: pip install torchao"] if refused else [])


@pytest.mark.parametrize("head_dim, runs", [(256, True), (264, False), (248, True), (252, False), (64, True)])
def test_varlen_takes_head_sizes_up_to_256_in_steps_of_8(monkeypatch: pytest.MonkeyPatch, head_dim: int,
                                                         runs: bool) -> None:
    """The flash kernels' limit itself (256) runs; one step past it, or off the step of 8, is refused."""
    describe_gpus(monkeypatch, 1, (9, 0), "NVIDIA H100")
    monkeypatch.setattr(attention, "flash_kernel_available", lambda: True)
    problem = attention.backend_problem("varlen", attention.AttentionNeeds(torch.device("cuda", 0), "bf16", head_dim, 0.1))
    assert (problem is None) == runs, problem
    assert runs or problem.startswith("--attention_backend varlen takes head sizes up to 256 in steps of 8")
