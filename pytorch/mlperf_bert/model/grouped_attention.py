"""Grouped attention: one SDPA call per length group, groups on their own CUDA streams.

Baidu's unpadded BERT ("Boosting Distributed Training Performance of the Unpadded BERT
Model", section IV-A-2) replaces the one attention kernel sized for the batch's longest
sequence by one kernel per length group ((0,128], (128,256], (256,384], (384,512]), each sized
for its own longest sequence, and runs the groups on separate CUDA streams so they overlap.
Padding every sequence to the batch's longest costs S x L_max^2 score entries per head;
grouped, it costs the sum over groups of S_g x L_g^2 (`score_entries`).

Three stages, each small:
- on the host, `length_groups` sorts the sequences into groups from lengths the host already
  has (`FlatBatch.host_seqlens`: `flatten_items` knows them, `unpad` reads them with the
  batch's longest); nothing is read from the device to learn the groups;
- once per batch, `grouped_layout` builds each group's index maps on the device from
  `cu_seqlens` (the device sorts its sequences by group with the same rule, so the host's
  group sizes slice the device's order without a copy either way);
- per layer, `grouped_attention` gathers q, k and v into every group's [S_g, heads, L_g, dim]
  grid, runs SDPA per group with a key mask (none when every sequence of the group fills its
  grid; dropout as asked) and gathers the real tokens back into flat order. On a GPU the
  groups run on a small pool of side streams ordered by events (`_on_side_streams`), the only
  GPU-only branch.

A length above the last bound forms one more group, so every length has a group.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LengthGroup:
    """The sequences of one length group of a batch, as the host knows them."""

    bucket: int  # how many bounds lie below its lengths (0 for (0, bounds[0]])
    sequences: tuple[int, ...]  # indices into the batch, ascending
    longest: int  # L_g: the grid width of the group's SDPA call
    uniform: bool  # every sequence has `longest` tokens: the grid needs no key mask


def check_bounds(bounds: Sequence[int]) -> tuple[int, ...]:
    """The bounds as a tuple; ValueError unless positive and strictly increasing."""
    bounds = tuple(int(b) for b in bounds)
    if not bounds or bounds[0] < 1 or any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"group bounds must be positive and strictly increasing; got {bounds}")
    return bounds


def bucket_of(length: int, bounds: Sequence[int]) -> int:
    """The group of a length: the number of bounds below it ((0, b0] -> 0, (b0, b1] -> 1, ...)."""
    return bisect.bisect_left(bounds, length)


def length_groups(lengths: Sequence[int], bounds: Sequence[int]) -> tuple[LengthGroup, ...]:
    """The non-empty groups of a batch, in bound order; each lists its sequences in batch order.

    A sequence without tokens is in no group: it has nothing to attend to, and a grid row with
    no real key would give NaN gradients.
    """
    bounds = check_bounds(bounds)
    members: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        if n > 0:
            members.setdefault(bucket_of(n, bounds), []).append(i)
    groups = []
    for bucket in sorted(members):
        seqs = members[bucket]
        own = [lengths[i] for i in seqs]
        groups.append(LengthGroup(bucket, tuple(seqs), max(own), min(own) == max(own)))
    return tuple(groups)


def score_entries(lengths: Sequence[int], bounds: Sequence[int] | None = None) -> int:
    """Attention score entries per head: padded to the batch's longest (bounds None), or per group."""
    if bounds is None:
        return len(lengths) * max(lengths) ** 2
    return sum(len(g.sequences) * g.longest**2 for g in length_groups(lengths, bounds))


def host_lengths(cu_seqlens: torch.Tensor, known: Sequence[int] | None) -> tuple[int, ...]:
    """The sequence lengths without a device read: the batch's host copy, or `cu_seqlens` itself on the CPU."""
    if known is not None:
        return tuple(known)
    if cu_seqlens.device.type == "cpu":
        cu = cu_seqlens.tolist()
        return tuple(b - a for a, b in zip(cu, cu[1:]))
    raise ValueError("grouped attention needs the batch's sequence lengths on the host (FlatBatch.host_seqlens, "
                     "set by flatten_items and unpad); reading them from the device would stall every step")


