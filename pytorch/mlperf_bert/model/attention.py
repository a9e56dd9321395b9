"""Attention over a flat token stream: back-ends that never attend across sequences.

Every back-end takes q, k, v as [T, heads, head_dim] plus `cu_seqlens` ([S+1] int32) and
returns [T, heads, head_dim]. Sequence i owns tokens cu_seqlens[i]:cu_seqlens[i+1]; a token
only attends to tokens of its own sequence, which is what makes packed rows exact.

- `sdpa`: the reference. Scatters the tokens into a padded [S, heads, L, head_dim] tensor,
  runs `torch.nn.functional.scaled_dot_product_attention` with a key-padding mask and
  gathers the real tokens back. Runs anywhere and supports attention dropout. For a static
  packed batch (rows of row_len tokens that no sequence crosses) it runs row by row instead
  (`row_attention`): the rows are a view of the tokens (no scatter, no gather) and a
  block-diagonal mask keeps each token inside its sequence. Work: rows x row_len^2 score
  entries, against (rows x slots per row) x row_len^2 for the per-sequence grid, whose
  empty slots of a static batch cost as much as full ones.
- `varlen`: GPU kernels that work on the flat tokens directly, one sequence at a time, attention
  dropout included: flash-attn's `flash_attn_varlen_func` when importable, else PyTorch's own
  flash kernel (`varlen_flash.varlen_flash`, in every CUDA build of torch). Static packed batches
  run it too: each row's sequences are attended to separately, so the half of a row's score
  matrix that the block-diagonal mask throws away is never computed. Both need a GPU of compute
  capability 8.0 or newer, fp16 / bf16 inputs and head sizes up to 256: `backend_problem`
  refuses what a run's device, precision or model cannot give them at start-up, and `auto`
  never picks them there.
- `varlen_cudnn`: the same per-sequence attention on cuDNN's fused kernel (`varlen_flash.varlen_cudnn`,
  the native one on Hopper), chosen by name only: `auto` keeps the flash kernel until a GPU has
  timed both (tools/gpu_perf.sh). Its limits are torch's cuDNN SDPA's: cuDNN 9, compute capability
  8.0 or newer, fp16 / bf16, head sizes up to 128, and attention dropout in steps of 1/16 (the
  kernels' resolution; torch's SDPA sends no other dropout to cuDNN), so BERT's 0.1 is refused for
  training and taken for eval, which has none.
- `grouped`: Baidu's grouped attention (`grouped_attention.py`): one SDPA call per length group,
  each padded to its own longest sequence, the groups on their own CUDA streams. Exact like
  `sdpa`, dropout included; static packed batches run row by row as under `sdpa`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from ..config.settings import ATTENTION_BACKENDS, DEFAULT_GROUP_BOUNDS
from ..data.batch import FlatBatch
from ..runtime.optional import DependencyError, optional_import
from .grouped_attention import GroupedLayout, StreamPool, grouped_attention, grouped_layout, host_lengths
from .precision import AUTOCAST_DTYPES
from .varlen_flash import flash_kernel_available, varlen_cudnn, varlen_flash


@dataclass(frozen=True)
class FlatLayout:
    """Index maps between flat tokens [T] and the padded grid [S, L]."""

    seq_index: torch.Tensor  # [T] which sequence each token belongs to
    pos_index: torch.Tensor  # [T] position of each token inside its sequence
    num_seqs: int
    max_seqlen: int
    row_len: int | None = None  # tokens per row when no sequence crosses a row (static packed batches)
    groups: GroupedLayout | None = None  # the length groups' index maps (the grouped back-end)


def flat_layout(cu_seqlens: torch.Tensor, max_seqlen: int, num_tokens: int | None = None,
                row_len: int | None = None) -> FlatLayout:
    """Index maps of a flat batch. Give `num_tokens` (T) to avoid a device-to-host sync
    (without it `repeat_interleave` reads the total length back), e.g. inside a CUDA graph."""
    cu = cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    num_seqs = lengths.shape[0]
    seq_index = torch.repeat_interleave(torch.arange(num_seqs, device=cu.device), lengths, output_size=num_tokens)
    pos_index = torch.arange(seq_index.shape[0], device=cu.device) - cu[:-1][seq_index]
    return FlatLayout(seq_index, pos_index, num_seqs, max_seqlen, row_len)


def batch_layout(batch: FlatBatch, backend: str, group_bounds: Sequence[int] = DEFAULT_GROUP_BOUNDS,
                 pool: StreamPool | None = None) -> FlatLayout:
    """The layout every layer of the model shares for one batch; with the length groups' index
    maps for the grouped back-end (not for static packed batches, which run row by row)."""
    layout = flat_layout(batch.cu_seqlens, batch.max_seqlen, batch.num_tokens, batch.row_len)
    if backend != "grouped" or batch.row_len is not None:
        return layout
    lengths = host_lengths(batch.cu_seqlens, batch.host_seqlens)
    groups = grouped_layout(batch.cu_seqlens, layout.seq_index, layout.pos_index, lengths, group_bounds, pool)
    return replace(layout, groups=groups)


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: FlatLayout,
    dropout_p: float,
) -> torch.Tensor:
    """Reference attention: pad per sequence, masked SDPA, unpad."""
    t, heads, dim = q.shape
    s, l = layout.num_seqs, layout.max_seqlen

    def to_grid(x: torch.Tensor) -> torch.Tensor:
        grid = x.new_zeros(s, l, heads, dim)
        grid[layout.seq_index, layout.pos_index] = x
        return grid.transpose(1, 2)  # [S, heads, L, dim]

    valid = torch.zeros(s, l, dtype=torch.bool, device=q.device)
    valid[layout.seq_index, layout.pos_index] = True
    key_mask = valid[:, None, None, :]  # [S, 1, 1, L]: True = may attend
    out = F.scaled_dot_product_attention(
        to_grid(q), to_grid(k), to_grid(v), attn_mask=key_mask, dropout_p=dropout_p
    )
    return out.transpose(1, 2)[layout.seq_index, layout.pos_index]


def row_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: FlatLayout,
                  dropout_p: float) -> torch.Tensor:
    """Attention per row of a static packed batch: SDPA over [rows, heads, row_len, dim] views
    with a block-diagonal mask (token i may attend to token j when both are in one sequence).

    A row's unused tail is a sequence of its own, so every token attends to at least itself.
    """
    t, heads, dim = q.shape
    row_len = layout.row_len
    if row_len is None or t % row_len:
        raise ValueError(f"row attention needs T ({t}) to be a whole number of rows of row_len {row_len}")
    rows = t // row_len

    def to_rows(x: torch.Tensor) -> torch.Tensor:
        return x.view(rows, row_len, heads, dim).transpose(1, 2)  # [R, heads, L, dim]

    seq = layout.seq_index.view(rows, row_len)
    same_sequence = (seq[:, :, None] == seq[:, None, :])[:, None]  # [R, 1, L, L]
    out = F.scaled_dot_product_attention(to_rows(q), to_rows(k), to_rows(v), attn_mask=same_sequence,
                                         dropout_p=dropout_p)
    return out.transpose(1, 2).reshape(t, heads, dim)


# flash-attn and PyTorch's varlen attention are flash-attention kernels: CUDA only, compute
# capability 8.0 (Ampere) or newer, fp16 / bf16 inputs, head sizes up to 256 in steps of 8.
VARLEN_MIN_CAPABILITY = (8, 0)
VARLEN_MAX_HEAD_DIM = 256
VARLEN_HEAD_DIM_STEP = 8
# cuDNN's fused attention as torch's cuDNN SDPA takes it (sdp_utils.cpp): cuDNN 9 (its packed, ragged
# path), head sizes up to 128 in steps of 8 (256 only on Hopper with cuDNN >= 9.10), attention dropout in
# steps of 1/16 (the kernels' resolution: torch routes no other dropout to cuDNN, it would be rounded).
CUDNN_MIN_VERSION = 90000  # torch.backends.cudnn.version() of cuDNN 9.0.0
CUDNN_MAX_HEAD_DIM = 128
CUDNN_DROPOUT_STEPS = 16
FLASH_ATTN_INSTALL = "pip install flash-attn --no-build-isolation (a build for this torch and CUDA)"
OTHER_BACKENDS = "use --attention_backend auto, sdpa or grouped"
FLASH_INSTEAD = "use --attention_backend varlen (PyTorch's flash kernel) or auto"


@dataclass(frozen=True)
class VarlenLimits:
    """A varlen back-end's kernels: what its refusals call them, and the largest head size they take."""

    names: str
    max_head_dim: int


