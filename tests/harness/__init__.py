"""The test system's machinery: what the tests start, fake, share and read, and no test of its own.

- paths, commands, demo, shared_folder, file_order: where things are, commands run as a user runs
  them, the session's demo data and the trainer flags for it, the order the test files start in;
- served, launches, ports, cpu_run: trainer and dry-run processes (served to a module, launched
  per rank, or built in this process) and the ports their ranks agree on;
- workers/: the programs those processes run, one rank or one probe each;
- tiny_bert, fp8_bert, optimizer_runs, thread_ranks, tensors, golden_samples, rcp_results,
  broken_packages, closed_runs, refusals, triton_interpreter: models, runs, data and checks that
  tests of several files share;
- fakes/: stand-ins for what a CPU machine lacks (srun, scontrol, docker, apex, a CUDA build, the trainer);
- open_audit/: the file-open audit the clock tests put on PYTHONPATH;
- data/: published MLPerf logs and the MLCommons scripts' reference outputs.

The tests import the project and this package; this package imports the project (mlperf_bert, data_prep,
mlperf_tools) and itself, never a test module nor a conftest.py (tools/check_layering.py checks both).
"""
