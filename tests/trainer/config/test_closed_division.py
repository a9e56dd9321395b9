"""The closed-division rules (config/closed_division.py): one broken rule at a time through the
flags, the launcher and the packaged logs; the same values in the open division run."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from mlperf_bert.config.cli import build_parser, config_from_args, parse_config
from mlperf_bert.config.closed_division import RULES, broken_rules, config_values, eval_interval_samples
from mlperf_bert.config.settings import ConfigError
from tests.harness.closed_runs import closed_run_inputs
from tests.harness.commands import run_cli
from tests.harness.demo import trainer_args
from tests.harness.launches import mllog_events
from tests.harness.paths import REPO

ADOC_SECTIONS = {"§2.4", "§4.1", "§6.1", "§6.3", "§9.1", "§9.4", "§14"}  # numbered as training_rules.adoc v5.0


def _closed_flags(tmp_path: Path) -> list[str]:
    """A closed-division config that keeps every rule: NVIDIA's 1x8 A100 values at one rank."""
    return ["--input_dir", str(tmp_path), "--eval_dir", str(tmp_path), "--bert_config_path", str(tmp_path / "b.json"),
            "--output_dir", str(tmp_path / "out"), "--do_train", "--init_checkpoint", str(tmp_path / "phase1.pt"),
            "--train_batch_size", "56", "--max_steps", "6700", "--learning_rate", "0.000425",
            "--submission_division", "closed"]


# One broken value per rule the flags set: (flag, value, the required value the error line names).
BREAKS = {
    "--optimizer": ("adam", "lamb"),
    "--max_grad_norm": ("0.5", "1.0"),
    "--clip_mode": ("bucketwise", "after_allreduce or before_allreduce"),
    "--end_learning_rate": ("1e-6", "0.0"),
    "--decay_from_warmup_end": (None, "0"),
    "--target_mlm_accuracy": ("0.70", "0.72"),
    "--num_eval_examples": ("5000", "10000"),
    "--eval_iter_samples": ("100000", "150000"),
    "--eval_iter_start_samples": ("3000000", "150000"),
    "--init_checkpoint": ("", "the phase-1 checkpoint model.ckpt-28252"),
    "--max_seq_length": ("384", "512"),
    "--max_predictions_per_seq": ("60", "76"),
}


def _broken(flags: list[str], flag: str, value: str | None) -> list[str]:
    if flag == "--init_checkpoint":
        at = flags.index(flag)
        return flags[:at] + flags[at + 2:]
    if flag == "--decay_from_warmup_end":  # a switch: only breaks the rule with a warm-up to count from
        return [*flags, flag, "--warmup_steps", "100"]
    return [*flags, flag, str(value)]


def test_the_table_has_one_rule_per_flag_and_cites_the_rules_file():
    flags = [rule.flag for rule in RULES if rule.flag]
    assert sorted(flags) == sorted(BREAKS) and len(set(flags)) == len(flags)
    assert {rule.section.split(",")[0] for rule in RULES} | {"§6.3"} <= ADOC_SECTIONS
    assert eval_interval_samples(448) == 150_000 and eval_interval_samples(8192) == 225_000


def test_a_closed_config_that_keeps_every_rule_is_accepted_from_its_values_alone(tmp_path, monkeypatch):
    args = build_parser().parse_args(_closed_flags(tmp_path))

    def touched(*args, **kwargs):
        raise AssertionError("the closed-division check touched the file system")

    for name in ("exists", "isfile", "isdir", "realpath"):
        monkeypatch.setattr(os.path, name, touched)
    for name in ("exists", "is_file", "stat", "open"):
        monkeypatch.setattr(Path, name, touched)
    cfg = config_from_args(args, 1)
    monkeypatch.undo()
    assert broken_rules(config_values(cfg)) == []


def _refused(tmp_path: Path, flag: str) -> tuple[list[str], str]:
    """The closed flags with `flag`'s rule broken, and the error line they are refused with."""
    flags = _broken(_closed_flags(tmp_path), flag, BREAKS[flag][0])
    with pytest.raises(ConfigError) as raised:
        parse_config(flags, 1)
    return flags, str(raised.value)


@pytest.mark.parametrize("flag", sorted(BREAKS))
def test_each_broken_rule_stops_a_closed_config_and_an_open_one_runs(tmp_path, flag):
    required = BREAKS[flag][1]
    flags, line = _refused(tmp_path, flag)
    rule = next(rule for rule in RULES if rule.flag == flag)
    assert "\n" not in line
    assert line.startswith(f"closed division: {rule.what} (training_rules.adoc {rule.section}): {flag} must be")
    assert required in line and "--submission_division open" in line
    opened = ["open" if f == "closed" else f for f in flags]
    assert parse_config(opened, 1).run.submission_division == "open"


