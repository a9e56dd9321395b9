"""The optimizer step's parts: optimizers, learning-rate schedule, clipping, loss scaling.

Owns: `optimizers.py` (LAMB and ADAM(W): reference, multi-tensor, apex), `sharded.py` (the
multi-tensor ones sharded over the ranks: reduce-scatter, 1/W of the update, all-gather),
`capturable.py` (their graph-safe twins: step count and learning rate on the device), `schedule.py`,
`clipping.py` (the clipping modes and their DDP communication hooks) and `loss_scale.py`
(fp16 loss scaling on the device).

May import: config/, runtime/
"""
