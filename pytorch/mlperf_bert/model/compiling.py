"""`--compile_mode`: regional `torch.compile`, applied to the model from outside it.

Each encoder layer and the MLM head's transform are compiled in place; Inductor fuses the
bias add + GELU after the FFN GEMM, and dropout + residual add + LayerNorm after each output
projection. The model file stays free of compile code.
"""

from __future__ import annotations

from typing import Any

from ..config.settings import COMPILE_MODES
from .bert import BertForPreTraining


def compile_model(model: BertForPreTraining, mode: str = "default", dynamic: bool | None = None,
                  backend: str = "inductor") -> BertForPreTraining:
    """Compiles each encoder layer and the MLM transform in place (regional compile).

    All layers share one compiled graph, so compile time does not grow with depth.
    `dynamic=True` suits batches whose token count changes every step (padded, unpadded);
    static packed batches compile best with False. mode "none" leaves the model eager.
    """
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode must be one of {COMPILE_MODES}, got {mode!r}")
    if mode == "none":
        return model
    options: dict[str, Any] = {"dynamic": dynamic, "backend": backend}
    if backend == "inductor":
        options["mode"] = mode
    for layer in model.bert.encoder.layer:
        layer.compile(**options)
    model.cls.predictions.transform.compile(**options)
    return model
