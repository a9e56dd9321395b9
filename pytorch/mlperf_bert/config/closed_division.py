"""The closed-division rules of MLPerf BERT that a run's settings alone can show, as one table.

Source: mlcommons/training_policies `training_rules.adoc`, the text of the v5.0 round (BERT's
last); sections are cited as that file numbers them (`:sectnums:`). Each `Rule` names one
setting by its MLPerf log key, the trainer flag that sets it, the section, and the value the
section requires (some depend on other settings: the eval interval on the global batch size).

Two readers apply the same table:
- the trainer, on its config before anything is read (`config_values`, called from
  `settings.TrainConfig` when --submission_division is closed): the first broken rule stops
  the run with one line naming the rule, the flag (the launcher adds the config variable behind
  it) and the required value, and the advice is to meet the rule or to run in the open division;
- `tools/package_results.py`, on the values of a closed-division MLPerf log (`broken_rules` over
  the log's POINT_IN_TIME values; a key the log lacks is reported as not checked).

What the rules say that no setting shows is left to the review (model code and graph §8, the
optimizer's equations §15, the data's preparation §6.1 and order §6.6, seeds §5.1, the number
of runs §12 and the reference convergence points §13, which `package_results.py` runs the
official checkers for).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol

RULES_FILE = "training_rules.adoc"
EVAL_ROUNDING_SAMPLES = 25_000
NUM_EVAL_SAMPLES = 10_000  # the reference's eval set: pick_eval_samples.py --num_examples_to_pick=10000
TARGET_MLM_ACCURACY = 0.720
MAX_SEQ_LENGTH = 512
MAX_PREDICTIONS_PER_SEQ = 76
CLIP_NORM = 1.0
# §11 Run Results: "a system may use a maximum model initialization time of 30 minutes for Closed
# division and 4 hours for Open division" before the clock; beyond it the clock runs.
MAX_INIT_SECONDS = {"closed": 30 * 60, "open": 4 * 3600}
INIT_SECONDS_KEY = "init_duration_seconds"  # logged at run_start: init_start to run_start
CLIP_MODES = ("after_allreduce", "before_allreduce")  # the two orders §14 allows, both global-norm clips
INIT_CHECKPOINT = "the phase-1 checkpoint model.ckpt-28252 (converted by data_prep/prepare.py convert-checkpoint)"

# Log keys the trainer writes beside the MLPerf ones, so that a log shows every ruled setting.
EVAL_ITER_START_KEY = "eval_iter_start_samples"
EVAL_ITER_KEY = "eval_iter_samples"
TARGET_KEY = "target_mlm_accuracy"
INIT_CHECKPOINT_KEY = "init_checkpoint"
GLOBAL_BATCH_KEY = "global_batch_size"


def init_overrun(seconds: float, division: str) -> str | None:
    """The line for an initialization longer than the division's maximum (§11); None within it."""
    limit = MAX_INIT_SECONDS.get(division, MAX_INIT_SECONDS["open"])
    if seconds <= limit:
        return None
    return (f"initialization took {seconds / 60:.1f} minutes, more than the {limit // 60} minutes the {division} "
            f"division allows before the clock ({RULES_FILE} §11): the clock should have started "
            f"{(seconds - limit) / 60:.1f} minutes earlier, so this run's time is not a valid result")


def eval_interval_samples(global_batch_size: int) -> int:
    """§9.4: samples between evals, FLOOR(0.05 * (230.23 * GBS + 3,000,000), 25,000).

    Exact integer arithmetic: 0.05 * (230.23 * g + 3e6) = (23023 * g + 300_000_000) / 2000.
    """
    if global_batch_size <= 0:
        raise ValueError(f"global_batch_size must be > 0, got {global_batch_size}")
    numerator = 23_023 * global_batch_size + 300_000_000
    return numerator // (2_000 * EVAL_ROUNDING_SAMPLES) * EVAL_ROUNDING_SAMPLES


Values = Mapping[str, Any]


