"""mlperf_bert.train: the eager and graphed steps, the fast path, eval, checkpoints, numeric blow-ups."""
