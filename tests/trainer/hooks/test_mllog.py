"""MLPerf logging: logs written through MLPerfLogger pass (or fail) the official checker."""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import mlperf_logging.compliance_checker as checker_package
from mlperf_bert.hooks.mllog import MLPerfLogger, bert_tf_tensor_names, optimizer_hyperparameters
from mlperf_bert.optim.schedule import LRSchedule

CHECKER_DIR = Path(checker_package.__file__).parent
RULESETS = ("5.0.0", "2.0.0")


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line.split(":::MLLOG ", 1)[1]) for line in path.read_text().splitlines() if ":::MLLOG" in line]


def run_checker(log: Path, ruleset: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """The compliance checker as a submitter runs it."""
    command = [sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage", "training",
               "--ruleset", ruleset, "--log_output", str(tmp_path / f"checker_{ruleset}.log"), str(log)]
    return subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=120)


def passed(result: subprocess.CompletedProcess) -> bool:
    output = result.stdout + result.stderr
    return result.returncode == 0 and "SUCCESS" in output and "FAILED" not in output


def closed_hyperparameters() -> dict:
    schedule = LRSchedule(base_lr=0.000425, max_steps=6700, warmup_steps=0, start_warmup_step=0)
    values = {"seed": 1234, "global_batch_size": 448, "gradient_accumulation_steps": 1,
              "max_sequence_length": 512, "max_predictions_per_seq": 76}
    values.update(optimizer_hyperparameters("lamb", schedule, (0.9, 0.999), 1e-6, 0.01))
    return values


