"""Where things are: the checkout, the trainer's entry point, and the harness's fakes and fixture data."""

from __future__ import annotations

from pathlib import Path

HARNESS = Path(__file__).resolve().parent
REPO = HARNESS.parents[1]  # tests/harness/paths.py
TRAINER = REPO / "pytorch" / "run_pretraining.py"
FAKES = HARNESS / "fakes"
FAKE_COMMANDS = FAKES / "bin"  # srun, scontrol, docker: put first on PATH
OPEN_AUDIT = HARNESS / "open_audit"  # sitecustomize.py: put first on PYTHONPATH
MLPERF_LOGS = HARNESS / "data" / "mlperf_logs"
REFERENCE_SAMPLES = HARNESS / "data" / "reference_samples"
