"""The tools' own code: what the command-line entry points in `tools/` run, importable from a notebook.

Each entry point in `tools/` is a few lines that call a `main` here (`tools/README.md` lists them by
kind). The subpackages, by what they are for:
- `results/`: reading MLPerf logs, scoring (olympic mean, RCP window), packaging and checking a
  submission, comparing vendors' results, rebuilding a finished run's summary;
- `planning/`: before the cluster hour: the step model and its calibration, the planner, the recipe
  finder, the forecast of a running job, the load-balance simulation;
- `bring_up/`: a new machine: the numerics check against an fp64 reference, its synthetic workload,
  the GPU measurement's report;
- `testing/`: the test system's own tools: mutation testing, the kill soak, the layering check.

They import the trainer (`mlperf_bert`) and the data preparation (`data_prep`); neither of those
imports this package. The tools work on a checkout: the ones that read the configs or the tests'
data find them from their own path.
"""
