"""Host-side samples and the flat (unpadded) batch the model consumes.

Every input layout ends in the same `FlatBatch`: all real tokens of all sequences
concatenated into one [T] vector, with `cu_seqlens` marking where each sequence starts.
A padded batch is unpadded on the device (`unpad`), an unpadded batch is built flat on the
host (`flatten_items`), and a packed row is just several sequences that happen to share a
512-token row, so it flattens the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Callable, ClassVar, Protocol, Sequence, TypeVar

import numpy as np
import torch

# The label of a slot that counts for nothing (padding of a static batch); torch's default
# ignore_index of cross_entropy.
IGNORE_INDEX = -100



class TensorBatch(Protocol):
    """A dataclass with tensor fields (FlatBatch, PaddedBatch)."""

    __dataclass_fields__: ClassVar[dict[str, Any]]


BatchT = TypeVar("BatchT", bound=TensorBatch)


def tensor_fields(batch: Any) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor field of a batch dataclass, in field order."""
    return [(f.name, v) for f in fields(batch) for v in [getattr(batch, f.name)] if isinstance(v, torch.Tensor)]


def map_tensors(batch: BatchT, fn: Callable[[torch.Tensor], torch.Tensor]) -> BatchT:
    """A copy of a batch dataclass with `fn` applied to every tensor field."""
    return replace(batch, **{name: fn(t) for name, t in tensor_fields(batch)})


@dataclass(frozen=True)
class Sample:
    """One pretraining sequence, trimmed to its real length n.

    `masked_lm_positions` index into this sequence (1..n-1; position 0 is [CLS]).
    """

    input_ids: np.ndarray  # [n] token ids: [CLS] A [SEP] B [SEP]
    segment_ids: np.ndarray  # [n] 0 for sentence A, 1 for sentence B
    masked_lm_positions: np.ndarray  # [k] positions of masked tokens, k <= max_predictions
    masked_lm_ids: np.ndarray  # [k] the original token at each masked position
    next_sentence_label: int  # 1 when B is a random sentence, 0 when it follows A

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])


# One item of a batch: a single sequence (padded / unpadded layouts) or the up-to-3
# sequences of one packed row. A batch is a list of items.
Item = tuple[Sample, ...]


def item_length(item: Item) -> int:
    return sum(s.length for s in item)


@dataclass
class FlatBatch:
    """All sequences of a micro-batch as one flat token stream.

    T = total real tokens, S = number of sequences, M = number of masked positions.
    """

    input_ids: torch.Tensor  # [T] int64
    segment_ids: torch.Tensor  # [T] int64
    position_ids: torch.Tensor  # [T] int64, restarts at 0 for every sequence
    cu_seqlens: torch.Tensor  # [S+1] int32, cu_seqlens[i] = first token of sequence i
    max_seqlen: int  # longest sequence, for varlen attention kernels
    masked_positions: torch.Tensor  # [M] int64 indices into the flat tokens
    masked_lm_ids: torch.Tensor  # [M] int64 labels
    next_sentence_labels: torch.Tensor  # [S] int64
    # Set for static packed batches: tokens lie in rows of row_len that no sequence crosses,
    # so attention can run row by row (T = rows * row_len) instead of per sequence.
    row_len: int | None = None
    # [S] sequence lengths as the host knows them (flatten_items, unpad): what sizes per-batch
    # kernels (grouped attention's groups) without a read of the device.
    host_seqlens: tuple[int, ...] | None = None

    @property
    def num_sequences(self) -> int:
        return int(self.next_sentence_labels.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def seqlens(self) -> torch.Tensor:
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "FlatBatch":
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                value = value.to(device, non_blocking=non_blocking)
            moved[f.name] = value
        return FlatBatch(**moved)

    def pin_memory(self) -> "FlatBatch":
        pinned: dict[str, Any] = {
            f.name: (v.pin_memory() if isinstance(v, torch.Tensor) else v)
            for f in fields(self)
            for v in [getattr(self, f.name)]
        }
        return FlatBatch(**pinned)


@dataclass
class PaddedBatch:
    """The MLPerf fixed-length form: every sequence padded to L = max_seq_length."""

    input_ids: torch.Tensor  # [B, L]
    segment_ids: torch.Tensor  # [B, L]
    input_mask: torch.Tensor  # [B, L] 1 for real tokens
    masked_lm_positions: torch.Tensor  # [B, P] 0 = no prediction in this slot
    masked_lm_ids: torch.Tensor  # [B, P]
    next_sentence_labels: torch.Tensor  # [B]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "PaddedBatch":
        return PaddedBatch(
            **{f.name: getattr(self, f.name).to(device, non_blocking=non_blocking) for f in fields(self)}
        )


def _sequences(items: Sequence[Item]) -> list[Sample]:
    return [s for item in items for s in item]


def flatten_items(items: Sequence[Item]) -> FlatBatch:
    """Concatenates the sequences of `items` (host side, numpy -> torch)."""
    samples = _sequences(items)
    if not samples:
        raise ValueError("cannot build a batch from zero sequences")
    lengths = np.fromiter((s.length for s in samples), dtype=np.int64, count=len(samples))
    cu = np.zeros(len(samples) + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:])
    starts = np.repeat(cu[:-1], lengths)
    positions = np.arange(cu[-1], dtype=np.int64) - starts
    masked = np.concatenate([s.masked_lm_positions.astype(np.int64) + cu[i] for i, s in enumerate(samples)])
    return FlatBatch(
        input_ids=torch.from_numpy(np.concatenate([s.input_ids for s in samples]).astype(np.int64)),
        segment_ids=torch.from_numpy(np.concatenate([s.segment_ids for s in samples]).astype(np.int64)),
        position_ids=torch.from_numpy(positions),
        cu_seqlens=torch.from_numpy(cu.astype(np.int32)),
        max_seqlen=int(lengths.max()),
        masked_positions=torch.from_numpy(masked),
        masked_lm_ids=torch.from_numpy(
            np.concatenate([s.masked_lm_ids for s in samples]).astype(np.int64)
        ),
        next_sentence_labels=torch.tensor([s.next_sentence_label for s in samples], dtype=torch.int64),
        host_seqlens=tuple(lengths.tolist()),
    )