VARLEN_BACKENDS = {"varlen": VarlenLimits("flash-attn's or PyTorch's varlen attention", VARLEN_MAX_HEAD_DIM),
                   "varlen_cudnn": VarlenLimits("cuDNN's fused attention", CUDNN_MAX_HEAD_DIM)}


def _flash_attn_varlen() -> Callable | None:
    """flash-attn's kernel; None when flash-attn is not installed. Installed but failing to import
    (built for another torch or CUDA) is a `DependencyError`: a run must not quietly lose it."""
    if not optional_import("flash_attn", "flash-attn", "--attention_backend varlen (and auto on a GPU)",
                           FLASH_ATTN_INSTALL, OTHER_BACKENDS):
        return None
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func


VarlenKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]


def _flash_attn_kernel(flash: Callable) -> VarlenKernel:
    def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
               dropout_p: float) -> torch.Tensor:
        return flash(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p=dropout_p)

    return kernel


def varlen_kernel() -> VarlenKernel:
    """The varlen kernel of this environment, chosen once (when the model is built, never in a forward: an
    import inside a compiled forward is a graph break in every layer): flash-attn's when installed (a user who
    built it chose it), else PyTorch's flash kernel (`varlen_flash`). Both take (q, k, v, cu_seqlens,
    max_seqlen, dropout_p) on the flat tokens; no padding is ever materialised.

    What cannot run here is refused at start-up (`backend_problem`)."""
    flash = _flash_attn_varlen()
    return varlen_flash if flash is None else _flash_attn_kernel(flash)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                     dropout_p: float) -> torch.Tensor:
    """`varlen_kernel()`'s attention, the kernel chosen on this call (for benchmarks; the model chooses once)."""
    return varlen_kernel()(q, k, v, cu_seqlens, max_seqlen, dropout_p)


