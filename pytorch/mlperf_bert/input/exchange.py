"""Moving the samples of one step between ranks: the lengths first, then each sample to its rank.

Every rank of an exchange group (W ranks) holds the B single-sequence items it read for the
step. One balancing step is:
  1. all-gather the headers, [W, B, 3] int32 = (length, masked count, NSP label) per sample,
     so every rank knows the length of every sample of the group;
  2. every rank computes the same deal of the W * B samples from the lengths
     (`balance.deal`: deterministic, W * B samples -> [W, B]);
  3. all-to-all of the sample bodies: a sample travels only to the rank it is dealt to, as
     one flat int32 vector [input_ids | segment_ids | masked positions | masked ids] whose
     offsets follow from the header.
Step 3 moves B samples into each rank where all-gathering the samples would move W * B
(NVIDIA's exchange padding all-gathers them): with W = 8, B = 56 a rank receives ~130 KiB
instead of ~1 MiB, and the traffic per rank stays flat as W grows.

The collectives sit behind `Collectives`: torch.distributed over a gloo group on the host
(`TorchCollectives`, here) or MPI (`host_exchange.MpiCollectives`). The exchange works on
host numpy arrays either way, so a GPU job pays no device round trip or sync for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
import torch
import torch.distributed as dist

from . import balance
from ..data.batch import Item, Sample

HEADER_FIELDS = 3  # per sample: length, masked count, next-sentence label


class Collectives(Protocol):
    """The two collectives of an exchange, over one group of `size` ranks (this one is `rank`)."""

    rank: int
    size: int

    def all_gather(self, local: np.ndarray) -> np.ndarray:
        """int32 [*shape] from every rank -> [size, *shape], rank order."""
        ...

    def all_to_all(self, send: np.ndarray, send_counts: np.ndarray, recv_counts: np.ndarray) -> np.ndarray:
        """int32 [sum(send_counts)], cut into consecutive runs for ranks 0..size-1 -> the runs
        every rank sent here, concatenated in rank order: [sum(recv_counts)]."""
        ...


class TorchCollectives:
    """`Collectives` over a torch.distributed group of CPU tensors (gloo)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def all_gather(self, local: np.ndarray) -> np.ndarray:
        mine = torch.from_numpy(np.ascontiguousarray(local, dtype=np.int32))
        parts = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(parts, mine, group=self.group)
        return torch.stack(parts).numpy()

    def all_to_all(self, send: np.ndarray, send_counts: np.ndarray, recv_counts: np.ndarray) -> np.ndarray:
        received = torch.empty(int(recv_counts.sum()), dtype=torch.int32)
        dist.all_to_all_single(received, torch.from_numpy(np.ascontiguousarray(send, dtype=np.int32)),
                               output_split_sizes=recv_counts.tolist(), input_split_sizes=send_counts.tolist(),
                               group=self.group)
        return received.numpy()


@dataclass(frozen=True)
class Exchanged:
    """One rank's result of an exchange step."""

    items: list[Item]  # the samples dealt to this rank, in deal order (shortest first)
    group_tokens: np.ndarray  # [W] real tokens every rank of the group received


def encode_header(items: Sequence[Item]) -> np.ndarray:
    """[B, 3] int32: (length, masked count, NSP label) of each single-sequence item."""
    samples = single_samples(items)
    return np.array([(s.length, s.masked_lm_positions.shape[0], s.next_sentence_label) for s in samples],
                    dtype=np.int32).reshape(len(samples), HEADER_FIELDS)


def single_samples(items: Sequence[Item]) -> list[Sample]:
    if any(len(item) != 1 for item in items):
        raise ValueError("load balancing moves single sequences; packed rows are already balanced (--balance none)")
    return [item[0] for item in items]


def body_sizes(headers: np.ndarray) -> np.ndarray:
    """[..., 3] headers -> [...] int32 values in each sample's body (2 per token, 2 per masked slot)."""
    return 2 * headers[..., 0] + 2 * headers[..., 1]


def encode_body(sample: Sample) -> np.ndarray:
    return np.concatenate([sample.input_ids, sample.segment_ids, sample.masked_lm_positions,
                           sample.masked_lm_ids]).astype(np.int32, copy=False)


def decode_body(body: np.ndarray, header: np.ndarray) -> Sample:
    """Inverse of `encode_body`, given the sample's header row (length n, masked count k, label)."""
    n, k, label = (int(v) for v in header)
    return Sample(body[:n], body[n:2 * n], body[2 * n:2 * n + k], body[2 * n + k:2 * n + 2 * k], label)


def outgoing(assignment: np.ndarray, rank: int, local_batch: int) -> tuple[np.ndarray, np.ndarray]:
    """What `rank` sends: (flat sample ids in send order, destination rank of each).

    Flat id i = sample i % B of rank i // B. Destinations ascend; to each destination the samples
    go in the order it is dealt them, which is the order it receives them from this rank.
    """
    own = assignment // local_batch == rank  # [W, B]
    destinations, _ = np.nonzero(own)
    return assignment[own], destinations


def incoming(assignment: np.ndarray, rank: int, local_batch: int) -> tuple[np.ndarray, np.ndarray]:
    """What `rank` receives: (flat sample ids in arrival order, the position of each in its deal)."""
    dealt = assignment[rank]
    arrival = np.argsort(dealt // local_batch, kind="stable")  # by source rank, deal order within
    return dealt[arrival], arrival


def _split_sizes(ranks: np.ndarray, sizes: np.ndarray, num_ranks: int) -> np.ndarray:
    """[num_ranks] int64: the body values that go to (or come from) each rank."""
    return np.bincount(ranks, weights=sizes, minlength=num_ranks).astype(np.int64)


def exchange(items: Sequence[Item], comm: Collectives, order: str) -> Exchanged:
    """Deals the group's samples of one step (`order`: raster, snake, greedy); returns this rank's."""
    local_batch = len(items)
    headers = comm.all_gather(encode_header(items)).reshape(-1, HEADER_FIELDS)  # [W * B, 3]
    assignment = balance.deal(headers[:, 0], comm.size, order)  # [W, B] flat ids
    mine = _move_bodies(single_samples(items), headers, assignment, comm)
    tokens = balance.gpu_tokens(headers[:, 0].reshape(comm.size, local_batch), assignment)
    return Exchanged(mine, tokens)


def _move_bodies(samples: list[Sample], headers: np.ndarray, assignment: np.ndarray, comm: Collectives) -> list[Item]:
    """The all-to-all of step 3; returns this rank's samples in deal order."""
    local_batch, sizes = len(samples), body_sizes(headers)
    send_ids, destinations = outgoing(assignment, comm.rank, local_batch)
    send = np.concatenate([np.zeros(0, np.int32)] + [encode_body(samples[i % local_batch]) for i in send_ids])
    recv_ids, positions = incoming(assignment, comm.rank, local_batch)
    received = comm.all_to_all(send, _split_sizes(destinations, sizes[send_ids], comm.size),
                               _split_sizes(recv_ids // local_batch, sizes[recv_ids], comm.size))
    ends = np.cumsum(sizes[recv_ids])
    mine: list[Item] = [()] * local_batch
    for i, start, end, position in zip(recv_ids, ends - sizes[recv_ids], ends, positions):
        mine[position] = (decode_body(received[start:end], headers[i]),)
    return mine
