"""Bring-up: what runs on a new machine before its first real job.

- `numerics_check`: layer by layer against an fp64 reference, in every precision the device has;
- `workload`: the synthetic sequences (Wikipedia lengths, MLPerf masking) it and the throughput
  benchmark run;
- `gpu_perf_report`: the prepared GPU measurement's figures, one line each.

May import: nothing
"""
