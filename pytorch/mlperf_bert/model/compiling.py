"""`--compile_mode`: regional `torch.compile`, applied to the model from outside it.

Each encoder layer and the MLM head's transform are compiled in place; Inductor fuses the
bias add + GELU after the FFN GEMM, and dropout + residual add + LayerNorm after each output
projection. The model file stays free of compile code.
"""

from __future__ import annotations

from typing import Any, Callable, Union

import torch

from ..config.settings import COMPILE_MODES
from ..runtime.optional import dependency_problem, describe_error
from .bert import BertForPreTraining
from .grouped_attention import keep_out_of_compiled_graphs

TRITON_INSTALL = "pip install triton (torch's CUDA wheels bring the release that fits them)"
# torch.compile's back-end: a registered name ("inductor") or a compiler function (the dry run's)
CompileBackend = Union[str, Callable[..., Any]]


def compile_model(model: BertForPreTraining, mode: str = "default", dynamic: bool | None = None,
                  backend: CompileBackend = "inductor") -> BertForPreTraining:
    """Compiles each encoder layer and the MLM transform in place (regional compile).

    All layers share one compiled graph, so compile time does not grow with depth.
    `dynamic=True` suits batches whose token count changes every step (padded, unpadded);
    static packed batches compile best with False. mode "none" leaves the model eager.
    """
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode must be one of {COMPILE_MODES}, got {mode!r}")
    if mode == "none":
        return model
    keep_out_of_compiled_graphs()
    options: dict[str, Any] = {"dynamic": dynamic, "backend": backend}
    if backend == "inductor":
        options["mode"] = mode
    for layer in model.bert.encoder.layer:
        layer.compile(**options)
    model.cls.predictions.transform.compile(**options)
    return model


def compile_problem(mode: str, device: torch.device) -> str | None:
    """Why Inductor cannot compile for `device` here (checked at start-up; found otherwise only in the
    first step, after run_start); None when it can or for mode "none". On a GPU it writes Triton
    kernels, so Triton must import; on the CPU it writes C++, so a C++ compiler must be found."""
    if mode == "none":
        return None
    if device.type == "cuda":
        return dependency_problem("triton", "Triton", f"--compile_mode {mode} on a GPU", TRITON_INSTALL,
                                  "use --compile_mode none")
    error = _cpp_compiler_error()
    if error is None:
        return None
    return (f"--compile_mode {mode} on the CPU compiles C++ kernels, but Inductor finds no C++ compiler ({error}): "
            "install g++ (or set CXX to one), or use --compile_mode none")


def _cpp_compiler_error() -> str | None:
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
    except ImportError:  # another torch keeps it elsewhere: the compile itself will say
        return None
    try:
        get_cpp_compiler()
    except Exception as err:  # torch's InvalidCxxCompiler, or an OSError running the candidates
        return describe_error(err)
    return None
