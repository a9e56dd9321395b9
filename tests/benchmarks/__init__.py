"""benchmarks/: the throughput, attention and config benchmarks in their tiny CPU forms."""