class StreamPool:
    """Side streams for the groups, made on first use and kept (one per group, at most `size`).

    A copy of the model gets a pool of its own (streams are not copied).
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._streams: list[torch.cuda.Stream] = []

    def take(self, device: torch.device, groups: int) -> tuple[torch.cuda.Stream, ...]:
        """Streams for `groups` groups on a GPU (reused in turn past `size`); none elsewhere."""
        if device.type != "cuda":
            return ()
        while len(self._streams) < min(groups, self.size):
            self._streams.append(torch.cuda.Stream(device=device))
        return tuple(self._streams[: min(groups, self.size)])

    def __deepcopy__(self, memo: dict) -> "StreamPool":
        return StreamPool(self.size)


@dataclass(frozen=True)
class GroupGrid:
    """One group's grid: S_g sequences padded to L_g tokens."""

    sequences: int  # S_g
    longest: int  # L_g
    key_mask: torch.Tensor | None  # [S_g, 1, 1, L_g] True = a real key; None when the group is uniform

    @property
    def cells(self) -> int:
        return self.sequences * self.longest


@dataclass(frozen=True)
class GroupedLayout:
    """The index maps of one batch, shared by every layer."""

    grids: tuple[GroupGrid, ...]
    gather: torch.Tensor  # [sum S_g L_g] flat token of every grid cell, group after group, row by row
    slot: torch.Tensor  # [T] the grid cell that holds each token
    streams: tuple[torch.cuda.Stream, ...] = field(default=())  # one per group on a GPU; empty elsewhere


def bucket_ids(lengths: torch.Tensor, bounds: Sequence[int]) -> torch.Tensor:
    """`bucket_of` on the device: for each sequence, the number of bounds below its length;
    -1 for a sequence without tokens (in no group, sorted before every group)."""
    ids = torch.zeros_like(lengths)
    for bound in bounds:
        ids += lengths > bound
    return ids.masked_fill_(lengths == 0, -1)


def _grid_cells(cu: torch.Tensor, lengths: torch.Tensor, seqs: torch.Tensor,
                group: LengthGroup) -> tuple[torch.Tensor, GroupGrid]:
    """The flat token of each cell of the group's grid [S_g * L_g] (a padding cell repeats its
    sequence's last token, so a grid never reads another sequence), and the grid."""
    pos = torch.arange(group.longest, device=cu.device)
    own = lengths[seqs][:, None]  # [S_g, 1]
    cells = cu[seqs][:, None] + torch.minimum(pos, own - 1)  # [S_g, L_g]
    mask = None if group.uniform else (pos < own)[:, None, None, :]
    return cells.flatten(), GroupGrid(len(group.sequences), group.longest, mask)


def grouped_layout(cu_seqlens: torch.Tensor, seq_index: torch.Tensor, pos_index: torch.Tensor,
                   lengths: Sequence[int], bounds: Sequence[int], pool: StreamPool | None = None) -> GroupedLayout:
    """Each group's grid, the token of every grid cell and the cell of every token, from
    `cu_seqlens` and the host's lengths.

    The device orders its sequences by group (stable: batch order inside a group), as
    `length_groups` does on the host, so group g is a slice of that order whose bounds the host
    knows. seq_index / pos_index: each token's sequence and position (`attention.flat_layout`).
    """
    groups = length_groups(lengths, bounds)
    cu = cu_seqlens.long()
    seq_lengths = cu[1:] - cu[:-1]
    order = torch.argsort(bucket_ids(seq_lengths, bounds), stable=True)
    first_cell = torch.empty_like(seq_lengths)  # each sequence's first grid cell
    cells, grids, offset = [], [], 0
    first = sum(1 for n in lengths if n == 0)  # sequences without tokens come first in `order`
    for group in groups:
        count = len(group.sequences)
        seqs = order[first : first + count]
        group_cells, grid = _grid_cells(cu, seq_lengths, seqs, group)
        cells.append(group_cells)
        grids.append(grid)
        first_cell.index_copy_(0, seqs, offset + group.longest * torch.arange(count, device=cu.device))
        first, offset = first + count, offset + grid.cells
    streams = pool.take(cu.device, len(groups)) if pool is not None else ()
    return GroupedLayout(tuple(grids), torch.cat(cells), first_cell[seq_index] + pos_index, streams)


