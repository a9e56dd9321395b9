"""Load balancing of variable-length samples across GPUs, as pure host-side functions.

With unpadded batches a GPU's step time grows with the real tokens it gets, and the step
waits for the slowest GPU. The policies here redistribute the samples of one global step
so that every GPU keeps the same number of samples (the global batch is unchanged; only
who computes which sample changes) while the per-GPU token counts come closer together.

Shapes: G GPUs, B samples per GPU (local batch), N GPUs per node. `lengths` of one step is
[G, B] (row g = the local batch GPU g read); any leading dimensions are independent steps,
which the balance simulator uses to run many trials at once. A policy returns an index
array of the same shape: entry [g, i] is the flat index (into lengths.reshape(G * B)) of
the i-th sample GPU g processes.

Policies (Kim et al., "Breaking MLPerf Training: A Case Study on Optimizing BERT"):
  none           every GPU keeps its own local batch
  global_*       all G*B samples are gathered, sorted by length and dealt to all G GPUs
  local_*        the same inside each node of N GPUs (an all-gather inside the node only)
with the deal orders of `deal`: raster (NVIDIA's global presort), snake (Samsung's local
presort), greedy (longest first to the least-loaded GPU). Stratified local batches (a fixed
count from each length stratum) are a property of how batches are read, not a
redistribution: they live with the data reader (`data/stratified.py`).
"""

from __future__ import annotations

import numpy as np

ORDERS = ("raster", "snake", "greedy")
POLICIES = (
    "none",
    "global_presort",
    "global_snake",
    "global_greedy",
    "local_presort",
    "local_snake",
    "local_greedy",
)


def deal(lengths: np.ndarray, num_bins: int, order: str) -> np.ndarray:
    """Assigns the n samples in the last axis of `lengths` [..., n] to `num_bins` bins.

    Returns [..., num_bins, n / num_bins] sample indices (bin b processes the samples in row
    b), a permutation of 0..n-1 per leading index, so every bin gets exactly n / num_bins
    samples. Samples are sorted by length into rows of num_bins (row 0 shortest), then:
      raster  sample j of every row goes to bin j (bin num_bins-1 gets the longest of each row)
      snake   as raster, with every second row reversed, so long and short alternate
      greedy  rows longest first; in each row the longest sample goes to the least-loaded
              bin so far, the next to the next least-loaded, ... (a capacity of one sample
              per bin per row keeps the counts equal)
    Ties are broken by position (stable sorts), so the deal is deterministic.
    """
    if order not in ORDERS:
        raise ValueError(f"unknown deal order {order!r}; choose one of {ORDERS}")
    n = lengths.shape[-1]
    if num_bins < 1 or n % num_bins:
        raise ValueError(f"{n} samples cannot be dealt evenly to {num_bins} bins")
    rows = np.argsort(lengths, axis=-1, kind="stable").reshape(*lengths.shape[:-1], n // num_bins, num_bins)
    if order == "snake":
        rows[..., 1::2, :] = rows[..., 1::2, ::-1]
    elif order == "greedy":
        rows = _greedy_rows(lengths, rows)
    return np.swapaxes(rows, -1, -2).copy()


def _greedy_rows(lengths: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Reorders each sorted row [..., R, G] so column g holds what greedy gives bin g."""
    num_rows, num_bins = rows.shape[-2:]
    flat_rows = rows.reshape(-1, num_rows, num_bins)  # [M, R, G], M = independent steps
    flat_lengths = lengths.reshape(flat_rows.shape[0], -1)  # [M, n]
    step = np.arange(flat_rows.shape[0])[:, None]
    out = np.empty_like(flat_rows)
    loads = np.zeros((flat_rows.shape[0], num_bins), dtype=np.int64)  # tokens per bin so far
    for r in range(num_rows - 1, -1, -1):
        longest_first = flat_rows[:, r, ::-1]  # [M, G] sample indices
        least_loaded = np.argsort(loads, axis=-1, kind="stable")  # [M, G] bin ids
        out[step, r, least_loaded] = longest_first
        loads[step, least_loaded] += flat_lengths[step, longest_first]
    return out.reshape(rows.shape)


def balance(lengths: np.ndarray, policy: str, gpus_per_node: int = 8) -> np.ndarray:
    """Which samples of one step each GPU processes under `policy` (see module docstring).

    `lengths` [..., G, B] -> [..., G, B] flat indices into lengths.reshape(..., G * B).
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown balance policy {policy!r}; choose one of {POLICIES}")
    if lengths.ndim < 2:
        raise ValueError(f"lengths must be [..., gpus, local_batch], got shape {lengths.shape}")
    if policy == "none":
        own = np.arange(lengths.shape[-2] * lengths.shape[-1]).reshape(lengths.shape[-2:])
        return np.broadcast_to(own, lengths.shape).copy()
    scope, order = policy.split("_")
    order = "raster" if order == "presort" else order  # "presort" alone names the raster deal
    if scope == "global":
        return global_presort(lengths, order)
    return local_presort(lengths, gpus_per_node, order)


def global_presort(lengths: np.ndarray, order: str = "raster") -> np.ndarray:
    """All samples of all GPUs sorted and dealt over all G GPUs. [..., G, B] -> [..., G, B]."""
    num_gpus, local_batch = lengths.shape[-2:]
    flat = lengths.reshape(*lengths.shape[:-2], num_gpus * local_batch)
    return deal(flat, num_gpus, order)


def local_presort(lengths: np.ndarray, gpus_per_node: int, order: str = "snake") -> np.ndarray:
    """Samples sorted and dealt inside each node of `gpus_per_node` GPUs only.

    [..., G, B] -> [..., G, B] global flat indices; GPU g's samples all come from its node.
    """
    num_gpus, local_batch = lengths.shape[-2:]
    if gpus_per_node < 1 or num_gpus % gpus_per_node:
        raise ValueError(f"{num_gpus} GPUs do not split into nodes of gpus_per_node={gpus_per_node}")
    nodes = num_gpus // gpus_per_node
    per_node = gpus_per_node * local_batch
    grouped = lengths.reshape(*lengths.shape[:-2], nodes, per_node)
    local = deal(grouped, gpus_per_node, order)  # [..., nodes, N, B] indices inside the node
    offsets = (np.arange(nodes) * per_node)[:, None, None]
    return (local + offsets).reshape(*lengths.shape)


def gpu_tokens(lengths: np.ndarray, assignment: np.ndarray) -> np.ndarray:
    """Real tokens per GPU: [..., G, B] lengths and a policy's [..., G, B] indices -> [..., G]."""
    flat = lengths.reshape(*lengths.shape[:-2], -1)
    picked = np.take_along_axis(flat, assignment.reshape(flat.shape), axis=-1)
    return picked.reshape(assignment.shape).sum(axis=-1, dtype=np.int64)
