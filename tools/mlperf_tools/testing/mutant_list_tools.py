"""Mutants of the tools: the planner, the recipe finder, the forecast, scoring and the numerics bands.

Round 2 of the mutation study (`mutants.py --round 2`), beside `mutant_list.MUTANTS` (the trainer's and
data preparation's modules); `mutants.py` runs both lists. The same form: an exact snippet of its module, its replacement, the bug it stands for, and the tests
(empty: the module's `TOOL_MODULE_TESTS`). These are the bugs that hide from tests built on tiny
examples: a boundary value itself, sizes that do not divide, a multi-node or accumulation path, a
precision's own branch, a constant off by a few tens of percent, a record left out, an off-by-one.
"""

from __future__ import annotations

from mlperf_tools.testing.mutant_list import Mutant, _m2 as _m  # round 2: written from the modules alone

PLAN = "tools/mlperf_tools/planning/plan.py"
STEP_MODEL = "tools/mlperf_tools/planning/step_model.py"
CALIBRATION = "tools/mlperf_tools/planning/step_calibration.py"
RECIPE = "tools/mlperf_tools/planning/recipe.py"
FORECAST = "tools/mlperf_tools/planning/forecast.py"
SCORING = "tools/mlperf_tools/results/scoring.py"
PACKAGE = "tools/mlperf_tools/results/package_results.py"
NUMERICS = "tools/mlperf_tools/bring_up/numerics_check.py"

TOOL_MODULE_TESTS: dict[str, tuple[str, ...]] = {
    PLAN: ("tests/tools/planning/test_plan.py", "tests/tools/planning/test_step_calibration.py"),
    STEP_MODEL: ("tests/tools/planning/test_plan.py", "tests/tools/planning/test_step_calibration.py"),
    CALIBRATION: ("tests/tools/planning/test_step_calibration.py",),
    RECIPE: ("tests/tools/planning/test_recipe.py",),
    FORECAST: ("tests/trainer/hooks/test_forecast.py",),
    SCORING: ("tests/tools/results/test_scoring.py", "tests/tools/results/test_package_results.py"),
    PACKAGE: ("tests/tools/results/test_package_results.py",),
    NUMERICS: ("tests/tools/bring_up/test_numerics_check.py", "tests/tools/bring_up/test_numerics_bands.py"),
}

