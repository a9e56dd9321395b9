"""The fake-CUDA dry run: the trainer's GPU path for every shipped GPU config, without a GPU.

The shipped configs go through `run_and_time.sh` itself, each dry run its own process (the fake
device must load before torch) standing in for the trainer's Python, so the flags checked are
exactly the ones a real run gets. The tests of single flags send their dry runs to one process
of the module (`tests/harness/served.py`), `python -m mlperf_bert.dryrun`'s main one after the other, as the
planner traces every shipped config in one process.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Iterator

import pytest

from mlperf_bert.dryrun.native import NativeBuildError, load
from mlperf_bert.dryrun.shipped import executable, exports, launch_env
from tests.harness.commands import run_cli
from tests.harness.paths import REPO
from tests.harness.served import Served

PROBE = "tests.harness.workers.dryrun_probe"  # its own process: the fake device loads before torch
GPU_CONFIGS = sorted(p.name for p in REPO.glob("config_*.sh") if "export DEVICE=cpu" not in p.read_text())
TINY_BERT = {"vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
             "intermediate_size": 64, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
             "attention_probs_dropout_prob": 0.1, "max_position_embeddings": 512, "type_vocab_size": 2,
             "initializer_range": 0.02}


def _dry_run_env(tmp_path: Path, config: Path) -> dict[str, str]:
    """The config's variables, tiny model and data folders, one process as rank 0 of the full world."""
    wrapper = executable(tmp_path / "python",
                         f"#!/bin/bash\nexec {sys.executable} -m mlperf_bert.dryrun --steps 3 -- \"$@\"\n")
    return launch_env(exports(config), tmp_path, TINY_BERT, wrapper)


# FP8 GEMMs of one training step of TINY_BERT: 2 layers x 6 linears x 3 (forward, input and weight gradients).
FP8_GEMMS_PER_STEP = 2 * 6 * 3
FP8_GEMMS_PER_EVAL_BATCH = 2 * 6


def _extra_reads(output: str) -> set[str]:
    found = re.search(r"FAIL: \d+ host reads in \d+ steps, more than .*?: (.*)", output)
    reads = set(found.group(1).split("; ")) if found else set()
    return {read for read in reads if not re.fullmatch(r"mlperf_bert/train/faults\.py:\d+ \(agree\)", read)}


# Through run_and_time.sh and the dry run's command line, one config of each kind of step (layout, training
# graphs, sharded optimizer): the H100, B200 and GB200 configs take the H200's step at other sizes. Every
# shipped GPU config is also dry-run at BERT-Large shapes by the planner, with the same findings refused
# (tests/tools/planning/test_plan.py, test_traced_dry_runs_raise_no_findings).
STEP_KINDS = ["config_DGXH200_1x8.sh", "config_DGXA100_1x8.sh", "config_DGXA100_128x8.sh", "config_SamsungA100_128x8.sh"]


def _step_kind(config: str) -> tuple[str | None, ...]:
    variables = exports(REPO / config)
    return tuple(variables.get(name) for name in ("INPUT_LAYOUT", "CUDA_GRAPHS", "DIST_OPTIMIZER", "EVAL_CUDA_GRAPH",
                                                  "PRECISION", "COMPILE_MODE"))


def test_each_kind_of_shipped_step_is_dry_run_through_the_launcher() -> None:
    """A new config with a step of its own kind (an FP8 one, an eager packed one) joins STEP_KINDS or fails here."""
    assert {_step_kind(c) for c in GPU_CONFIGS} == {_step_kind(c) for c in STEP_KINDS}


