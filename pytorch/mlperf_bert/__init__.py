"""MLPerf Training BERT phase-2 pretraining."""

__version__ = "0.1.0"
