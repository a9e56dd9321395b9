"""`--precision fp8`: the encoder's matrix multiplies in FP8, through torchao's `Float8Linear`.

What runs in FP8 is what NVIDIA's MLPerf BERT runs in FP8 (TransformerEngine, H100 to GB200):
the four GEMMs of each encoder layer, here six `nn.Linear`s (query, key and value are three,
NVIDIA fuses them into one QKV GEMM), the attention output projection, and the two FFN layers.
Everything else stays as under bf16 (`precision.AUTOCAST_DTYPES["fp8"]`): embeddings, the MLM
decoder tied to them, the pooler, the heads, LayerNorms, softmax and attention.
`fp8_layer_names` lists the converted layers; `is_fp8_layer` is the one rule that picks them.

Recipes (`--fp8_recipe`, `Fp8Recipe`):
- `tensorwise` (default): torchao's dynamic scaling, one scale per tensor from the tensor's own
  absolute maximum, E4M3 for inputs and weights, E5M2 for output gradients (NVIDIA's HYBRID
  format);
- `rowwise`: torchao's, one scale per row of each operand (E4M3 throughout);
- `rowwise_gw_hp`: torchao's rowwise, with the weight-gradient GEMM in bf16;
- `delayed`: this package's `fp8_delayed.DelayedFp8Linear`, each scale from the same tensor's
  amax one step before, as NVIDIA's `DelayedScaling(amax_history_len=1, "most_recent")`: the
  cast needs no reduction pass before it.
All four use fast accumulation in all three GEMMs (forward, input and weight gradients), as
NVIDIA's runs do (torchao's default has it in the forward only). `--fp8_layers ffn` keeps FP8 to
the two FFN GEMMs, whose M, N and K are the largest (the ones FP8 speeds up most).
The scales are device tensors, so a step stays free of host reads and captures in a CUDA graph;
the weights stay fp32 parameters (cast to FP8 in each forward), so state dicts and the optimizer
are those of any other precision. torchao's recipes keep no state between steps (each cast
scales by its tensor's own amax); the delayed recipe's amax history is the one FP8 state a step
reads, and `scaling_states` / `load_scaling_states` carry it through run checkpoints and the sync
window's snapshots beside the state dict.

On a GPU of compute capability 8.9 or later (Ada, Hopper, Blackwell) the GEMMs are
`torch._scaled_mm`; elsewhere (the CPU) torchao emulates them: the same FP8 rounding, matmuls in
high precision. `fp8_unavailable` says why a run cannot use FP8 (checked at start-up).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Mapping

import torch
from torch import nn

from ..config.settings import FP8_LAYER_SETS, FP8_RECIPES
from ..runtime.optional import dependency_problem
from .fp8_delayed import DelayedFp8Linear

if TYPE_CHECKING:
    from torchao.float8 import Float8LinearConfig

# The first compute capability with FP8 tensor cores (Ada Lovelace; Hopper is 9.0).
MIN_CAPABILITY = (8, 9)
ENCODER_LAYERS = "bert.encoder.layer."
# The linear layers of one encoder layer that run in FP8, relative to the layer.
LAYER_GEMMS = ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
               "intermediate.dense", "output.dense")
FFN_GEMMS = ("intermediate.dense", "output.dense")
LAYER_SETS = {"encoder": LAYER_GEMMS, "ffn": FFN_GEMMS}
TORCHAO_RECIPES = {"tensorwise": "tensorwise", "rowwise": "rowwise", "rowwise_gw_hp": "rowwise_with_gw_hp"}


@dataclass(frozen=True)
class Fp8Recipe:
    """How --precision fp8 scales its tensors (`scaling`) and which GEMMs of each layer it converts (`layers`)."""

    scaling: str = "tensorwise"
    layers: str = "encoder"

    def __post_init__(self) -> None:
        if self.scaling not in FP8_RECIPES:
            raise ValueError(f"--fp8_recipe must be one of {', '.join(FP8_RECIPES)}; got {self.scaling!r}")
        if self.layers not in FP8_LAYER_SETS:
            raise ValueError(f"--fp8_layers must be one of {', '.join(FP8_LAYER_SETS)}; got {self.layers!r}")

    @classmethod
    def of(cls, scaling: str | None, layers: str | None) -> "Fp8Recipe":
        """The recipe of the run's flags (None: the default)."""
        return cls(scaling or cls.scaling, layers or cls.layers)

    @property
    def gemms(self) -> tuple[str, ...]:
        return LAYER_SETS[self.layers]

    def describe(self) -> str:
        return f"{self.scaling}, {self.layers} GEMMs"