@pytest.mark.parametrize("config", STEP_KINDS)
def test_shipped_config_dry_runs_on_fake_cuda(config: str, tmp_path: Path) -> None:
    result = run_cli(["bash", "run_and_time.sh"], env=_dry_run_env(tmp_path, REPO / config), timeout=300)
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output
    assert re.search(r"step 3: \d+ host read", output) and "eval:" in output, output
    assert "inside a CUDA-graph capture" not in output, output
    assert re.search(r"memory per device: training peak \d+\.\d+ GiB, eval peak", output), output
    # DIST_OPTIMIZER=1 reaches the trainer: the sharded step's reduce-scatter, partial-norm all-reduces
    # and all-gather ran on the fake process group at the config's full world size (inside the graph too).
    sharded = re.search(r"optimizer \S+ \((\w*Sharded\w+)\)", output)
    assert (sharded is not None) == (exports(REPO / config).get("DIST_OPTIMIZER") == "1"), output
    assert not _extra_reads(output), output
    assert result.returncode == 0, output
    variables = exports(REPO / config)
    # COMPILE_MODE reaches the trainer, whose layers the dry run traces (Dynamo and AOTAutograd, aot_eager)
    compiled = re.search(rf"compile {variables.get('COMPILE_MODE', 'none')} \((\d+) graph\(s\) compiled\),", output)
    assert compiled, output
    # Dynamo compiles the layers under the dry run's watching modes (they are infrastructure modes): a plain
    # dispatch mode would make every "compiled" layer run eagerly and show 0 here
    assert (int(compiled.group(1)) > 0) == (variables.get("COMPILE_MODE", "none") != "none"), output
    if variables.get("EVAL_CUDA_GRAPH") == "1":  # captured at build; the eval replays it, its read is the totals'
        captures = re.search(r"; (\d+) capture\(s\)", output)
        assert captures and int(captures.group(1)) == 1 + (variables["CUDA_GRAPHS"] == "1"), output
        evaluation = re.search(r"eval: (\d+) host read\(s\), .* (\d+) graph replay\(s\)", output)
        assert evaluation and evaluation.group(1) == "1" and int(evaluation.group(2)) >= 1, output
        assert re.search(r"build: .* 0 graph replay\(s\)", output), output
    if variables["PRECISION"] == "fp8":  # the FP8 GEMMs are in the graphs (run.findings fails without)
        captured = re.search(r"FP8 GEMMs \(torch\._scaled_mm\) inside CUDA-graph captures: (\d+)", output)
        eval_graph = FP8_GEMMS_PER_EVAL_BATCH if variables.get("EVAL_CUDA_GRAPH") == "1" else 0
        assert captured and int(captured.group(1)) == FP8_GEMMS_PER_STEP + eval_graph, output
        assert not eval_graph or re.search(r"eval: .* 0 FP8 GEMM", output), output  # replayed, none eager


def test_recorder_catches_reads_and_copies_inside_a_capture() -> None:
    result = run_cli([sys.executable, "-m", PROBE])
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    read_in, copy_in, read_after = seen["events"]
    assert read_in["kind"] == "read" and read_in["in_capture"] and read_in["where"].endswith(":28 (program)")
    assert copy_in["kind"] == "copy" and copy_in["in_capture"] and copy_in["detail"] == "cpu->cuda"
    assert read_after["kind"] == "read" and not read_after["in_capture"] and read_after["values"] == 2
    assert (seen["captures"], seen["replays"], seen["syncs"]) == (1, 1, 1)


def test_device_loss_scaler_captures_without_host_reads() -> None:
    result = run_cli([sys.executable, "-m", PROBE, "scaled_step"])
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen["captures"] == 1
    assert not [e for e in seen["events"] if e["in_capture"]], seen
    reads = [e for e in seen["events"] if e["kind"] == "read"]
    assert len(reads) == 1 and reads[0]["values"] == 4, reads  # DeviceLossScaler.read(): one read, four values
    assert reads[0]["where"].startswith("mlperf_bert/optim/loss_scale.py:") and reads[0]["where"].endswith("(read)")


def _base_flags(tmp_path: Path) -> list[str]:
    (tmp_path / "bert_config.json").write_text(json.dumps(TINY_BERT))
    return ["--input_dir", str(tmp_path), "--eval_dir", str(tmp_path), "--output_dir", str(tmp_path / "out"),
            "--bert_config_path", str(tmp_path / "bert_config.json"), "--do_train", "--max_steps", "100",
            "--learning_rate", "1e-3", "--train_batch_size", "2", "--max_seq_length", "128",
            "--max_predictions_per_seq", "20", "--device", "cuda", "--submission_division", "open"]


@pytest.fixture(scope="module")
def dry_runs() -> Iterator[Served]:
    """The single-flag tests' dry runs, one process for the module (tests/harness/served.py): these tests are
    about the steps' host reads, captures and GEMMs; the command's own start-up is the launcher-level
    tests' above."""
    runs = Served("dryrun")
    yield runs
    runs.close()