def _attend_group(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: GroupGrid,
                  dropout_p: float) -> torch.Tensor:
    """SDPA over one group's cells [S_g * L_g, heads, dim]; the output in the same shape."""
    heads, dim = q.shape[1:]

    def to_grid(x: torch.Tensor) -> torch.Tensor:
        return x.view(grid.sequences, grid.longest, heads, dim).transpose(1, 2)  # [S_g, heads, L_g, dim]

    out = F.scaled_dot_product_attention(to_grid(q), to_grid(k), to_grid(v), attn_mask=grid.key_mask,
                                         dropout_p=dropout_p)
    return out.transpose(1, 2).reshape(grid.cells, heads, dim)


def _on_side_streams(attend: Callable[[int], torch.Tensor], inputs: Sequence[torch.Tensor],
                     layout: GroupedLayout) -> list[torch.Tensor]:
    """The paper's ordering: every group starts after the producer of its inputs (an event on
    the current stream), and the current stream, the consumer, waits for every group's event.

    `record_stream` tells the caching allocator which stream still reads a tensor made on
    another, so its memory is not reused before that stream is done with it.
    """
    main = torch.cuda.current_stream(layout.gather.device)
    produced = torch.cuda.Event()
    produced.record(main)
    outs = []
    for i, grid in enumerate(layout.grids):
        side = layout.streams[i % len(layout.streams)]
        side.wait_event(produced)
        for tensor in (*inputs, *([grid.key_mask] if grid.key_mask is not None else [])):
            tensor.record_stream(side)
        with torch.cuda.stream(side):
            out = attend(i)
        done = torch.cuda.Event()
        done.record(side)
        main.wait_event(done)
        out.record_stream(main)
        outs.append(out)
    return outs


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: GroupedLayout,
                      dropout_p: float) -> torch.Tensor:
    """Attention over flat q, k, v [T, heads, dim], one SDPA call per length group; [T, heads, dim].
    Outside compiled graphs once `keep_out_of_compiled_graphs` has run."""
    return _grouped_attention(q, k, v, layout, dropout_p)


def _eager_grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: GroupedLayout,
                             dropout_p: float) -> torch.Tensor:
    """`grouped_attention`'s work.

    One gather per input fills every group's cells at once and `split` hands each group its
    part, so the backward pass scatters each input's gradient once, not once per group.
    """
    sizes = [grid.cells for grid in layout.grids]
    cells = [x[layout.gather] for x in (q, k, v)]  # [sum S_g L_g, heads, dim]
    per_group = list(zip(*(c.split(sizes) for c in cells)))

    def attend(i: int) -> torch.Tensor:
        q_cells, k_cells, v_cells = per_group[i]
        return _attend_group(q_cells, k_cells, v_cells, layout.grids[i], dropout_p)

    if layout.streams:
        outs = _on_side_streams(attend, cells, layout)
    else:
        outs = [attend(i) for i in range(len(layout.grids))]
    out_cells = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out_cells[layout.slot]


_grouped_attention = _eager_grouped_attention


def keep_out_of_compiled_graphs() -> None:
    """Group shapes change with every batch and the streams are GPU-only: torch.compile must break its
    graph around the grouped path, not trace it. `compile_model` calls this before compiling; it is not
    a decorator because `torch.compiler.disable` imports torch._dynamo, seconds of start-up in every
    process that never compiles."""
    global _grouped_attention
    if _grouped_attention is _eager_grouped_attention:
        _grouped_attention = torch.compiler.disable(_eager_grouped_attention)
