"""One training step and what keeps a run correct across steps.

Owns: `step.py` (the `Step` interface: `EagerStep`, `GraphedStep`), `cuda_graphs.py`
(capture and replay), `sync_window.py` (one host read every N steps, with roll-back),
`faults.py` (preemption, numeric blow-ups, the `Guard`), `state.py` (the counters a
checkpoint keeps), `checkpoint.py` (run checkpoints: atomic save, exact resume),
`evaluation_interval.py` (the MLPerf eval schedule) and `metrics.py` (loss and accuracy
summed on the device).

Nothing here knows the input pipeline or the hooks: the spine hands the step its batches.

May import: model/, optim/, data/, config/, runtime/
"""