@dataclass(frozen=True)
class AttentionNeeds:
    """What a run asks of its attention: the facts that decide which back-ends can serve it."""

    device: torch.device
    precision: str  # --precision: the varlen kernels take fp16 / bf16 only
    head_dim: int  # hidden_size / num_attention_heads
    train_dropout: float  # attention dropout while training: cuDNN's kernel takes it in steps of 1/16 only


def varlen_misfit(needs: AttentionNeeds, backend: str = "varlen") -> str | None:
    """Why the kernels of `backend` (varlen or varlen_cudnn) cannot take this run (device, precision, head
    size), whoever's kernel it is; None when they can. Each reason names the setting and the fix."""
    kernels, flag = VARLEN_BACKENDS[backend], f"--attention_backend {backend}"
    if needs.device.type != "cuda":
        return (f"{flag} runs GPU kernels only ({kernels.names}), "
                f"and this run is on the {needs.device.type}: {OTHER_BACKENDS}")
    capability = tuple(torch.cuda.get_device_capability(needs.device))
    if capability < VARLEN_MIN_CAPABILITY:
        major, minor = VARLEN_MIN_CAPABILITY
        return (f"{flag} needs a GPU of compute capability >= {major}.{minor} (Ampere or newer), "
                f"but {torch.cuda.get_device_name(needs.device)} is {capability[0]}.{capability[1]}: {OTHER_BACKENDS}")
    if AUTOCAST_DTYPES.get(needs.precision) is None:
        return (f"{flag} takes fp16 / bf16 inputs, and --precision {needs.precision} gives it "
                f"fp32: use --precision bf16, fp16 or fp8, or {OTHER_BACKENDS}")
    if needs.head_dim > kernels.max_head_dim or needs.head_dim % VARLEN_HEAD_DIM_STEP:
        return (f"{flag} takes head sizes up to {kernels.max_head_dim} in steps of "
                f"{VARLEN_HEAD_DIM_STEP}, and hidden_size / num_attention_heads of the BERT config is "
                f"{needs.head_dim}: {OTHER_BACKENDS}")
    return None


def _varlen_kernel_problem() -> str | None:
    """Why no varlen kernel can run here (on a GPU that fits them); None when one can."""
    if _flash_attn_varlen() is not None or flash_kernel_available():
        return None
    return (f"--attention_backend varlen needs flash-attention kernels: this torch ({torch.__version__}) was built "
            f"without them, and flash-attn is not installed ({FLASH_ATTN_INSTALL}): {OTHER_BACKENDS}")