# torch._scaled_mm needs both dimensions of each weight to be multiples of 16.
ALIGNMENT = 16
INSTALL_HINT = "pip install 'torchao==0.18.*' (the [fp8] extra of this package), the release for torch 2.13"


def is_fp8_layer(module: nn.Module, name: str, gemms: tuple[str, ...] = LAYER_GEMMS) -> bool:
    """Whether the module at `name` (a `named_modules` name of `BertForPreTraining`) runs in FP8:
    an nn.Linear of an encoder layer whose name inside the layer is one of `gemms`."""
    if not isinstance(module, nn.Linear) or not name.startswith(ENCODER_LAYERS):
        return False
    index, _, inner = name[len(ENCODER_LAYERS):].partition(".")
    return index.isdigit() and inner in gemms


def fp8_layer_names(model: nn.Module, recipe: Fp8Recipe = Fp8Recipe()) -> list[str]:
    """The names of the linear layers `convert_to_fp8` converts, in module order."""
    return [name for name, module in model.named_modules() if is_fp8_layer(module, name, recipe.gemms)]


class _ImportNoise(logging.Filter):
    """torchao's import-time log lines that concern nothing FP8 training uses: its optional compiled
    kernels (which fail to load on a CPU-only torch) and torch's deprecation note on one of its enums."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("Failed to load") or "is an Enum subclass" in message)


_NOISE = _ImportNoise()


def _quiet_torchao_logs() -> None:
    """Keeps torchao's import from printing noise on every rank (the filter stays: the deprecation
    note comes again when torchao registers more enums, at its first conversion)."""
    for name in ("torchao", "torch.utils._pytree"):
        logger = logging.getLogger(name)
        if _NOISE not in logger.filters:
            logger.addFilter(_NOISE)


def _quiet_torchao_import() -> None:
    _quiet_torchao_logs()
    import torchao.float8  # noqa: F401


def torchao_missing() -> str | None:
    """None when torchao's FP8 training imports; else one line: not installed, or installed but broken
    (a torchao built for another torch fails in its own way, e.g. an AttributeError on a dtype)."""
    _quiet_torchao_logs()
    return dependency_problem("torchao.float8", "torchao", "--precision fp8", torchao_install_hint(),
                              "use --precision bf16")


def torchao_install_hint(torch_version: str = torch.__version__) -> str:
    """How to install a torchao that fits this torch: each torchao release is built for one torch release."""
    return f"{INSTALL_HINT}; each torchao release fits one torch release, and this is torch {torch_version}"


def fp8_unavailable(device: torch.device, scaling: str = "tensorwise") -> str | None:
    """Why a run on `device` cannot train in FP8 with the `scaling` recipe, with the fix; None when it can.

    The CPU runs torchao's emulation or the delayed recipe's CPU `_scaled_mm` (FP8 numerics, no speed);
    a GPU needs FP8 tensor cores. Only torchao's recipes need torchao.
    """
    missing = None if scaling == "delayed" else torchao_missing()
    if missing is not None or device.type != "cuda":
        return missing
    return capability_problem(torch.cuda.get_device_capability(device), torch.cuda.get_device_name(device))


def capability_problem(capability: tuple[int, int], name: str) -> str | None:
    """The start-up line for a GPU (compute capability, name) without FP8 tensor cores; None with them."""
    if tuple(capability) >= MIN_CAPABILITY:
        return None
    major, minor = capability
    return (f"--precision fp8 needs FP8 tensor cores (compute capability >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}: "
            f"Ada, Hopper, Blackwell), but {name} is {major}.{minor}: use --precision bf16 on this GPU")


def fp8_config(emulate: bool, scaling: str = "tensorwise") -> "Float8LinearConfig":
    """torchao's recipe `scaling` (one of TORCHAO_RECIPES) with fast accumulation in all three GEMMs.

    pad_inner_dim: the weight-gradient GEMM's inner dimension is the token count, which unpadded
    batches do not keep at a multiple of 16; torchao pads it with zeros (a no-op for packed rows).
    """
    _quiet_torchao_import()
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.config import Float8GemmConfig

    fast = Float8GemmConfig(use_fast_accum=True)
    config = Float8LinearConfig.from_recipe_name(TORCHAO_RECIPES[scaling])
    return replace(config, emulate=emulate, pad_inner_dim=True, gemm_config_output=fast, gemm_config_grad_input=fast,
                   gemm_config_grad_weight=fast)


def check_alignment(model: nn.Module, recipe: Fp8Recipe = Fp8Recipe()) -> None:
    """Raises ValueError naming the size when an FP8 layer's weight is not a multiple of 16 each way."""
    for name in fp8_layer_names(model, recipe):
        linear = model.get_submodule(name)
        assert isinstance(linear, nn.Linear)
        if linear.in_features % ALIGNMENT or linear.out_features % ALIGNMENT:
            raise ValueError(f"--precision fp8: {name} is {linear.in_features} x {linear.out_features}; FP8 GEMMs "
                             f"need hidden_size and intermediate_size divisible by {ALIGNMENT} (bert_config.json), "
                             "or use --precision bf16")


