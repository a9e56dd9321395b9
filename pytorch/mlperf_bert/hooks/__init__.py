"""What watches a run: the hook interface and every hook the trainer installs.

Owns: `events.py` (the `Hook` interface and its events), `train_hooks.py` (per-rank token
load, MLPerf log results, periodic checkpoints, preemption), `mllog.py` (the MLPerf logging
interface), `live.py` (progress view and train.log), `report.py` (end-of-run summary and
curves) and `forecast.py` (when a run will reach the target, from its first evals).

May import: train/, input/, model/, optim/, data/, config/, runtime/
"""
