"""mlperf_bert.optim: LAMB / AdamW, fused and sharded, clipping modes, loss scaling, the schedule."""
