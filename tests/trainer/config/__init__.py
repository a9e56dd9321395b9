"""mlperf_bert.config: hostile configs, the closed-division rules, the config variables in errors."""
