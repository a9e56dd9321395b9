"""Config variables named in the trainer's error lines (mlperf_bert.config.flag_variables, main, cli).

The table comes from run_and_time.sh itself wherever the test is about the shipped launcher;
the bad combinations through the launcher are in test_launchers.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from mlperf_bert.config.cli import launcher_flag_variables
from mlperf_bert.config.settings import ConfigError
from mlperf_bert.config.flag_variables import ENV_VARIABLE, FlagVariables, given_value
from mlperf_bert.main import main
from tests.harness.commands import run_cli
from tests.harness.paths import REPO

TABLE = FlagVariables({"--cuda_graphs": "CUDA_GRAPHS", "--input_layout": "INPUT_LAYOUT", "--balance": "BALANCE",
                       "--warmup_steps": "WARMUP_STEPS", "--submission_org": "SUBMISSION_ORG"},
                      frozenset({"--cuda_graphs"}))


def test_each_named_flag_gets_its_variable_and_the_value_the_trainer_got():
    message = "--cuda_graphs needs static shapes: use it with --input_layout packed"
    argv = ["--input_layout", "unpadded", "--cuda_graphs"]
    assert TABLE.annotate(message, argv) == (
        f"{message} (config: --cuda_graphs is CUDA_GRAPHS=1, --input_layout is INPUT_LAYOUT=unpadded)")


def test_an_absent_switch_is_0_and_an_absent_value_flag_is_unset():
    message = "--warmup_steps needs --cuda_graphs"
    assert TABLE.annotate(message, []) == f"{message} (config: --warmup_steps is WARMUP_STEPS unset, " \
                                          "--cuda_graphs is CUDA_GRAPHS=0)"


def test_flags_are_matched_whole_and_named_once_in_order_of_first_mention():
    message = "--balance_deal raster needs --balance; use --input_layout padded or --balance none"
    assert TABLE.annotate(message, ["--balance", "global_presort", "--input_layout", "padded"]) == (
        f"{message} (config: --balance is BALANCE=global_presort, --input_layout is INPUT_LAYOUT=padded)")


def test_a_message_naming_no_table_flag_is_unchanged():
    assert TABLE.annotate("--help lists the flags; hidden_dropout_prob must be < 1", ["--balance", "x"]) == (
        "--help lists the flags; hidden_dropout_prob must be < 1")
    assert FlagVariables({}).annotate("--balance is wrong", ["--balance", "x"]) == "--balance is wrong"


def test_values_are_quoted_as_a_shell_would_take_them():
    message = "--submission_org must be a non-empty string"
    assert TABLE.annotate(message, ["--submission_org", "my org"]) == (
        f"{message} (config: --submission_org is SUBMISSION_ORG='my org')")


def test_the_value_is_the_last_one_given_in_either_spelling():
    assert given_value("--balance", ["--balance", "a", "--balance=b"]) == "b"
    assert given_value("--balance", ["--balance=b", "--balance", "c"]) == "c"
    assert given_value("--balance", ["--balance_deal", "x", "--balance"]) is None  # no value follows


@pytest.mark.parametrize("table, says", [
    ("BATCHSIZE", "entry 'BATCHSIZE' is not NAME=--flag"),
    ("BATCHSIZE=train_batch_size", "is not NAME=--flag"),
    ("BATCHSIZE=--train_batch_sise", "BATCHSIZE=--train_batch_sise names no trainer flag"),
])
def test_a_malformed_table_is_refused_naming_the_environment_variable(table, says):
    with pytest.raises(ConfigError, match=f"^{ENV_VARIABLE}: .*") as caught:
        launcher_flag_variables({ENV_VARIABLE: table})
    assert says in str(caught.value)


def test_the_trainer_knows_its_switches():
    names = launcher_flag_variables({ENV_VARIABLE: "CUDA_GRAPHS=--cuda_graphs BATCHSIZE=--train_batch_size"})
    assert names.variables == {"--cuda_graphs": "CUDA_GRAPHS", "--train_batch_size": "BATCHSIZE"}
    assert {"--cuda_graphs", "--do_train", "--echo_mllog"} <= names.switches
    assert "--train_batch_size" not in names.switches


# ---------------------------------------------------------------------------------------------
# main(): config errors and usage errors


def _flags(tmp_path: Path, *extra: str) -> list[str]:
    (tmp_path / "bert_config.json").write_text("{}")
    return ["--eval_dir", str(tmp_path), "--bert_config_path", str(tmp_path / "bert_config.json"),
            "--output_dir", str(tmp_path / "out"), "--max_steps", "10", *extra]


def _main_error(monkeypatch, capsys, table: str, argv: list[str]) -> str:
    monkeypatch.setenv(ENV_VARIABLE, table)
    assert main(argv) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def test_main_names_the_variables_of_a_refused_combination(monkeypatch, capsys, tmp_path):
    line = _main_error(monkeypatch, capsys, "CUDA_GRAPHS=--cuda_graphs INPUT_LAYOUT=--input_layout DEVICE=--device",
                       _flags(tmp_path, "--cuda_graphs", "--device", "cuda", "--input_layout", "padded"))
    assert line == ("error: --cuda_graphs needs static shapes: use it with --input_layout packed "
                    "(config: --cuda_graphs is CUDA_GRAPHS=1, --input_layout is INPUT_LAYOUT=padded)")


def test_main_names_the_variable_of_a_bad_choice(monkeypatch, capsys, tmp_path):
    line = _main_error(monkeypatch, capsys, "INPUT_LAYOUT=--input_layout",
                       _flags(tmp_path, "--input_layout", "bogus"))
    assert line.startswith("error: argument --input_layout: invalid choice: 'bogus'")
    assert line.endswith("(config: --input_layout is INPUT_LAYOUT=bogus)")


def test_main_without_a_table_prints_the_flags_only(monkeypatch, capsys, tmp_path):
    monkeypatch.delenv(ENV_VARIABLE, raising=False)
    assert main(_flags(tmp_path, "--input_layout", "bogus")) == 2
    assert "config:" not in capsys.readouterr().err


def test_main_refuses_a_malformed_table_before_anything_else(monkeypatch, capsys, tmp_path):
    line = _main_error(monkeypatch, capsys, "LR=--learning_rat", _flags(tmp_path))
    assert line == f"error: {ENV_VARIABLE}: LR=--learning_rat names no trainer flag; fix the launcher's table"


# ---------------------------------------------------------------------------------------------
# run_and_time.sh's table


def _launch_with_recording_python(tmp_path: Path) -> dict:
    """argv and the table run_and_time.sh hands to the trainer, for config_CPU_1x2.sh (nothing trains)."""
    fake = tmp_path / "python"
    fake.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    f"print(json.dumps({{'argv': sys.argv[1:], 'table': os.environ['{ENV_VARIABLE}']}}))\n")
    fake.chmod(0o755)
    for name in ("data", "eval"):
        (tmp_path / name).mkdir()
    (tmp_path / "bert_config.json").write_text("{}")
    command = ["bash", "-c", 'source "$1" && DGXNGPU=1 exec ./run_and_time.sh', "bash", "config_CPU_1x2.sh"]
    done = run_cli(command, env={"PYTHON": str(fake), "DATADIR_PHASE2": str(tmp_path / "data"),
                                 "EVALDIR": str(tmp_path / "eval"), "BERT_CONFIG": str(tmp_path / "bert_config.json"),
                                 "INIT_CHECKPOINT": "none", "OUTPUT_DIR": str(tmp_path / "out"), "SEED": "3"})
    assert done.returncode == 0, done.stderr
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))


def test_the_launcher_table_names_trainer_flags_and_covers_every_flag_it_passes(tmp_path):
    seen = _launch_with_recording_python(tmp_path)
    names = launcher_flag_variables({ENV_VARIABLE: seen["table"]})  # raises on a flag the trainer lacks
    passed = {arg for arg in seen["argv"][1:] if arg.startswith("--")}
    assert passed - set(names.variables) == {"--do_train"}  # the one flag no variable sets
    assert names.variables["--train_batch_size"] == "BATCHSIZE"
    assert names.variables["--cuda_graphs"] == "CUDA_GRAPHS"
    assert len(set(names.variables.values())) == len(names.variables)  # one flag per variable
    assert str(REPO / "pytorch" / "run_pretraining.py") == seen["argv"][0]
