"""Data preparation for the MLPerf BERT phase-2 benchmark.

From the MLCommons Wikipedia text (`part-XXXXX-of-00500`, `eval.txt`) and `vocab.txt` to the
hdf5 shards the trainer reads (fixed, varlength, packed, stratified; docs/ARCHITECTURE.md),
plus dataset verification and the phase-1 checkpoint conversion. The command line is
`python data_prep/prepare.py`; data_prep/README.md walks through a full run.
"""
