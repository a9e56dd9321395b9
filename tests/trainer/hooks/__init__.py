"""mlperf_bert.hooks: the MLPerf log, the live view and report, the forecast, the training hooks."""