def convert_to_fp8(model: nn.Module, device: torch.device, recipe: Fp8Recipe = Fp8Recipe()) -> nn.Module:
    """Swaps the recipe's FP8 layers in place (torchao `Float8Linear`s, or `DelayedFp8Linear`s for the
    delayed recipe), keeping their parameters (same objects).

    device: where the model will run; torchao's FP8 GEMMs on CUDA, emulated elsewhere (the delayed
    recipe's `torch._scaled_mm` runs on both). Call it before the model is wrapped (DDP), compiled,
    or its parameters handed to an optimizer.
    """
    check_alignment(model, recipe)
    if recipe.scaling == "delayed":
        for name in fp8_layer_names(model, recipe):
            parent, _, child = name.rpartition(".")
            linear = model.get_submodule(name)
            assert isinstance(linear, nn.Linear)
            setattr(model.get_submodule(parent), child, DelayedFp8Linear.from_linear(linear))
        return model
    config = fp8_config(emulate=device.type != "cuda", scaling=recipe.scaling)
    from torchao.float8 import convert_to_float8_training

    convert_to_float8_training(model, module_filter_fn=lambda m, n: is_fp8_layer(m, n, recipe.gemms), config=config)
    for name in fp8_layer_names(model, recipe):
        model.get_submodule(name).register_forward_pre_hook(_input_in_autocast_dtype)
    return model


def _input_in_autocast_dtype(module: nn.Module, args: tuple) -> tuple:
    """The input in the autocast dtype of its device. torchao's Float8Linear casts its input under
    CUDA's autocast only; on the CPU an fp32 input (a LayerNorm's output) would reach its bf16
    gradient GEMMs as fp32 (rowwise_gw_hp's weight gradient refuses the mix). On a GPU a no-op."""
    (x,) = args
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return (x.to(torch.get_autocast_dtype(device_type)),)
    return args


ScalingState = dict[str, torch.Tensor | bool]


def scaling_states(model: nn.Module) -> dict[str, ScalingState]:
    """The delayed recipe's amax history of each of its layers, by module name ({} for a model without any):
    what the next training step reads besides the weights and the optimizer (copies, on the model's device)."""
    return {name: module.scaling_state() for name, module in model.named_modules()
            if isinstance(module, DelayedFp8Linear)}


def load_scaling_states(model: nn.Module, states: Mapping[str, ScalingState] | None) -> None:
    """`scaling_states`' values back into the layers of the same names, in place. A layer without an entry
    (`states` None: a checkpoint written before the history was kept, or under another precision or recipe, or
    for a rank this run did not have) starts without history: its next forward and backward calibrate on their
    own amax, as a fresh run's first step does."""
    for name, module in model.named_modules():
        if isinstance(module, DelayedFp8Linear):
            module.load_scaling_state(None if states is None else states.get(name))