def pad_items(items: Sequence[Item], max_seq_length: int, max_predictions: int) -> PaddedBatch:
    """Pads single-sequence items to the MLPerf fixed-length form (host side)."""
    samples = _sequences(items)
    if len(samples) != len(items):
        raise ValueError("the padded layout takes one sequence per item; packed rows need the packed layout")
    b = len(samples)
    ids = np.zeros((b, max_seq_length), dtype=np.int64)
    seg = np.zeros_like(ids)
    mask = np.zeros_like(ids)
    mpos = np.zeros((b, max_predictions), dtype=np.int64)
    mids = np.zeros_like(mpos)
    for i, s in enumerate(samples):
        n, k = s.length, s.masked_lm_positions.shape[0]
        ids[i, :n], seg[i, :n], mask[i, :n] = s.input_ids, s.segment_ids, 1
        mpos[i, :k], mids[i, :k] = s.masked_lm_positions, s.masked_lm_ids
    return PaddedBatch(
        input_ids=torch.from_numpy(ids),
        segment_ids=torch.from_numpy(seg),
        input_mask=torch.from_numpy(mask),
        masked_lm_positions=torch.from_numpy(mpos),
        masked_lm_ids=torch.from_numpy(mids),
        next_sentence_labels=torch.tensor([s.next_sentence_label for s in samples], dtype=torch.int64),
    )


def unpad(batch: PaddedBatch) -> FlatBatch:
    """Removes padding on whatever device `batch` lives on.

    Assumes right padding (real tokens first), as in the MLPerf shards. One device-to-host
    sync reads the sequence lengths: varlen kernels need max_seqlen as a Python int, and the
    grouped back-end the lengths (read together, in that one sync).
    """
    mask = batch.input_mask.bool()
    b, l = mask.shape
    lengths = mask.sum(dim=1)
    cu = torch.zeros(b + 1, dtype=torch.int32, device=mask.device)
    cu[1:] = torch.cumsum(lengths, 0)
    keep = mask.flatten()
    positions = torch.arange(l, device=mask.device).expand(b, l).flatten()[keep]
    # A padded slot has position 0, which is [CLS] and never masked (REFERENCE.md).
    slot = batch.masked_lm_positions != 0
    rows = torch.arange(b, device=mask.device).unsqueeze(1).expand_as(slot)
    flat_index = (cu[:-1].long()[rows] + batch.masked_lm_positions)[slot]
    host_lengths = tuple(lengths.tolist())
    return FlatBatch(
        input_ids=batch.input_ids.flatten()[keep],
        segment_ids=batch.segment_ids.flatten()[keep],
        position_ids=positions,
        cu_seqlens=cu,
        max_seqlen=max(host_lengths, default=0),
        masked_positions=flat_index,
        masked_lm_ids=batch.masked_lm_ids[slot],
        next_sentence_labels=batch.next_sentence_labels,
        host_seqlens=host_lengths,
    )
