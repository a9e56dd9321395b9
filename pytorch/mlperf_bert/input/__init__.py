"""The input pipeline: a rank's micro-batches from its stream to the device.

Owns: `sources.py` (what a batch source is: `BatchSource`, the local and exchanging
sources, the per-rank token meter), `slots.py` (a rank's micro-batch slots: the items of each
step whatever the number of ranks), `source_factory.py` (which source a run's --balance
builds, after the start-up data check), `balance.py` (the balancing policies as pure
functions), `exchange.py` (the sample exchange over torch.distributed), `host_exchange.py`
(the same over MPI on a host thread), `device_input.py` and `dali_input.py` (host to device,
read ahead).

May import: data/, config/, runtime/
"""
