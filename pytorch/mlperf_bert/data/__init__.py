"""The data on disk and on the host: shard formats, reading, checking, the batch types.

Owns: `shards.py` (the hdf5 formats, shared with data_prep), `validate.py` (every row
against the model's limits), `integrity.py` (copied shards, eval samples in training),
`dataset.py` (a rank's shuffled, resumable stream; the eval
set), `stratified.py` (stratified folders, stratum shares and counts), `batch.py` (`Sample`,
`FlatBatch`, `PaddedBatch` and the helpers over a batch's tensor fields), `static_batch.py`
(packed rows as static shapes for CUDA graphs), `lengths.py` and the Wikipedia phase-2
length histogram.

Nothing here knows how samples are balanced across ranks or moved to a device. This
`__init__`, `shards.py` and `integrity.py` stay free of torch: data_prep imports them.

May import: runtime/
"""