TOOL_MUTANTS: list[Mutant] = [
    # ------------------------------------------------------------ planning/plan.py
    _m("plan-r2-01", PLAN, "per_node = GPUS_PER_NODE.get(device, 8)", "per_node = 8",
       "--gpus splits every system into nodes of 8: a GB200 tray's 4 ignored"),
    _m("plan-r2-02", PLAN, '"DGXNNODES": str(max(gpus // per_node, 1))', '"DGXNNODES": env["DGXNNODES"]',
       "--gpus on more nodes keeps the config's node count (16 GPUs planned as 1 x 8)"),
    _m("plan-r2-03", PLAN, "gpus, per_node, gbs = batch.world_size,", 'gpus, per_node, gbs = int(env["DGXNGPU"]),',
       "the world size read as DGXNGPU alone: a multi-node config's other nodes ignored"),
    _m("plan-r2-04", PLAN, 'int(env["DGXNGPU"]), batch.global_batch_size',
       'int(env["DGXNGPU"]), batch.global_batch_size * batch.accumulation_steps',
       "accumulation counted twice: BATCHSIZE already holds it, the global batch multiplied again"),
    _m("plan-r2-05", PLAN, "return 1 + max(math.ceil((samples - start) / every), 0)",
       "return 1 + max(math.floor((samples - start) / every), 0)",
       "evals counted up to the last eval BEFORE the samples (floor), not the first at or after them"),
    _m("plan-r2-06", PLAN, "stop = math.ceil(at / self.gbs) * self.gbs", "stop = at // self.gbs * self.gbs",
       "the stop rounded down to a whole step: an interval the batch does not divide loses its last step"),
    # ------------------------------------------------------------ planning/step_model.py
    _m("sm-r2-01", STEP_MODEL, "needed = memory.peak * (1 + constant(\"memory_margin\"))",
       "needed = memory.train_peak * (1 + constant(\"memory_margin\"))",
       "the memory fit ignores the eval-time peak (training peak only)"),
    _m("sm-r2-02", STEP_MODEL, 'constant("memory_reserved_gib") * (1 << 30)', 'constant("memory_reserved_gib") * GB',
       "the reserved CUDA context counted in GB, not GiB (7 % short)"),
    _m("sm-r2-03", STEP_MODEL, "if ranks <= device.nvlink_domain:", "if ranks < device.nvlink_domain:",
       "a full NVLink domain (a DGX's 8 GPUs) taken as crossing InfiniBand"),
    _m("sm-r2-04", STEP_MODEL, "min(device.nvlink_bytes_per_s, per_node * device.network_bytes_per_s)",
       "device.network_bytes_per_s",
       "across nodes one NIC per ring: the node's other NICs ignored (multi-node collectives 8x slow)"),
    _m("sm-r2-05", STEP_MODEL, "our_terms(f, device, work.eval_captured)",
       "our_terms(f, device, work.captured)",
       "our eval timed as graphed whenever the training step is (the eval's own capture ignored)"),
    _m("sm-r2-06", STEP_MODEL, 'work["compiled_bytes" if op.compiled else "elementwise_bytes"] += n * op.bytes',
       'work["elementwise_bytes"] += n * op.bytes',
       "a compiled region's traced bytes timed again at the eager rate, beside Inductor's count of its kernels"),
    # ------------------------------------------------------------ planning/step_calibration.py
    _m("sc-r2-01", CALIBRATION, "others = fit([o for o in observations if o.timed.setup != setup], profiled)",
       "others = fit([o for o in observations if o is not own[0]], profiled)",
       "leave-one-out leaves out one measurement, not the set-up: its repeats stay in the fit"),
    _m("sc-r2-02", CALIBRATION, "measured = sum(o.timed.ms_per_step for o in own) / len(own)",
       "measured = own[0].timed.ms_per_step",
       "a set-up measured several times checked against its first measurement, not their mean"),
    _m("sc-r2-03", CALIBRATION, "abs(Check.miss(c.left_out_ms, c.measured_ms))",
       "abs(Check.miss(c.fitted_ms, c.measured_ms))",
       "the spread taken from the in-sample fit instead of the left-out prediction"),
    _m("sc-r2-04", CALIBRATION, '**bench.get("config_vars", {}), **result.get("config_vars", {}),',
       '**bench.get("config_vars", {}),',
       "a benchmark result's own config_vars left out of its set-up"),
    _m("sc-r2-05", CALIBRATION, 'env.get("COMPILE_MODE", "none") != "none"', 'env.get("COMPILE_MODE") != "none"',
       "a config that sets no COMPILE_MODE taken as compiled (Inductor's step generated for an eager one)"),
    # ------------------------------------------------------------ planning/recipe.py
    _m("rc-r2-01", RECIPE, "while device_memory_gb(fits + 1) <= usable:", "while device_memory_gb(fits + 1) < usable:",
       "a micro-batch that fills the usable memory exactly refused (boundary)"),
    _m("rc-r2-02", RECIPE, "usable, fits = memory_gb * USABLE_FRACTION, 0", "usable, fits = memory_gb, 0",
       "the allocator's 10 % left out: micro-batches sized to the whole device"),
    _m("rc-r2-03", RECIPE, "if per_device % a == 0 and per_device // a <= limit", "if per_device // a <= limit",
       "accumulation steps that do not divide the per-device batch accepted (unequal micro-batches)"),
    _m("rc-r2-04", RECIPE, "sizes |= {bs // devices * devices, -(-bs // devices) * devices}",
       "sizes |= {bs // devices * devices}",
       "an RCP point N devices do not divide only rounded down: the multiple above it never offered"),
    _m("rc-r2-05", RECIPE, '"BATCHSIZE": str(chosen.per_device)', '"BATCHSIZE": str(chosen.micro_batch)',
       "the written BATCHSIZE is the micro-batch: the accumulation left out of the global batch"),
    # ------------------------------------------------------------ planning/forecast.py
    _m("fc-r2-01", FORECAST, "if forecast.low >= bound:", "if forecast.low > bound:",
       "a forecast whose low end is exactly the bound called uncertain (boundary)"),
    _m("fc-r2-02", FORECAST, "if count is not None and count > len(run.evals):",
       "if count is not None and count >= len(run.evals):",
       "--evals K refused when K is every eval the log has (off by one)"),
    _m("fc-r2-03", FORECAST, "list(seconds[:count])", "list(seconds[-count:])",
       "--evals K pairs the first K evals with the LAST K evals' times"),
    _m("fc-r2-04", FORECAST, "return list(evals[:count]), None", "return list(evals[-count:]), None",
       "--evals K forecasts from the LAST K evals, not the first K (a finished log: its target eval)"),
    _m("fc-r2-05", FORECAST,
       'return _positive(run, "opt_learning_rate_training_steps") * _positive(run, "global_batch_size")',
       'return _positive(run, "opt_learning_rate_training_steps")',
       "the LR schedule's length counted in steps, not samples (the global batch left out)"),
    # ------------------------------------------------------------ results/scoring.py
    _m("score-r2-01", SCORING, "kept = sorted(self.samples)[1:-1]", "kept = sorted(self.samples)[1:]",
       "the olympic mean of samples keeps the slowest run"),
    _m("score-r2-02", SCORING, "chosen = by_score[len(by_score) // 2]", "chosen = by_score[(len(by_score) - 1) // 2]",
       "with an even number of windows the faster middle one is taken (favours the submitter)"),
    _m("score-r2-03", SCORING, "for i in range(len(ordered) - size + 1))", "for i in range(len(ordered) - size))",
       "the last window of consecutive runs never scored (off by one)"),
    _m("score-r2-04", SCORING, "key=lambda run: (launch_ms(run), str(run.path))", "key=lambda run: str(run.path)",
       "runs ordered by file name (result_10 before result_2), not by launch time"),
    _m("score-r2-05", SCORING, "return run.minutes if run.converged and run.minutes is not None else math.inf",
       "return run.minutes if run.minutes is not None else math.inf",
       "an aborted run that has a run_stop counted with its time instead of as infinitely slow"),
    # ------------------------------------------------------------ results/package_results.py
    _m("pkg-r2-01", PACKAGE, "return any(MLLOG_TOKEN in line for line in lines)",
       "return MLLOG_TOKEN in lines.readline()",
       "a result file judged by its first line only: a log that opens with a launcher line called stray"),
    _m("pkg-r2-02", PACKAGE, "if not value.isdigit() or int(value) <= 0:", "if not value.isdigit():",
       "a config's batch variable of 0 accepted as a global batch size"),
    _m("pkg-r2-03", PACKAGE, '("; open division: no RCP check" if division == "open" else "")',
       '("; open division: no RCP check" if division != "closed" else "")',
       "a batch size without a config (--gbs) or its division unset called open division"),
    # ------------------------------------------------------------ bring_up/numerics_check.py
    _m("nc-r2-01", NUMERICS, '"bf16": 2.0**-8,', '"bf16": 2.0**-7,',
       "bf16's unit roundoff from its 7 stored bits (2^-7), not 8 significant ones: bands 2x loose"),
    _m("nc-r2-02", NUMERICS, '"fp16": 2.0**-11,', '"fp16": 2.0**-10,',
       "fp16's unit roundoff from its 10 stored bits (2^-10): fp16 bands 2x loose"),
    _m("nc-r2-03", NUMERICS, 'Formats("bf16", "e4m3", "e5m2")', 'Formats("bf16", "e4m3", "e4m3")',
       "FP8 output gradients banded as e4m3, not e5m2 (their backward's bands 2x tight)"),
    _m("nc-r2-04", NUMERICS, "condition = max(1.0, conditions.get(spec.key, 1.0))",
       "condition = conditions.get(spec.key, 1.0)",
       "a condition factor below 1 shrinks the band (the max(1, kappa) floor dropped)"),
    _m("nc-r2-05", NUMERICS, "attention_k = max(bert.head_dim, max_seqlen)", "attention_k = bert.head_dim",
       "the attention GEMMs' inner size taken as head_dim only (P x V sums over the sequence)"),
    _m("nc-r2-06", NUMERICS, "stream += share**2 * (fresh + stage.forward**2)",
       "stream += share * (fresh + stage.forward**2)",
       "a branch's share of the LayerNorm input applied to the variance unsquared (bands too loose)"),
]