def _dry_run(dry_runs: Served, tmp_path: Path, *flags: str, world_size: int = 1) -> tuple[int, str]:
    argv = ["--steps", "3", "--", *_base_flags(tmp_path), *flags]
    done = dry_runs.run(argv, tmp_path / "dry_run.txt", env={"WORLD_SIZE": str(world_size), "RANK": "0"})
    return done.returncode, done.stdout


@pytest.mark.parametrize("graphs, optimizer, step", [([], "FusedLAMB", "EagerStep"),
                                                     (["--cuda_graphs"], "CapturableLamb", "GraphedStep")])
def test_build_run_with_apex_picks_a_graph_safe_optimizer_under_cuda_graphs(
        tmp_path: Path, graphs: list[str], optimizer: str, step: str) -> None:
    """--optimizer_impl auto with apex importable: apex for eager steps, foreach (then its capturable twin) for graphs."""
    flags = [*_base_flags(tmp_path), "--precision", "bf16", "--input_layout", "packed", "--optimizer_impl", "auto",
             *graphs]
    result = run_cli([sys.executable, "-m", PROBE, "built_optimizer", *flags])
    assert result.returncode == 0, result.stderr
    built = json.loads(result.stdout.splitlines()[-1])
    assert built == {"optimizer": optimizer, "step": step}, result.stdout


def test_fp16_eager_step_without_a_window_reads_the_device_four_times(dry_runs: Served, tmp_path: Path) -> None:
    """--sync_every 1: the guard's agreement, then GradScaler's scale and found-inf reads."""
    code, output = _dry_run(dry_runs, tmp_path, "--precision", "fp16")
    assert code == 1, output
    assert output.count("step 2: 4 host read(s)") == 1, output
    step_2 = output.split("step 2:")[1].split("step 3:")[0]
    assert re.search(r"faults\.py:\d+ \(agree\)", step_2), output
    assert len(re.findall(r"step\.py:\d+ \(apply_update\)", step_2)) == 3, output


def _reads_per_step(output: str) -> list[str]:
    return re.findall(r"step \d+: (\d+) host read", output)


@pytest.mark.parametrize("world_size", [1, 8])
def test_fp16_with_a_window_reads_the_device_once_per_window(dry_runs: Served, tmp_path: Path,
                                                             world_size: int) -> None:
    """The device loss scaler: no read per step; its counts come with the window's agreement."""
    code, output = _dry_run(dry_runs, tmp_path, "--precision", "fp16", "--input_layout", "unpadded", "--sync_every",
                            "3",
                            "--clip_mode", "before_allreduce", world_size=world_size)
    assert code == 0, output
    assert _reads_per_step(output) == ["0", "0", "1"], output
    assert re.search(r"read x1  mlperf_bert/train/faults\.py:\d+ \(agree\)", output), output


def test_graphed_packed_step_captures_once_and_reads_once_per_window(dry_runs: Served, tmp_path: Path) -> None:
    code, output = _dry_run(dry_runs, tmp_path, "--precision", "bf16", "--input_layout", "packed", "--cuda_graphs",
                            "--sync_every", "3")
    assert code == 0, output
    assert "1 capture(s), 3 replay(s)" in output
    assert _reads_per_step(output) == ["0", "0", "1"], output


@pytest.mark.parametrize("flags, world_size", [
    (["--precision", "fp16", "--clip_mode", "bucketwise"], 8),
    (["--precision", "bf16", "--clip_mode", "before_allreduce", "--gradient_accumulation_steps", "2",
      "--train_batch_size", "4"], 8),
    (["--precision", "fp16", "--gradient_accumulation_steps", "2", "--train_batch_size", "4"], 1),
    (["--precision", "fp16", "--clip_mode", "bucketwise", "--distributed_optimizer", "--gradient_accumulation_steps",
      "2", "--train_batch_size", "4"], 8),
])
def test_graphed_steps_of_many_ranks_fp16_and_accumulation_capture_once(dry_runs: Served, tmp_path: Path,
                                                                         flags: list[str], world_size: int) -> None:
    code, output = _dry_run(dry_runs, tmp_path, "--input_layout", "packed", "--cuda_graphs", "--sync_every", "3",
                            *flags, world_size=world_size)
    assert code == 0, output
    assert "1 capture(s), 3 replay(s)" in output and "inside a CUDA-graph capture" not in output, output
    assert _reads_per_step(output) == ["0", "0", "1"], output
    assert ("(CapturableShardedLamb)" in output) == ("--distributed_optimizer" in flags), output