@pytest.mark.parametrize("flag", sorted(BREAKS))
def test_the_advice_of_a_broken_rule_keeps_every_rule(tmp_path, flag):
    """Doing what the error line says (not the open division) gives a config every rule accepts."""
    flags, line = _refused(tmp_path, flag)
    advice = line.split("; ", 1)[1]
    use = re.match(r"use (--\w+) ([^\s,]+)", advice)
    if use:
        fixed = [*flags, use.group(1), use.group(2)]
    elif flag == "--init_checkpoint":
        fixed = [*flags, flag, str(tmp_path / "phase1.pt")]
    else:  # "drop --flag" / "leave --flag unset"
        at = flags.index(flag)
        fixed = flags[:at] + flags[at + (1 if flag == "--decay_from_warmup_end" else 2):]
    assert "lower" not in advice and "--num_eval_examples 5000" not in advice
    assert broken_rules(config_values(parse_config(fixed, 1))) == []


def test_the_eval_interval_follows_the_global_batch_size(tmp_path):
    flags = [*_closed_flags(tmp_path), "--eval_iter_samples", "150000"]
    parse_config(flags, 8)  # 448 sequences: 150,000
    with pytest.raises(ConfigError, match=r"--eval_iter_samples must be 225000, got 150000"):
        parse_config(flags, 147)  # 8,232 sequences: 225,000


# ---------------------------------------------------------------------------------------------
# Through run_and_time.sh with the shipped closed config


def _exports(config: Path) -> dict[str, str]:
    return dict(re.findall(r"^export (\w+)=(\S*)", config.read_text(), re.M))


