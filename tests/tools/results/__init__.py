"""mlperf_tools.results: packaging, scoring and comparing MLPerf logs against the official checkers."""