def test_distributed_optimizer_with_fp16_eager_steps_scales_on_the_device(dry_runs: Served, tmp_path: Path) -> None:
    """fp16 + --distributed_optimizer without a graph or a window: the loss scaler is the device one (a
    sharded step's skip is agreed on the device; GradScaler would decide on one rank's gradient)."""
    code, output = _dry_run(dry_runs, tmp_path, "--precision", "fp16", "--input_layout", "unpadded", "--clip_mode",
                            "after_allreduce", "--distributed_optimizer", world_size=8)
    assert code == 0, output
    assert "(CapturableShardedLamb)" in output, output


def test_flags_the_trainer_refuses_end_with_its_message(dry_runs: Served, tmp_path: Path) -> None:
    code, output = _dry_run(dry_runs, tmp_path, "--cuda_graphs", "--input_layout", "unpadded")
    assert code == 2 and "the trainer refuses these flags: --cuda_graphs needs static shapes" in output, output


def test_fake_device_must_load_before_torch() -> None:
    import torch  # noqa: F401  (this process's torch has settled on its devices)

    with pytest.raises(NativeBuildError, match="torch is already imported"):
        load()


def test_padded_layout_unpads_with_host_reads(dry_runs: Served, tmp_path: Path) -> None:
    """Boolean indexing on the device is a host read of the output size: found, with its lines."""
    code, output = _dry_run(dry_runs, tmp_path, "--precision", "bf16", "--input_layout", "padded", "--sync_every", "10")
    assert code == 1, output
    step_1 = output.split("step 1:")[1].split("step 2:")[0]
    assert step_1.startswith(" 6 host read(s)") and step_1.count("mlperf_bert/data/batch.py:") == 6, output


@pytest.mark.parametrize("flags, world_size", [
    (["--input_layout", "unpadded"], 2),
    (["--input_layout", "packed", "--cuda_graphs", "--sync_every", "3"], 1),
    (["--input_layout", "packed", "--cuda_graphs", "--sync_every", "3", "--distributed_optimizer"], 8),
])
def test_fp8_steps_reach_scaled_mm_on_fake_cuda(dry_runs: Served, tmp_path: Path, flags: list[str],
                                                world_size: int) -> None:
    """torchao's Float8Linear on 'cuda' (capability 9.0) calls torch._scaled_mm, not its emulation, in
    eager steps of any token count and inside the captured step, on one rank and many (the shipped fp8
    configs add graphed steps at 8 ranks), the sharded optimizer's step captured with them."""
    code, output = _dry_run(dry_runs, tmp_path, "--precision", "fp8", *flags, world_size=world_size)
    assert code == 0, output
    gemms = [int(n) for n in re.findall(r"step \d+: .* (\d+) FP8 GEMM", output)]
    captured = int(re.search(r"inside CUDA-graph captures: (\d+)", output).group(1))  # type: ignore[union-attr]
    if "--cuda_graphs" in flags:
        assert gemms == [0, 0, 0] and captured == FP8_GEMMS_PER_STEP, output  # replays run the captured ones
        assert "inside a CUDA-graph capture at" not in output, output
    else:
        assert gemms == [FP8_GEMMS_PER_STEP] * 3 and captured == 0, output
    assert re.search(rf"eval: .* {FP8_GEMMS_PER_EVAL_BATCH} FP8 GEMM", output), output  # one eval batch
    assert ("(CapturableShardedLamb)" in output) == ("--distributed_optimizer" in flags), output


# The delayed recipe's GEMMs per step: query, key and value as one stacked GEMM, so 4 linears per layer x 3.
DELAYED_GEMMS_PER_STEP = 2 * 4 * 3