@pytest.mark.parametrize("override, variable, required", [
    ({"NUM_EVAL_EXAMPLES": "5000"}, "NUM_EVAL_EXAMPLES=5000", "must be 10000"),
    ({"INIT_CHECKPOINT": "none"}, "INIT_CHECKPOINT", "must be the phase-1 checkpoint"),
])
def test_run_and_time_stops_a_closed_config_with_a_broken_rule(tmp_path, override, variable, required):
    (tmp_path / "bert_config.json").write_text("{}")
    (tmp_path / "model.ckpt-28252.pt").write_text("not a checkpoint: nothing may read it")
    for name in ("data", "eval"):
        (tmp_path / name).mkdir()
    env = {**_exports(REPO / "config_DGXA100_1x8.sh"), "DGXNGPU": "1", "PYTHON": sys.executable,
           "DATADIR_PHASE2": str(tmp_path / "data"), "EVALDIR": str(tmp_path / "eval"),
           "BERT_CONFIG": str(tmp_path / "bert_config.json"), "INIT_CHECKPOINT": str(tmp_path / "model.ckpt-28252.pt"),
           "OUTPUT_DIR": str(tmp_path / "out"), "SEED": "1", **override}
    done = run_cli(["bash", str(REPO / "run_and_time.sh")], env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    assert errors[0].startswith("error: closed division: ") and required in errors[0]
    assert variable in errors[0] and "DIVISION=closed" in errors[0]
    assert "RESULT" not in done.stdout and not (tmp_path / "out" / "mlperf.log").exists()


def test_run_and_time_names_the_phase1_checkpoint_when_a_closed_config_misses_it(tmp_path):
    (tmp_path / "bert_config.json").write_text("{}")
    for name in ("data", "eval"):
        (tmp_path / name).mkdir()
    env = {**_exports(REPO / "config_DGXA100_1x8.sh"), "DGXNGPU": "1", "PYTHON": sys.executable,
           "DATADIR_PHASE2": str(tmp_path / "data"), "EVALDIR": str(tmp_path / "eval"),
           "BERT_CONFIG": str(tmp_path / "bert_config.json"), "INIT_CHECKPOINT": str(tmp_path / "gone.pt")}
    done = run_cli(["bash", str(REPO / "run_and_time.sh")], env=env)
    assert done.returncode == 2
    assert done.stderr.strip() == (f"run_and_time.sh: INIT_CHECKPOINT={tmp_path / 'gone.pt'} not found: a "
                                   "closed-division run starts from the phase-1 checkpoint (training_rules.adoc "
                                   "§2.4); point INIT_CHECKPOINT or CHECKPOINTDIR_PHASE1 at it (data_prep/prepare.py "
                                   "convert-checkpoint makes it), or set DIVISION=open")


# ---------------------------------------------------------------------------------------------
# A run: the open division takes the same values; a closed run that keeps the rules logs them


def test_an_open_run_with_a_small_eval_set_trains_and_says_open(served_trainer, demo_data, tmp_path):
    args = trainer_args(demo_data, tmp_path / "out", "--do_train", "--max_steps", "2")
    closed = [*args, "--submission_division", "closed", "--init_checkpoint", str(tmp_path / "none.pt")]
    refused = served_trainer.run_in(tmp_path, closed)
    assert refused.returncode == 2 and "closed division: every eval covers" in refused.stderr, refused.stderr
    done = served_trainer.run_in(tmp_path, args)
    assert done.returncode == 0, done.stderr[-3000:]
    division = [e["value"] for e in mllog_events(tmp_path / "out" / "mlperf.log") if e["key"] == "submission_division"]
    assert division == ["open"]


def test_a_closed_run_with_a_small_eval_set_is_told_to_use_the_full_one(served_trainer, demo_data, tmp_path):
    """The rules hold, but --eval_dir has 200 samples: the fix offered may not break a rule."""
    args = closed_run_inputs(demo_data, tmp_path)
    args[args.index("--eval_dir") + 1] = str(demo_data / "eval")
    done = served_trainer.run_in(tmp_path, args)
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in done.stderr
    assert "200 eval samples, fewer than the 10000 requested; point --eval_dir at the 10,000-sample eval set" \
        in errors[0]
    assert "lower" not in errors[0] and "--submission_division open" in errors[0]


# ---------------------------------------------------------------------------------------------
# tools/package_results.py: the same table on the logs it packages


LOG_VALUES = {  # every ruled key, as a closed-division log that keeps the rules holds it
    "global_batch_size": 448, "opt_name": "lamb", "opt_gradient_clip_norm": 1.0,
    "opt_gradient_clip_mode": "after_allreduce", "opt_end_learning_rate": 0.0, "opt_learning_rate_decay_start_step": 0,
    "opt_lamb_learning_rate_decay_poly_power": 1.0, "target_mlm_accuracy": 0.72, "eval_samples": 10000,
    "eval_iter_samples": 150000, "eval_iter_start_samples": 150000, "init_checkpoint": "/ckpt/phase1.pt",
    "max_sequence_length": 512, "max_predictions_per_seq": 76}


def _closed_log(tmp_path: Path, **changed: object) -> Path:
    """A closed log with every ruled key, as the trainer writes it, with `changed` values."""
    values = {"submission_division": "closed", **LOG_VALUES, **changed}
    path = tmp_path / "result_0.txt"
    path.write_text("".join(f':::MLLOG {json.dumps({"key": k, "value": v, "event_type": "POINT_IN_TIME"})}\n'
                            for k, v in values.items()))
    return path


def test_package_results_applies_the_rules_to_a_closed_log(tmp_path):
    from mlperf_tools.results.package_results import closed_rule_problems

    assert closed_rule_problems(_closed_log(tmp_path)) == ([], [])
    broken, _ = closed_rule_problems(_closed_log(tmp_path, eval_samples=200))
    assert broken == ["closed division: every eval covers the reference's 10,000-sample eval set "
                      "(training_rules.adoc §9.4): eval_samples must be 10000, the log says 200"]
    broken, _ = closed_rule_problems(_closed_log(tmp_path, global_batch_size=8192))
    assert [line.split(": ")[2] for line in broken] == ["eval_iter_samples must be 225000, the log says 150000",
                                                         "eval_iter_start_samples must be 225000, the log says 150000"]
    assert closed_rule_problems(_closed_log(tmp_path, submission_division="open", eval_samples=200)) == ([], [])


LOG_BREAKS = {"opt_name": "adam", "opt_gradient_clip_norm": 2.0, "opt_gradient_clip_mode": "bucketwise",
              "opt_end_learning_rate": 1e-5, "opt_learning_rate_decay_start_step": 82,
              "opt_lamb_learning_rate_decay_poly_power": 2.0, "target_mlm_accuracy": 0.7, "eval_samples": 5000,
              "eval_iter_samples": 100000, "eval_iter_start_samples": 3000000, "init_checkpoint": None,
              "max_sequence_length": 384, "max_predictions_per_seq": 60}


@pytest.mark.parametrize("key", sorted(LOG_BREAKS))
def test_each_rule_is_checked_on_a_log_one_broken_value_at_a_time(tmp_path, key):
    from mlperf_tools.results.package_results import closed_rule_problems

    broken, missing = closed_rule_problems(_closed_log(tmp_path, **{key: LOG_BREAKS[key]}))
    assert len(broken) == 1 and f"): {key} must be " in broken[0] and not missing, broken
    assert sorted(LOG_BREAKS) == sorted(rule.key for rule in RULES)


def test_a_log_without_a_ruled_key_is_noted_not_failed(tmp_path):
    """Vendor logs (NVIDIA v2.0) carry no opt_name or eval interval keys: those rules are not checked."""
    from mlperf_tools.results.package_results import closed_rule_problems

    log = _closed_log(tmp_path)
    log.write_text("".join(line for line in log.read_text().splitlines(keepends=True)
                           if '"opt_name"' not in line and '"global_batch_size"' not in line))
    assert closed_rule_problems(log) == ([], ["opt_name", "eval_iter_samples", "eval_iter_start_samples"])


def test_package_results_fails_a_package_with_a_log_that_breaks_a_rule(tmp_path):
    from mlperf_tools.results import package_results

    package = tmp_path / "Org"
    results = package / "results" / "SYS" / "bert"
    results.mkdir(parents=True)
    (package / "systems").mkdir()
    shutil.move(_closed_log(tmp_path, opt_name="adam"), results / "result_0.txt")
    shutil.copy(_closed_log(tmp_path), results / "result_1.txt")
    verdict = package_results.Verdict()
    package_results.check_closed_rules(package, verdict)
    assert verdict.problems == ["results/SYS/bert/result_0.txt: closed division: the optimizer is LAMB (the only "
                                "optimizer the BERT rows allow) (training_rules.adoc §9.1): opt_name must be lamb, "
                                "the log says 'adam'"]


# ---------------------------------------------------------------------------------------------
# Every value a rule forbids, not one example of it


def _forbidden_flag_values() -> list[tuple[str, str]]:
    """Each value the trainer's flag accepts but the closed division does not: every clip mode but
    the two global-norm orders of §14, every optimizer but LAMB."""
    from mlperf_bert.config.closed_division import CLIP_MODES
    from mlperf_bert.config.settings import CLIP_MODES as FLAG_CLIP_MODES, OPTIMIZERS

    return ([("--clip_mode", mode) for mode in FLAG_CLIP_MODES if mode not in CLIP_MODES]
            + [("--optimizer", name) for name in OPTIMIZERS if name != "lamb"])


def test_the_forbidden_flag_values_are_the_ones_the_rules_name():
    assert _forbidden_flag_values() == [("--clip_mode", "none"), ("--clip_mode", "bucketwise"),
                                        ("--optimizer", "adam")]


@pytest.mark.parametrize("flag, value", _forbidden_flag_values())
def test_every_forbidden_value_of_a_one_of_rule_is_refused(tmp_path, flag, value):
    with pytest.raises(ConfigError, match=f"{flag} must be"):
        parse_config([*_closed_flags(tmp_path), flag, value], 1)


@pytest.mark.parametrize("key, values", [
    ("opt_gradient_clip_mode", ["none", "bucketwise", "per_tensor", "", None]),
    ("opt_name", ["adam", "adamw", "sgd", "lars", "LAMB", ""]),
    ("init_checkpoint", ["", "none", None, 0]),
    ("target_mlm_accuracy", [0.719, 0.7199, 0.7201, 0.721, 0.75]),
    ("opt_gradient_clip_norm", [0.999, 1.001, 2.0, 0.0]),
    ("max_sequence_length", [128, 384, 511, 513, 1024]),
    ("max_predictions_per_seq", [20, 75, 77, 80]),
    ("eval_samples", [9_999, 10_001, 5_000, 200]),
])
def test_every_forbidden_value_is_refused_on_a_log(key, values):
    """The same table on logged values: every value near or unlike the required one breaks the rule."""
    good = dict(LOG_VALUES)
    assert broken_rules(good) == []
    for value in values:
        broken = broken_rules({**good, key: value})
        assert [b.rule.key for b in broken] == [key], (key, value)


def test_the_eval_interval_is_the_rules_formula_at_every_global_batch_size():
    """§9.4's FLOOR(0.05 * (230.23 * GBS + 3,000,000), 25,000) in exact rational arithmetic, at every
    global batch size from 1 to 2^14 and at the sizes of the shipped configs and NVIDIA's largest."""
    from fractions import Fraction

    def formula(gbs: int) -> int:
        samples = Fraction(5, 100) * (Fraction(23023, 100) * gbs + 3_000_000)
        return int(samples // 25_000) * 25_000

    sizes = [*range(1, 1 << 14), 448, 3_072, 4_096, 8_192, 12_288, 16_384, 65_536]
    assert [eval_interval_samples(g) for g in sizes] == [formula(g) for g in sizes]
    # Where the FLOOR steps: the last global batch size of one interval and the first of the next.
    assert (eval_interval_samples(4_343), eval_interval_samples(4_344)) == (175_000, 200_000)


def test_a_config_breaking_two_rules_names_the_second_too(tmp_path):
    from mlperf_bert.config.closed_division import closed_division_problem

    cfg = parse_config([*_closed_flags(tmp_path), "--submission_division", "open", "--optimizer", "adam",
                        "--max_seq_length", "384"], 1)
    line = closed_division_problem(cfg)
    assert line is not None and line.startswith("closed division: the optimizer is LAMB")
    assert line.endswith(" (also broken: --max_seq_length)")
    one = closed_division_problem(parse_config([*_closed_flags(tmp_path), "--submission_division", "open",
                                                "--optimizer", "adam"], 1))
    assert one is not None and "also broken" not in one
