"""mlperf_bert.dryrun: the fake-CUDA dry run of the shipped configs, its accounting and compiled step."""