@dataclass(frozen=True)
class Rule:
    """One checkable rule: `key` must hold `required(values)` (compared by `holds`)."""

    what: str  # the rule in a few words
    section: str  # where training_rules.adoc says it
    key: str  # the MLPerf log key of the setting
    flag: str | None  # the trainer flag that sets it; None: fixed in the code, only a log can differ
    required: Callable[[Values], Any]
    holds: Callable[[Any, Any], bool]
    needs: tuple[str, ...] = ()  # other keys `required` reads
    advice: str = ""  # how to meet the rule (never by breaking another)

    def describe_required(self, values: Values) -> str:
        want = self.required(values)
        return " or ".join(map(str, want)) if isinstance(want, tuple) else str(want)


def _equal(value: Any, required: Any) -> bool:
    if isinstance(required, float) and isinstance(value, (int, float)) and not isinstance(value, bool):
        return abs(value - required) <= 1e-12 * max(1.0, abs(required))
    return bool(value == required)


def _one_of(value: Any, required: tuple) -> bool:
    return value in required


def _given(value: Any, required: Any) -> bool:
    return isinstance(value, str) and value not in ("", "none")


def _fixed(value: Any) -> Callable[[Values], Any]:
    return lambda values: value


def _interval(values: Values) -> int:
    return eval_interval_samples(int(values[GLOBAL_BATCH_KEY]))


RULES: tuple[Rule, ...] = (
    Rule("the optimizer is LAMB (the only optimizer the BERT rows allow)", "§9.1", "opt_name", "--optimizer",
         _fixed("lamb"), _equal, advice="use --optimizer lamb"),
    Rule("gradients are clipped to global norm 1.0, as the reference (not a tunable hyperparameter)", "§9.1",
         "opt_gradient_clip_norm", "--max_grad_norm", _fixed(CLIP_NORM), _equal, advice="use --max_grad_norm 1.0"),
    Rule("the clip is the global-norm clip, before or after the all-reduce", "§14, Bert", "opt_gradient_clip_mode",
         "--clip_mode", _fixed(CLIP_MODES), _one_of,
         advice="use --clip_mode after_allreduce or before_allreduce"),
    Rule("the learning rate decays to 0, as the reference (not a tunable hyperparameter)", "§9.1",
         "opt_end_learning_rate", "--end_learning_rate", _fixed(0.0), _equal, advice="use --end_learning_rate 0"),
    Rule("the polynomial decay counts from step 0, as the reference (not a tunable hyperparameter)", "§9.1",
         "opt_learning_rate_decay_start_step", "--decay_from_warmup_end", _fixed(0), _equal,
         advice="drop --decay_from_warmup_end"),
    Rule("the decay is linear (polynomial power 1.0), as the reference", "§9.1",
         "opt_lamb_learning_rate_decay_poly_power", None, _fixed(1.0), _equal),
    Rule("the quality target is 0.720 masked-LM accuracy", "§4.1", TARGET_KEY, "--target_mlm_accuracy",
         _fixed(TARGET_MLM_ACCURACY), _equal, advice="use --target_mlm_accuracy 0.720"),
    Rule("every eval covers the reference's 10,000-sample eval set", "§9.4", "eval_samples", "--num_eval_examples",
         _fixed(NUM_EVAL_SAMPLES), _equal,
         advice="use the 10,000-sample eval set (data_prep/prepare.py eval) with --num_eval_examples 10000"),
    Rule("evals come every FLOOR(0.05 * (230.23 * GBS + 3,000,000), 25,000) samples", "§9.4", EVAL_ITER_KEY,
         "--eval_iter_samples", _interval, _equal, needs=(GLOBAL_BATCH_KEY,),
         advice="leave --eval_iter_samples unset (the trainer then uses the formula)"),
    Rule("the first eval comes after one eval interval (the eval at 0 samples skipped, no later start)", "§9.4",
         EVAL_ITER_START_KEY, "--eval_iter_start_samples", _interval, _equal, needs=(GLOBAL_BATCH_KEY,),
         advice="leave --eval_iter_start_samples unset (the first eval then comes after one interval)"),
    Rule("training starts from the reference's phase-1 weights", "§2.4", INIT_CHECKPOINT_KEY, "--init_checkpoint",
         _fixed(INIT_CHECKPOINT), _given, advice="give --init_checkpoint the converted phase-1 checkpoint"),
    Rule("sequences are 512 tokens, as the reference data (the eval set may not be cut)", "§6.1, §6.3",
         "max_sequence_length", "--max_seq_length", _fixed(MAX_SEQ_LENGTH), _equal,
         advice="use --max_seq_length 512"),
    Rule("76 masked positions per sequence, as the reference data", "§6.1", "max_predictions_per_seq",
         "--max_predictions_per_seq", _fixed(MAX_PREDICTIONS_PER_SEQ), _equal,
         advice="use --max_predictions_per_seq 76"),
)