def write_run(path: Path, division: str, hyperparameters: dict, layers: int, accuracies: list[float],
              stop: bool = True) -> None:
    """A run as the trainer logs it: init, blocks of 150,528 samples with an eval after each."""
    with MLPerfLogger(str(path), rank=0) as log:
        log.cache_clear()
        log.init_start()
        log.submission_info(org="Example", division=division, platform="1xH200", status="onprem")
        log.hyperparameters(hyperparameters)
        log.weights_initialization(bert_tf_tensor_names(layers))
        log.init_stop()
        log.run_start()
        samples = 0
        for accuracy in accuracies:
            log.block_start(first_epoch_num=samples, epoch_count=150_528)
            samples += 150_528
            log.block_stop(first_epoch_num=samples - 150_528)
            log.eval_start(epoch_num=samples)
            log.eval_accuracy(accuracy, epoch_num=samples)
            log.eval_stop(epoch_num=samples)
            log.tracked_stats({"throughput": 1000.0, "lr": 1e-4}, step=samples // 448)
        log.train_samples(samples)
        log.eval_samples(10_000)
        if stop:
            log.run_stop("success" if accuracies[-1] >= 0.72 else "aborted", epoch_num=samples)


def test_tensor_names_equal_the_checker_list() -> None:
    config = yaml.safe_load((CHECKER_DIR / "training_2.0.0" / "closed_bert.yaml").read_text())
    end_check = next(entry["END"]["CHECK"] for entry in config if "END" in entry)
    expected = re.findall(r'"([^"]+)"', end_check)
    names = bert_tf_tensor_names(24)
    assert len(expected) == 398
    assert len(names) == len(set(names)) == 398
    assert sorted(names) == sorted(expected)


def test_tensor_names_scale_with_depth() -> None:
    assert len(bert_tf_tensor_names(2)) == 398 - 22 * 16
    assert not any("layer_2/" in n for n in bert_tf_tensor_names(2))
    with pytest.raises(ValueError, match="num_hidden_layers"):
        bert_tf_tensor_names(0)


@pytest.mark.parametrize("ruleset", RULESETS)
def test_closed_run_passes_checker(tmp_path: Path, ruleset: str) -> None:
    log = tmp_path / "closed.log"
    write_run(log, "closed", closed_hyperparameters(), layers=24, accuracies=[0.41, 0.69, 0.7203])
    result = run_checker(log, ruleset, tmp_path)
    assert passed(result), result.stdout + result.stderr


@pytest.mark.parametrize("ruleset", RULESETS)
def test_open_tiny_run_passes_checker(tmp_path: Path, ruleset: str) -> None:
    schedule = LRSchedule(base_lr=0.000393, max_steps=299, warmup_steps=82, start_warmup_step=-16,
                          decay_steps=179, end_lr=4.945e-5)
    hyper = {"seed": 7, "global_batch_size": 16, "gradient_accumulation_steps": 1}
    hyper.update(optimizer_hyperparameters("adam", schedule, (0.80, 0.82), 1e-9, 0.0029))
    log = tmp_path / "open.log"
    write_run(log, "open", hyper, layers=2, accuracies=[0.12, 0.31])
    result = run_checker(log, ruleset, tmp_path)
    assert passed(result), result.stdout + result.stderr


@pytest.mark.parametrize("ruleset", RULESETS)
def test_checker_rejects_missing_run_stop(tmp_path: Path, ruleset: str) -> None:
    log = tmp_path / "no_stop.log"
    write_run(log, "closed", closed_hyperparameters(), layers=24, accuracies=[0.73], stop=False)
    result = run_checker(log, ruleset, tmp_path)
    assert result.returncode != 0
    assert "run_stop" in result.stdout + result.stderr


@pytest.mark.parametrize("ruleset", RULESETS)
def test_checker_rejects_missing_closed_hyperparameter(tmp_path: Path, ruleset: str) -> None:
    hyper = closed_hyperparameters()
    del hyper["opt_lamb_beta_1"]
    log = tmp_path / "no_beta.log"
    write_run(log, "closed", hyper, layers=24, accuracies=[0.73])
    result = run_checker(log, ruleset, tmp_path)
    assert result.returncode != 0
    assert "opt_lamb_beta_1" in result.stdout + result.stderr


def test_closed_log_carries_both_epsilon_and_warmup_keys(tmp_path: Path) -> None:
    log = tmp_path / "keys.log"
    write_run(log, "closed", closed_hyperparameters(), layers=24, accuracies=[0.73])
    values = {line["key"]: line["value"] for line in read_lines(log)}
    assert values["opt_lamb_epsilon"] == values["opt_epsilon"] == 1e-6
    assert values["opt_learning_rate_warmup_steps"] == values["num_warmup_steps"] == 0
    assert values["opt_learning_rate_training_steps"] == 6700


def test_records_the_callers_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "caller.log"
    with MLPerfLogger(str(path), rank=0) as log:
        line = inspect.currentframe().f_lineno + 1
        log.eval_accuracy(0.5, epoch_num=10)
        log.hyperparameters({"seed": 3})
    accuracy, seed = read_lines(path)
    assert accuracy["metadata"] == {"file": __file__, "lineno": line, "epoch_num": 10}
    assert (seed["metadata"]["file"], seed["metadata"]["lineno"]) == (__file__, line + 1)


def test_two_loggers_in_one_process_stay_apart(tmp_path: Path) -> None:
    first_path, second_path = tmp_path / "a.log", tmp_path / "b.log"
    with MLPerfLogger(str(first_path), rank=0) as first, MLPerfLogger(str(second_path), rank=0) as second:
        first.event("only_a", 1)
        second.event("only_b", 2)
        first.run_start()
    assert [line["key"] for line in read_lines(first_path)] == ["only_a", "run_start"]
    assert [line["key"] for line in read_lines(second_path)] == ["only_b"]


def test_other_ranks_write_nothing(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "rank1.log"
    with MLPerfLogger(str(path), rank=1) as log:
        log.run_start()
        log.eval_accuracy(0.9, epoch_num=1)
    with MLPerfLogger(None, rank=3) as log:
        log.run_start()
    assert not path.exists()
    assert ":::MLLOG" not in capsys.readouterr().out


def test_stdout_logger_writes_mllog_lines(capsys: pytest.CaptureFixture) -> None:
    with MLPerfLogger(None, rank=0) as log:
        log.train_samples(448)
    out = capsys.readouterr().out.strip()
    assert out.startswith(":::MLLOG ")
    record = json.loads(out[len(":::MLLOG "):])
    assert (record["key"], record["value"], record["event_type"]) == ("train_samples", 448, "POINT_IN_TIME")


def test_bad_values_are_rejected(tmp_path: Path) -> None:
    with MLPerfLogger(str(tmp_path / "x.log"), rank=0) as log:
        with pytest.raises(ValueError, match="run_stop status"):
            log.run_stop("done")
        with pytest.raises(ValueError, match="division"):
            log.submission_info(org="A", division="closedd", platform="p", status="onprem")
        with pytest.raises(ValueError, match="status"):
            log.submission_info(org="A", division="open", platform="p", status="lab")


@pytest.mark.parametrize("echo", [False, True])
def test_lines_reach_stdout_only_when_echo_is_asked(tmp_path, capsys, echo):
    path = tmp_path / "mlperf.log"
    with MLPerfLogger(str(path), rank=0, echo_stdout=echo) as logger:
        logger.init_start()
    written = path.read_text()
    assert written.startswith(":::MLLOG ") and '"key": "init_start"' in written
    assert capsys.readouterr().out == (written if echo else "")
    with MLPerfLogger(str(tmp_path / "default.log"), rank=0) as logger:
        logger.init_start()
    assert capsys.readouterr().out == ""  # the default keeps the console for the progress view


def test_a_held_log_writes_nothing_until_the_run_starts(tmp_path: Path) -> None:
    """The trainer's logger: init lines wait for run_start (or a resume's release), keeping their times."""
    path = tmp_path / "held.log"
    with MLPerfLogger(str(path), rank=0, hold_until_start=True) as log:
        log.init_start()
        log.hyperparameters({"seed": 3})
        assert not path.exists()
        log.run_start()
        log.event("after", 1)
    keys = [record["key"] for record in read_lines(path)]
    assert keys == ["init_start", "seed", "run_start", "after"]
    dropped = tmp_path / "refused.log"
    with MLPerfLogger(str(dropped), rank=0, hold_until_start=True) as log:
        log.init_start()
    assert not dropped.exists()  # closed before the run started: nothing written
