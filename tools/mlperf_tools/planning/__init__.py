"""Planning: a config's memory, step time and time to train before any GPU hour.

- `step_model`: one device's memory fit, step time and eval time from a traced dry run's work;
- `step_calibration`: the GPU measurements in `tools/measurements` and the step model's fit to them;
- `plan`: the planner over the shipped configs (dry run traces, cached);
- `recipe`: global batch, per-device batch, accumulation and hyperparameters for N accelerators;
- `forecast`: when a running job reaches 0.720 and where it lands in the RCP window;
- `simulate_balance`: per-GPU token counts of a step under each load-balancing policy.

May import: results/ (the RCP window and the run logs)
"""
