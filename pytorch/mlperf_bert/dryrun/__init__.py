"""Dry run of the GPU path: the trainer's build, steps and eval on 'cuda' without a GPU.

`python -m mlperf_bert.dryrun [--steps N] [--real] -- <trainer flags>` loads a fake CUDA
device into torch (`native`, before torch is imported; a CUDA build's own CUDA hooks give way to
it: fake_cuda.cpp), runs the configured
steps and an eval under FakeTensorMode (`run`), prints the host reads per step with their
source lines (`record`) and the side streams, event records and stream waits it saw
(`cuda_standins`: the grouped attention's groups show there), and fails on a host read or
host<->device copy inside a CUDA-graph capture or on more host reads per sync window than
the config promises. With `--real` the same code runs on a real GPU (`make gpu-check`), its
graphs' captures and replays counted as the stand-in's are (`cuda_standins.counted`). It also prints one
device's memory estimate (`cost` counts live device bytes and each op's work per phase,
`estimate` reads the peaks off it; the ops of compiled regions are marked); `shipped` traces
config_*.sh files at BERT-Large shapes, `compiled` (`python -m mlperf_bert.dryrun.compiled CONFIG`) has
Inductor generate a config's compiled step for its GPU on the fake device presenting that GPU (`gpus`,
`inductor`), nothing compiled or launched, and counts its graphs, graph breaks, kernels and their bytes
(`kernels`), and `planned` runs both for tools/plan.py.

Nothing in this package may import torch at import time: `__main__` loads the fake device
first.

May import: the spine, config/, data/, input/, model/, optim/, train/, hooks/, runtime/ (it
drives a whole run)
"""
