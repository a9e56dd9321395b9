"""mlperf_tools.testing and the suite itself: mutants, layering, the kill soak, the type check, the shared set-up."""