@pytest.mark.parametrize("layers, gemms", [("encoder", DELAYED_GEMMS_PER_STEP), ("ffn", 2 * 2 * 3)])
def test_delayed_fp8_recipe_calls_scaled_mm_inside_the_captured_step(dry_runs: Served, tmp_path: Path, layers: str,
                                                                     gemms: int) -> None:
    """--fp8_recipe delayed (model/fp8_delayed.py) calls torch._scaled_mm itself: in the captured step, with
    the stacked query/key/value GEMM, and only the FFN's two linears under --fp8_layers ffn."""
    code, output = _dry_run(dry_runs, tmp_path, "--precision", "fp8", "--fp8_recipe", "delayed", "--fp8_layers", layers,
                            "--input_layout", "packed", "--cuda_graphs", "--sync_every", "3")
    assert code == 0, output
    captured = int(re.search(r"inside CUDA-graph captures: (\d+)", output).group(1))  # type: ignore[union-attr]
    assert captured == gemms, output
    assert "inside a CUDA-graph capture at" not in output, output


def test_delayed_fp8_recipe_takes_token_counts_that_are_not_multiples_of_16(dry_runs: Served, tmp_path: Path) -> None:
    """Unpadded batches hold any number of tokens: the weight gradient's inner dimension is padded to the
    multiple of 16 that torch._scaled_mm asks for (its checks run on the fake device as on a GPU)."""
    code, output = _dry_run(dry_runs, tmp_path, "--precision", "fp8", "--fp8_recipe", "delayed", "--input_layout",
                            "unpadded")
    assert code == 0, output
    assert [int(n) for n in re.findall(r"step \d+: .* (\d+) FP8 GEMM", output)] == [DELAYED_GEMMS_PER_STEP] * 3, output


def test_grouped_attention_runs_its_groups_on_side_streams_without_host_reads(dry_runs: Served,
                                                                             tmp_path: Path) -> None:
    """Sequences of 128 to 512 tokens fall in several length groups: each group is ordered after
    q/k/v by an event and the layer waits for each group's event, and the groups are learnt
    from the host's lengths, so the steps read the device only at the window's agreement."""
    code, output = _dry_run(dry_runs, tmp_path, "--precision", "bf16", "--input_layout", "unpadded", "--sync_every",
                            "3",
                            "--attention_backend", "grouped", "--max_seq_length", "512", "--train_batch_size", "8")
    assert code == 0, output
    assert "attention grouped;" in output, output
    streams, records, waits = map(int, re.search(
        r"streams: (\d+) side stream\(s\) made, (\d+) event record\(s\), (\d+) stream wait\(s\)", output).groups())
    # The prefetcher's copy stream, then one per group up to the pool's size (five for four bounds).
    assert 3 <= streams <= 6, output
    # Per layer and forward: one event after q/k/v plus one per group; two waits per group.
    assert records >= 2 * 4 * 3 and waits > records, output
    assert _reads_per_step(output) == ["0", "0", "1"], output
    assert "mlperf_bert/model/" not in output, output  # no read of the model's, in training or eval



def test_packed_step_on_the_cudnn_kernel_traces_its_ops_and_no_flash_one(dry_runs: Served, tmp_path: Path) -> None:
    """--attention_backend varlen_cudnn in the shipped kind of step (packed, bf16, compiled, one CUDA graph): the
    traced step and eval run cuDNN's varlen ops, FLOPs counted over their grid, and no flash-attention op."""
    cost = tmp_path / "cost.json"
    argv = ["--steps", "2", "--cost_json", str(cost), "--", *_base_flags(tmp_path), "--precision", "bf16",
            "--input_layout", "packed", "--cuda_graphs", "--compile_mode", "default", "--attention_backend",
            "varlen_cudnn"]
    done = dry_runs.run(argv, tmp_path / "dry_run.txt", env={"WORLD_SIZE": "1", "RANK": "0"})
    assert done.returncode == 0 and "attention varlen_cudnn;" in done.stdout, done.stdout
    work = json.loads(cost.read_text())["work"]
    ops = {phase: {name: (kind, flops) for name, kind, flops, *_ in work[phase]["ops"]} for phase in ("step", "eval")}
    assert {"varlen_cudnn_forward", "varlen_cudnn_backward"} <= set(ops["step"]) and "varlen_cudnn_forward" in ops["eval"]
    assert all(ops["step"][name][0] == "matmul" and ops["step"][name][1] > 0 for name in ("varlen_cudnn_forward",
                                                                                          "varlen_cudnn_backward"))
    assert not [name for phase in ops.values() for name in phase if "flash" in name], ops
