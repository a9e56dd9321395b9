"""The optimizer step's parts: optimizers, learning-rate schedule, clipping, loss scaling.

Owns: `optimizers.py` (LAMB and ADAM(W): reference, fused, apex), `fused.py` and `fused_kernels.py`
(their update in at most three passes: multi-tensor ops on the CPU, Triton kernels on a GPU),
`sharded.py` (the fused ones sharded over the ranks: reduce-scatter, 1/W of the update, all-gather),
`capturable.py` (their graph-safe twins: step count and learning rate on the device), `schedule.py`,
`clipping.py` (the clipping modes and their DDP communication hooks) and `loss_scale.py`
(fp16 loss scaling on the device).

May import: config/, runtime/
"""
