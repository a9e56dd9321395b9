"""Why `torch.load(path, weights_only=True)` refused a file, as one line a user can act on.

torch's own messages run to several lines, and for a file holding Python objects besides
tensors they advise `weights_only=False`, which lets the file run code: advice this trainer never
passes on. Every reader of checkpoints (init, resume, conversion) words a failed load here.

Free of torch (the error is classified from its type and the file's first bytes).
"""

from __future__ import annotations

import pickle
from pathlib import Path

from .optional import describe_error

# The first bytes of a zip archive: torch.save's format since PyTorch 1.6.
ZIP_MAGIC = b"PK\x03\x04"


def _starts_with(path: Path, magic: bytes) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(magic)) == magic
    except OSError:
        return False


def unloadable_reason(path: Path, err: BaseException) -> str:
    """What is wrong with a file `torch.load(..., weights_only=True)` failed on (the caller adds its fix).

    Empty, cut short, a torch.save archive damaged, a pickle of objects besides tensors (a whole
    model, numpy arrays: what a safe load refuses), or no torch file at all. torch's own text is
    left out: it is long, and for pickles it advises the unsafe load.
    """
    try:
        empty = path.stat().st_size == 0
    except OSError as gone:
        return f"it cannot be read ({describe_error(gone)})"
    if empty:
        return "the file is empty"
    if isinstance(err, pickle.UnpicklingError):
        return ("it holds Python objects besides tensors (a whole model, numpy arrays, ...), which a safe load "
                "(weights_only=True, so that a file cannot run code) does not read")
    if isinstance(err, EOFError):
        return "the file ends early (cut short while it was written or copied)"
    if _starts_with(path, ZIP_MAGIC):
        return "the torch.save archive is truncated or damaged"
    return "it is not a file torch.save wrote"
