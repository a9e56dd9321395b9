"""MLPerf Training BERT phase-2 pretraining.

The spine (this folder's modules) composes the subpackages and may import any of them:
`main.py` (the entry: flags, exit codes), `build.py` (every part of a run, built once, in a
fixed order), `trainer.py` (the loop), `startup.py` (the machine's start-up checks),
`outputs.py` (the run's hold on its output folder) and `liveness.py` (lost-rank detection).
Below it, each subpackage's `__init__` says what it owns and which others it may import
(`docs/ARCHITECTURE.md` draws the tree); nothing below the spine imports the spine.
"""

__version__ = "0.1.0"
