"""The trainer (pytorch/mlperf_bert): its entry point and start-up here, each subpackage in the folder of its name."""