def _cudnn_kernel_problem(needs: AttentionNeeds) -> str | None:
    """Why cuDNN's packed attention cannot take this run (on a GPU that fits it): a torch without cuDNN 9 or
    without the op, or a training dropout cuDNN would round; None when it can."""
    flag = "--attention_backend varlen_cudnn"
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if version is None or version < CUDNN_MIN_VERSION or not hasattr(torch.ops.aten, "_cudnn_attention_forward"):
        found = "no cuDNN" if version is None else f"torch.backends.cudnn.version() {version}"
        return (f"{flag} needs torch's cuDNN attention over packed sequences (cuDNN >= 9.0, "
                f"aten._cudnn_attention_forward), and this torch ({torch.__version__}) has {found}: {FLASH_INSTEAD}")
    steps = needs.train_dropout * CUDNN_DROPOUT_STEPS
    if steps != math.floor(steps):
        return (f"{flag}: cuDNN's attention dropout comes in steps of 1/{CUDNN_DROPOUT_STEPS} (torch's SDPA sends no "
                f"other dropout to cuDNN), and attention_probs_dropout_prob of the BERT config is "
                f"{needs.train_dropout}: {FLASH_INSTEAD}")
    return None


def backend_problem(requested: str, needs: AttentionNeeds) -> str | None:
    """Why --attention_backend `requested` cannot serve this run, with the fix; None when it can
    (checked at start-up). sdpa and grouped run everywhere; auto picks what fits; varlen needs
    the GPU, precision, head size and kernel that `varlen_misfit` and the kernels' limits name;
    varlen_cudnn the same, and cuDNN 9 in torch and a training dropout in cuDNN's steps.
    A flash-attn that is installed but broken is refused for varlen and for auto on a GPU alike.
    """
    if requested in ("sdpa", "grouped") or (requested == "auto" and needs.device.type != "cuda"):
        return None
    if requested == "varlen_cudnn":
        return varlen_misfit(needs, requested) or _cudnn_kernel_problem(needs)
    try:
        if requested == "auto":
            _flash_attn_varlen()
            return None
        return varlen_misfit(needs) or _varlen_kernel_problem()
    except DependencyError as broken:
        return str(broken)


def resolve_backend(requested: str, device: torch.device, max_seq_length: int | None = None,
                    group_bounds: Sequence[int] = DEFAULT_GROUP_BOUNDS, precision: str = "bf16",
                    head_dim: int = 64) -> str:
    """Picks a concrete back-end. `auto`: on a GPU the varlen kernels when they fit the run
    (`varlen_misfit`: compute capability, precision, head size) and this torch or flash-attn has
    them; otherwise grouped when sequences of up to `max_seq_length` tokens fall in more than one
    group, else sdpa. Packed rows take varlen too: per sequence, not over the whole row. `auto` never
    takes varlen_cudnn: the flash kernel stays the GPU's until a GPU has timed both.

    The grouped rule is measured on the CPU (benchmarks/attention.py, docs/PERFORMANCE.md): at
    512 tokens grouped took 0.41-0.54x of sdpa's time forward and backward (medians), with
    dropout and without; at 128 tokens, one group, 1.09x (its index maps and gathers, nothing
    saved). On a GPU it takes sdpa's place where varlen cannot run (fp32, a GPU before Ampere):
    the same 2.3x less score work, the groups overlapping on streams (not timed on a GPU yet).
    """
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention_backend must be one of {ATTENTION_BACKENDS}, got {requested!r}")
    if requested != "auto":
        return requested
    needs = AttentionNeeds(device, precision, head_dim, 0.0)  # auto never picks cuDNN's kernel, the one dropout limits
    if device.type == "cuda" and varlen_misfit(needs) is None and _varlen_kernel_problem() is None:
        return "varlen"
    if max_seq_length is not None and max_seq_length > group_bounds[0]:
        return "grouped"
    return "sdpa"


class FlatAttention(torch.nn.Module):
    """Dispatches to a back-end; holds no parameters (the projections live in the model)."""

    def __init__(self, backend: str, dropout_p: float) -> None:
        super().__init__()
        if backend not in ("sdpa", "varlen", "varlen_cudnn", "grouped"):
            raise ValueError(f"unresolved attention backend {backend!r}; call resolve_backend first")
        self.backend = backend
        self.dropout_p = dropout_p
        # chosen here, not per forward: the compiled layers see one kernel and no import
        self.varlen: VarlenKernel | None = (varlen_kernel() if backend == "varlen" else
                                            varlen_cudnn if backend == "varlen_cudnn" else None)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        layout: FlatLayout,
    ) -> torch.Tensor:
        p = self.dropout_p if self.training else 0.0
        if self.varlen is not None:
            return self.varlen(q, k, v, cu_seqlens, layout.max_seqlen, p)
        if layout.row_len is not None:
            return row_attention(q, k, v, layout, p)
        if self.backend == "grouped":
            if layout.groups is None:
                raise ValueError("the grouped back-end needs the layout's length groups: build it with batch_layout")
            return grouped_attention(q, k, v, layout.groups, p)
        return sdpa_attention(q, k, v, layout, p)
