"""mlperf_bert.model: BERT against HuggingFace, the attention back-ends, FP8, bert_config.json, init checkpoints."""
