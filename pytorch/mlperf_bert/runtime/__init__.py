"""The process around the trainer: distributed set-up, exit codes, atomic file writes.

Owns: `distributed.py` (the process group from torchrun or SLURM variables), `exits.py`
(every exit code, and the exit folder through which ranks hand theirs to a launcher),
`launch.py` (torchrun's agent without its report for the trainer's own stops), `orphan.py` (a
worker stops when its launcher dies), `files.py`
(the one atomic write, its fsync guarantees as parameters), `optional.py` (optional packages:
missing, or installed but broken, as one line), `load_errors.py` (why torch.load refused a
file, as one line) and `torch_version.py` (the oldest torch the trainer runs on). `files.py`,
`optional.py`, `load_errors.py`, `torch_version.py` and this `__init__` are free of torch
(data_prep imports the first three; the trainer's entry point asks the last before its own imports).

May import: nothing
"""
