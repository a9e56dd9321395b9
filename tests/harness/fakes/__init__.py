"""Stand-ins for what a CPU machine without a cluster lacks: bin/ holds srun, scontrol and docker (put first
on PATH), cuda_build/ a CUDA build's registration for a CPU-only torch, apex.py NVIDIA apex's fused
optimizers, trainer.py run_and_time.sh's trainer with a synthetic MLPerf log."""
