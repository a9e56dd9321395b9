"""mlperf_bert.data: reading and validating shards, the training stream, copied-data integrity."""
