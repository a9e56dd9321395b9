"""The process around the trainer: distributed set-up, exit codes, atomic file writes.

Owns: `distributed.py` (the process group from torchrun or SLURM variables), `exits.py`
(every exit code, and the exit folder through which ranks hand theirs to a launcher),
`launch.py` (torchrun's agent without its report for the trainer's own stops), `orphan.py` (a
worker stops when its launcher dies) and `files.py`
(the one atomic write, its fsync guarantees as parameters). `files.py` and this `__init__` are free of torch: data_prep imports them.

May import: nothing
"""
