"""mlperf_bert.input: batch sources, load balancing, slots across world sizes, DALI, the data check."""