@dataclass(frozen=True)
class Broken:
    """A rule a closed-division run breaks, with the value found."""

    rule: Rule
    value: Any
    required: str

    def for_flags(self) -> str:
        """One line for the trainer: the rule, the flag, the required value, how to meet it."""
        rule = self.rule
        setting = rule.flag or rule.key
        shown = "none" if self.value is None else self.value
        return (f"closed division: {rule.what} ({RULES_FILE} {rule.section}): {setting} must be {self.required}, "
                f"got {shown}; {rule.advice}, or run in the open division (--submission_division open)")

    def for_log(self) -> str:
        """One line for a log: the rule, the log key, the required and the logged value."""
        rule = self.rule
        return (f"closed division: {rule.what} ({RULES_FILE} {rule.section}): {rule.key} must be "
                f"{self.required}, the log says {self.value!r}")


def broken_rules(values: Values) -> list[Broken]:
    """The rules `values` (log key -> value) break; rules whose keys are absent are skipped."""
    broken = []
    for rule in RULES:
        if rule.key not in values or any(key not in values for key in rule.needs):
            continue
        required = rule.required(values)
        if not rule.holds(values[rule.key], required):
            broken.append(Broken(rule, values[rule.key], rule.describe_required(values)))
    return broken


def unchecked_keys(values: Values) -> list[str]:
    """The keys of rules that `values` (a log's) cannot be checked against: absent from it."""
    return [rule.key for rule in RULES if any(key not in values for key in (rule.key, *rule.needs))]


class _Config(Protocol):
    """What `config_values` reads of a `settings.TrainConfig` (kept structural: settings imports this)."""

    @property
    def model(self) -> Any: ...

    @property
    def data(self) -> Any: ...

    @property
    def optim(self) -> Any: ...

    @property
    def schedule(self) -> Any: ...

    @property
    def eval(self) -> Any: ...

    @property
    def global_batch_size(self) -> int: ...


def config_values(cfg: _Config) -> dict[str, Any]:
    """The ruled settings of a config, under the log keys the trainer writes them with."""
    gbs = cfg.global_batch_size
    interval = cfg.eval.eval_iter_samples
    interval = eval_interval_samples(gbs) if interval is None else interval
    start = cfg.eval.eval_iter_start_samples
    schedule = cfg.schedule
    return {
        GLOBAL_BATCH_KEY: gbs,
        "opt_name": cfg.optim.optimizer,
        "opt_gradient_clip_norm": cfg.optim.max_grad_norm,
        "opt_gradient_clip_mode": cfg.optim.clip_mode,
        "opt_end_learning_rate": schedule.end_learning_rate,
        "opt_learning_rate_decay_start_step": schedule.resolved_warmup_steps if schedule.decay_from_warmup_end else 0,
        TARGET_KEY: cfg.eval.target_mlm_accuracy,
        "eval_samples": cfg.eval.num_eval_examples,
        EVAL_ITER_KEY: interval,
        EVAL_ITER_START_KEY: interval if start is None else start,
        INIT_CHECKPOINT_KEY: cfg.model.init_checkpoint,
        "max_sequence_length": cfg.data.max_seq_length,
        "max_predictions_per_seq": cfg.data.max_predictions_per_seq,
    }


def closed_division_problem(cfg: _Config) -> str | None:
    """The one error line of a closed-division config that breaks a rule, or None."""
    broken = broken_rules(config_values(cfg))
    if not broken:
        return None
    line = broken[0].for_flags()
    if len(broken) > 1:
        others = ", ".join(b.rule.flag or b.rule.key for b in broken[1:])
        line += f" (also broken: {others})"
    return line
