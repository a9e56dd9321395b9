"""The programs the tests start as processes of their own, each run as `python -m tests.harness.workers.NAME`
from the repository root: one rank of a multi-process run, an instrumented trainer, several trainer runs in
one process, or a probe that must load before torch."""
