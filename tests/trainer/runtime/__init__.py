"""mlperf_bert.runtime: rank facts, torchrun's launcher, the pre-flight, optional packages, files."""
