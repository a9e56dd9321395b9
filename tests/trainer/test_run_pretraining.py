"""run_pretraining.py: flags, errors, logs, evaluation and 2-process runs; a short run, --help and the
2-process runs as a user starts them, the rest served by one process of the module (tests/harness/served.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from tests.harness.commands import run_cli
from tests.harness.demo import trainer_args, verify_folder
from tests.harness.paths import TRAINER

MLPERF_FLAGS = (
    "--input_dir --eval_dir --init_checkpoint --bert_config_path --train_batch_size --gradient_accumulation_steps "
    "--learning_rate --opt_lamb_beta_1 --opt_lamb_beta_2 --weight_decay_rate --warmup_steps --warmup_proportion "
    "--start_warmup_step --max_steps --max_samples_termination --eval_iter_start_samples --eval_iter_samples "
    "--eval_batch_size --num_eval_examples --target_mlm_accuracy --max_seq_length --max_predictions_per_seq "
    "--output_dir --seed --do_train --optimizer --precision --input_layout"
).split()


def mllog_lines(path: Path) -> list[dict]:
    return [json.loads(line.split(":::MLLOG ", 1)[1]) for line in path.read_text().splitlines() if ":::MLLOG" in line]


def compliance(log: Path, ruleset: str, tmp_path: Path) -> str:
    result = run_cli([sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage", "training",
                      "--ruleset", ruleset, "--log_output", str(tmp_path / f"checker_{ruleset}.log"), str(log)])
    return result.stdout + result.stderr


def test_help_documents_every_flag():
    from mlperf_bert.config.cli import build_parser

    result = run_cli([sys.executable, str(TRAINER), "--help"])
    assert result.returncode == 0
    for flag in MLPERF_FLAGS:
        assert flag in result.stdout, flag
    undocumented = [a.option_strings for a in build_parser()._actions if a.help in (None, "") and a.option_strings]
    assert not undocumented


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--precision", "fp16", "--device", "cpu"], "--precision fp16 needs a GPU"),
        (["--train_batch_size", "6", "--gradient_accumulation_steps", "4"], "is not divisible by"),
        (["--optimizer", "adam", "--submission_division", "closed"], "the optimizer is LAMB"),
        (["--input_layout", "packed", "--balance", "global_presort"], "use --balance none with --input_layout packed"),
        (["--cuda_graphs", "--device", "cpu"], "--cuda_graphs needs a GPU"),
        (["--opt_lamb_beta_1", "1.5"], "--opt_lamb_beta_1 must be in [0, 1)"),
        (["--warmup_steps", "5", "--warmup_proportion", "0.1"], "not allowed with argument"),
    ],
)
def test_contradictory_flags_are_rejected_before_anything_runs(served_trainer, demo_data, tmp_path, extra, message):
    out = tmp_path / "out"
    result = served_trainer.run_in(tmp_path, [*trainer_args(demo_data, out, "--do_train"), *extra])
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert not out.exists(), "nothing may run (or be written) for a rejected config"


def _copy_data(demo_data: Path, tmp_path: Path) -> Path:
    data = tmp_path / "data"
    shutil.copytree(demo_data, data)
    return data


def _rewrite(path: Path, key: str, edit) -> None:
    with h5py.File(path, "a") as f:
        values = f[key][...]
        del f[key]
        f[key] = edit(values)


BAD_SHARDS = {
    "missing key": (lambda p: _rewrite(p, "masked_lm_ids", lambda v: v) or h5py.File(p, "a").__delitem__("masked_lm_ids"),
                    "masked_lm_ids"),
    "token ids outside the vocabulary": (lambda p: _rewrite(p, "input_ids", lambda v: np.where(v > 0, 127 + 900, v)),
                                         "vocab"),
    "masked position beyond the sequence": (lambda p: _rewrite(p, "masked_lm_positions",
                                                               lambda v: np.where(v > 0, 63, v)), "position"),
    "truncated file": (lambda p: p.write_bytes(p.read_bytes()[:2000]), "part_00000_of_00003.hdf5"),
}


@pytest.mark.parametrize("case", sorted(BAD_SHARDS))
def test_bad_shards_give_a_clear_error_naming_the_file(served_trainer, demo_data, tmp_path, case):
    data = _copy_data(demo_data, tmp_path)
    corrupt, expected = BAD_SHARDS[case]
    corrupt(data / "train" / "part_00000_of_00003.hdf5")
    # Told to train the changed folder anyway: its rows are checked as they are read.
    result = served_trainer.run_in(tmp_path, trainer_args(data, tmp_path / "out", "--do_train", "--max_steps", "400",
                                                   "--unverified_data"))
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    error = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert error and "part_00000_of_00003.hdf5" in error[0] and expected in error[0], result.stderr[-2000:]


def test_sequence_longer_than_max_seq_length_is_rejected(served_trainer, demo_data, tmp_path):
    args = trainer_args(demo_data, tmp_path / "out", "--do_train")
    args[args.index("--max_seq_length") + 1] = "32"
    result = served_trainer.run_in(tmp_path, args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "--max_seq_length 32" in result.stderr and "a sequence of 64 tokens" in result.stderr
    assert str(demo_data) in result.stderr  # the folder whose verification record says so


def test_empty_input_directory_is_rejected(served_trainer, demo_data, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    args = trainer_args(demo_data, tmp_path / "out", "--do_train")
    args[args.index("--input_dir") + 1] = str(empty)
    result = served_trainer.run_in(tmp_path, args)
    assert result.returncode == 2
    assert str(empty) in result.stderr and "Traceback" not in result.stderr


@pytest.fixture(scope="module")
def short_run(demo_data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """One 6-step run on the demo data, with its curves: its log, console and files are each looked at
    by a test below."""
    out = tmp_path_factory.mktemp("short_run") / "out"
    result = run_cli([sys.executable, str(TRAINER), *trainer_args(demo_data, out, "--do_train", "--curves", "png")])
    assert result.returncode == 0, result.stderr[-3000:]
    return out, result


def test_demo_log_passes_both_rulesets(short_run, tmp_path):
    out, result = short_run
    log = out / "mlperf.log"
    for ruleset in ("5.0.0", "2.0.0"):
        report = compliance(log, ruleset, tmp_path)
        assert "SUCCESS" in report and "FAILED" not in report, report
    lines = mllog_lines(log)
    stop = [e for e in lines if e["key"] == "run_stop"][0]
    assert stop["metadata"]["status"] == "aborted"  # 6 steps cannot reach 0.72
    evals = [e for e in lines if e["key"] == "eval_accuracy"]
    assert [e["metadata"]["epoch_num"] for e in evals] == [32, 48]  # 6 steps x 8 = 48 samples
    assert "step 2 samples 16" in result.stderr  # the readable progress line


def _without_time(line: str) -> str:
    return line.split(" ", 1)[1]  # train.log lines start with a timestamp


def _check_picture(path: Path) -> None:
    assert path.stat().st_size > 20_000
    with Image.open(path) as image:
        assert image.format == "PNG" and image.width > 500 and image.height > 300
        colours = np.unique(np.asarray(image.convert("RGB")).reshape(-1, 3), axis=0)
    assert len(colours) > 50  # curves, labels, target line: not a blank canvas


def test_a_run_shows_its_progress_and_leaves_a_summary_and_curves(short_run):
    out, result = short_run
    assert ":::MLLOG" not in result.stdout + result.stderr  # the log goes to its file only
    logged = mllog_lines(out / "mlperf.log")
    evals = [(e["metadata"]["epoch_num"], e["value"]) for e in logged if e["key"] == "eval_accuracy"]
    assert [s for s, _ in evals] == [32, 48]

    lines = [_without_time(line) for line in (out / "train.log").read_text().splitlines()]
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == ["2", "4", "6"]  # --log_freq 2; 6 is also an eval step
    for line in steps:
        assert all(f" {field} " in line for field in ("samples/s", "tokens/s", "loss", "lr", "skipped")), line
        assert "rank_tokens max" in line, line
    eval_lines = [line for line in lines if line.startswith("eval ")]
    assert len(eval_lines) == len(evals)
    for i, (line, (samples, accuracy)) in enumerate(zip(eval_lines, evals), 1):  # as the MLPerf log has them
        assert line.startswith(f"eval {i} step {samples // 8} samples {samples} mlm_accuracy {accuracy:.4f} "
                               f"({100 * accuracy / 0.72:.1f}% of target 0.720) mlm_loss "), line
    assert lines[-1].startswith("run_stop status aborted step 6 samples 48 ")
    shown = [line for line in result.stderr.splitlines() if line.startswith(("run ", "run_stop ", "step ", "eval "))]
    assert shown == lines  # the console (not a terminal here) shows train.log's lines, each once

    summary = json.loads((out / "summary.json").read_text())
    assert (summary["status"], summary["steps"], summary["samples"]) == ("aborted", 6, 48)
    assert [tuple(e) for e in summary["evals"]] == [(s, pytest.approx(a)) for s, a in evals]
    assert summary["files"]["curves"] == str(out / "curves.png")
    text = (out / "summary.txt").read_text()
    assert text.startswith("status: aborted\n") and text in result.stderr
    assert f"2: samples 48 mlm_accuracy {evals[1][1]:.4f}" in text
    # the trainer hands the hooks its schedule: 6 steps of 8, far below the published runs' schedules
    assert "\nforecast: none (the LR schedule spans 48 samples, outside the " in text
    _check_picture(out / "curves.png")


def test_mllog_lines_reach_stdout_only_with_echo_mllog(served_trainer, demo_data, tmp_path):
    out = tmp_path / "out"
    args = trainer_args(demo_data, out, "--do_train", "--max_steps", "2", "--echo_mllog")
    result = served_trainer.run_in(tmp_path, args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == (out / "mlperf.log").read_text().splitlines()
    assert any('"key": "run_stop"' in line for line in result.stdout.splitlines())
    assert ":::MLLOG" not in result.stderr and "step 2 samples 16/16" in result.stderr
    assert not (out / "curves.png").exists() and "curves:" not in (out / "summary.txt").read_text()  # --curves none


def test_evaluation_only_matches_huggingface_on_the_same_checkpoint(served_trainer, demo_data, tmp_path):
    """Without --do_train the init checkpoint is scored once; HuggingFace scores it independently."""
    bert = json.loads((demo_data / "bert_config.json").read_text())
    hf_cfg = transformers.BertConfig(**{k: v for k, v in bert.items()})
    torch.manual_seed(3)
    hf = transformers.BertForPreTraining(hf_cfg).eval()
    torch.save({"model": hf.state_dict()}, tmp_path / "init.pt")
    args = trainer_args(demo_data, tmp_path / "out", "--init_checkpoint", str(tmp_path / "init.pt"))
    result = served_trainer.run_in(tmp_path, args)
    assert result.returncode == 0, result.stderr[-3000:]
    logged = [e["value"] for e in mllog_lines(tmp_path / "out" / "mlperf.log") if e["key"] == "eval_accuracy"]

    correct = total = 0
    with h5py.File(next((demo_data / "eval").glob("*.hdf5")), "r") as f, torch.no_grad():
        ids, mask, seg = (torch.from_numpy(f[k][:200].astype(np.int64)) for k in ("input_ids", "input_mask", "segment_ids"))
        pos, lab = (torch.from_numpy(f[k][:200].astype(np.int64)) for k in ("masked_lm_positions", "masked_lm_ids"))
        logits = hf(input_ids=ids, attention_mask=mask, token_type_ids=seg).prediction_logits
        pred = logits.gather(1, pos.unsqueeze(-1).expand(-1, -1, logits.shape[-1])).argmax(-1)
        real = pos != 0
        correct, total = (pred == lab)[real].sum().item(), real.sum().item()
    assert logged == [pytest.approx(correct / total, abs=1e-9)]


def _final_weights_digest(out: Path) -> list[float]:
    evals = [e for e in mllog_lines(out / "mlperf.log") if e["key"] == "eval_accuracy"]
    return [e["value"] for e in evals]


@pytest.mark.slow
def test_padded_and_unpadded_layouts_train_identically(served_trainer, demo_data, tmp_path):
    """The same batches, padded then unpadded on the device or built flat on the host."""
    accuracies = {}
    for layout in ("padded", "unpadded"):
        out = tmp_path / layout
        result = served_trainer.run_in(tmp_path, trainer_args(demo_data, out, "--do_train", "--input_layout", layout))
        assert result.returncode == 0, result.stderr[-3000:]
        accuracies[layout] = _final_weights_digest(out)
    assert accuracies["padded"] == pytest.approx(accuracies["unpadded"], abs=1e-6)


@pytest.mark.slow
def test_packed_layout_trains_on_packed_shards(served_trainer, demo_data, tmp_path):
    packed = tmp_path / "packed"
    made = run_cli([sys.executable, "data_prep/prepare.py", "--quiet", "pack", "--input", str(demo_data / "train"),
                    "--out", str(packed), "--algorithm", "nnlshp", "--max_seq_length", "64",
                    "--max_predictions", "10", "--workers", "1"])
    assert made.returncode == 0, made.stderr[-3000:]
    shards = sorted(packed.rglob("*.hdf5"))
    assert shards
    verify_folder(shards[0].parent, "--eval_dir", str(demo_data / "eval"), "--max_seq_length", "64",
                  "--max_predictions", "10")
    args = trainer_args(demo_data, tmp_path / "out", "--do_train", "--input_layout", "packed",
                        "--train_batch_size", "4")
    args[args.index("--input_dir") + 1] = str(shards[0].parent)
    result = served_trainer.run_in(tmp_path, args)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = mllog_lines(tmp_path / "out" / "mlperf.log")
    assert [e["value"] for e in lines if e["key"] == "global_batch_size"] == [8]  # 4 packs x 2
    assert [e for e in lines if e["key"] == "run_stop"][0]["metadata"]["status"] == "aborted"


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "fp8"])
def test_distributed_optimizer_two_process_run_equals_the_unsharded_run(demo_data, tmp_path, precision):
    """The trainer as a user starts it, 2 gloo processes of 4 sequences and 2 accumulation steps, with
    and without --distributed_optimizer: each logs a global batch of 8 once (rank 1 writes nothing),
    the same eval accuracies, and the sharded run's checkpoint holds the whole (unsharded) state.
    Under fp8 (torchao's emulation on the CPU) the FP8 layers' weights are the optimizer's flat
    buffer views like any other: their per-tensor scales are taken from the all-gathered weights."""
    accuracies, optimizer_states = {}, {}
    for flag in ("", "--distributed_optimizer"):
        out = tmp_path / (flag or "unsharded")
        extra = ["--do_train", "--train_batch_size", "4", "--gradient_accumulation_steps", "2", "--optimizer_impl",
                 "foreach", "--checkpoint_every_samples", "48", "--precision", precision, *([flag] if flag else [])]
        result = run_cli([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(TRAINER), *trainer_args(demo_data, out, *extra)])
        assert result.returncode == 0, result.stderr[-3000:]
        lines = mllog_lines(out / "mlperf.log")
        assert [e["value"] for e in lines if e["key"] == "global_batch_size"] == [8]
        assert [e["metadata"]["epoch_num"] for e in lines if e["key"] == "eval_accuracy"] == [32, 48]
        assert len([e for e in lines if e["key"] == "run_start"]) == 1  # rank 1 writes nothing
        accuracies[flag] = _final_weights_digest(out)
        checkpoint = sorted((out / "checkpoints").glob("ckpt-*.pt"))[-1]
        optimizer_states[flag] = torch.load(checkpoint, weights_only=True)["optimizer"]
    assert accuracies[""] == pytest.approx(accuracies["--distributed_optimizer"], abs=1e-6)
    unsharded, sharded = optimizer_states[""], optimizer_states["--distributed_optimizer"]
    assert sharded["state"].keys() == unsharded["state"].keys()
    for index, moments in unsharded["state"].items():
        for name, tensor in moments.items():
            torch.testing.assert_close(sharded["state"][index][name], tensor, rtol=1e-5, atol=1e-9)
