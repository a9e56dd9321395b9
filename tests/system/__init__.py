"""The system as a user starts it: run_and_time.sh, docker, SLURM, two nodes, faults, the clock, make demo."""
