"""`--fp8_recipe delayed` (model/fp8_delayed.py): scales from the previous step's amax, against a hand computation.

The expected values are computed here from the definition: quantise with the scale that the
previous call's amax gives (saturating), dequantise, multiply in fp32. Fast accumulation and
`torch._scaled_mm`'s own summation order differ from that by fp32 rounding only.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mlperf_bert.config.cli import parse_config
from mlperf_bert.config.settings import ConfigError
from mlperf_bert.data.batch import FlatBatch
from mlperf_bert.model.bert import BertForPreTraining, fused_projection
from mlperf_bert.model.fp8 import Fp8Recipe, convert_to_fp8, fp8_layer_names, fp8_unavailable
from mlperf_bert.model.fp8_delayed import E4M3, E5M2, GRAD, INPUT, WEIGHT, DelayedFp8Linear, _pad_rows
from mlperf_bert.train.eval_step import EagerEval
from mlperf_bert.train.step import forward_backward
from tests.harness.fp8_bert import NO_DROPOUT, TINY, random_batch
from tests.harness.paths import REPO

CPU = torch.device("cpu")


def quantised(x: torch.Tensor, amax: float, dtype: torch.dtype) -> torch.Tensor:
    """x scaled so that `amax` meets the format's largest value, clamped, rounded to `dtype`, scaled back."""
    top = torch.finfo(dtype).max
    scale = top / amax
    return (x.double() * scale).clamp(-top, top).to(dtype).double() / scale


def layer(seed: int = 0, in_features: int = 32, out_features: int = 48) -> DelayedFp8Linear:
    torch.manual_seed(seed)
    return DelayedFp8Linear.from_linear(nn.Linear(in_features, out_features))


def test_second_forward_scales_by_the_first_ones_amax_and_saturates_above_it():
    fp8 = layer()
    first = torch.randn(16, 32)
    fp8(first)
    second = 3.0 * torch.randn(16, 32)  # about 3x the first's amax: its largest values saturate
    got = fp8(second).double()
    w = quantised(fp8.weight.detach(), float(fp8.weight.detach().abs().max()), E4M3)
    expected = quantised(second, float(first.abs().max()), E4M3) @ w.t() + fp8.bias.detach().double()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    own_scale = quantised(second, float(second.abs().max()), E4M3) @ w.t() + fp8.bias.detach().double()
    assert (got - own_scale).abs().max() > 1e-2  # dynamic scaling would give another result
    assert float(fp8.amax[INPUT]) == float(second.abs().max())  # what the next call will scale by


def test_a_training_forward_scales_the_weight_by_the_previous_ones_amax_and_an_eval_by_its_own():
    """The weight's scale is delayed as the input's: after an update that doubles the weight, the next training
    forward casts it by the last forward's weight amax (its largest values saturate) and records the new amax;
    an eval forward casts it by its own amax and leaves the history alone."""
    fp8 = layer(3)
    x = torch.randn(16, 32)
    fp8(x)
    first_amax = float(fp8.weight.detach().abs().max())
    assert float(fp8.amax[WEIGHT]) == first_amax
    with torch.no_grad():
        fp8.weight.mul_(2.0)
    w = fp8.weight.detach()
    bias = fp8.bias.detach().double()
    with torch.no_grad():
        evaluated = fp8(x).double()
    own = quantised(x, float(x.abs().max()), E4M3) @ quantised(w, float(w.abs().max()), E4M3).t() + bias
    torch.testing.assert_close(evaluated, own, rtol=1e-5, atol=1e-5)
    assert float(fp8.amax[WEIGHT]) == first_amax  # the eval left the history as the training forward left it
    got = fp8(x).double()
    delayed = quantised(x, float(x.abs().max()), E4M3) @ quantised(w, first_amax, E4M3).t() + bias
    torch.testing.assert_close(got, delayed, rtol=1e-5, atol=1e-5)
    assert (got - own).abs().max() > 1e-2  # the weight's own amax would give another result
    assert float(fp8.amax[WEIGHT]) == float(w.abs().max())  # what the next training forward will scale by


def test_a_history_without_the_weights_slot_loads_uncalibrated_and_a_longer_one_is_refused():
    """A checkpoint's amax history of two values (input and gradient, before the weight's slot): the next forward
    calibrates on its own amax, as a fresh layer's, rather than scaling the weight by an empty slot; more values
    than the layer keeps: an error naming the release."""
    fp8 = layer(4)
    fp8.load_scaling_state({"amax": torch.tensor([2.0, 3.0]), "calibrated": True, "grad_calibrated": True})
    assert fp8.amax.tolist() == [2.0, 3.0, 0.0] and not fp8.calibrated and fp8.grad_calibrated
    x = torch.randn(16, 32)
    w = fp8.weight.detach()
    expected = (quantised(x, float(x.abs().max()), E4M3) @ quantised(w, float(w.abs().max()), E4M3).t()
                + fp8.bias.detach().double())
    torch.testing.assert_close(fp8(x).double(), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="another release"):
        fp8.load_scaling_state({"amax": torch.ones(4), "calibrated": True, "grad_calibrated": True})


def test_first_forward_and_backward_calibrate_on_their_own_amax():
    fp8 = layer(1)
    x = torch.randn(16, 32, requires_grad=True)
    out = fp8(x)
    grad = torch.randn_like(out) * 1e-3  # gradients far below E5M2's range at scale 1
    out.backward(grad)
    g = quantised(grad, float(grad.abs().max()), E5M2)
    w = quantised(fp8.weight.detach(), float(fp8.weight.detach().abs().max()), E4M3)
    xq = quantised(x.detach(), float(x.detach().abs().max()), E4M3)
    torch.testing.assert_close(x.grad.double(), g @ w, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(fp8.weight.grad.double(), g.t() @ xq, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(fp8.bias.grad, grad.sum(0), rtol=1e-6, atol=1e-9)
    assert float(fp8.amax[GRAD]) == float(grad.abs().max())


def test_second_backward_scales_by_the_first_backwards_amax_and_pads_odd_token_counts():
    fp8 = layer(2)
    x1 = torch.randn(13, 32, requires_grad=True)  # 13 tokens: the weight gradient's inner dimension is padded
    fp8(x1).backward(torch.randn(13, 48))
    x2 = torch.randn(13, 32, requires_grad=True)
    fp8.weight.grad = None
    grad = 2.0 * torch.randn(13, 48)
    previous = float(fp8.amax[GRAD])
    fp8(x2).backward(grad)
    g = quantised(grad, previous, E5M2)
    xq = quantised(x2.detach(), float(x1.detach().abs().max()), E4M3)
    w = quantised(fp8.weight.detach(), float(fp8.weight.detach().abs().max()), E4M3)
    torch.testing.assert_close(fp8.weight.grad.double(), g.t() @ xq, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x2.grad.double(), g @ w, rtol=1e-5, atol=1e-6)


def test_autocast_gives_the_autocast_dtype_and_a_3d_input_keeps_its_shape():
    fp8 = layer(3)
    x = torch.randn(2, 8, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fp8(x)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 8, 48)


def test_conversion_keeps_parameters_state_dict_and_converts_the_recipes_layers():
    torch.manual_seed(0)
    model = BertForPreTraining(TINY)
    before = dict(model.named_parameters())
    keys = list(model.state_dict())
    recipe = Fp8Recipe("delayed", "ffn")
    convert_to_fp8(model, CPU, recipe)
    converted = [name for name, m in model.named_modules() if isinstance(m, DelayedFp8Linear)]
    assert converted == fp8_layer_names(model, recipe) == [
        f"bert.encoder.layer.{i}.{g}" for i in range(2) for g in ("intermediate.dense", "output.dense")]
    assert list(model.state_dict()) == keys  # the amax buffers are not saved
    assert all(p is before[name] for name, p in model.named_parameters())
    assert fp8_unavailable(CPU, "delayed") is None


def test_fp8_recipe_flags_reach_the_settings_and_are_refused_without_fp8(tmp_path):
    base = ["--input_dir", str(tmp_path), "--eval_dir", str(tmp_path), "--output_dir", str(tmp_path / "o"),
            "--bert_config_path", str(tmp_path / "b.json"), "--max_steps", "10", "--submission_division", "open"]
    cfg = parse_config([*base, "--precision", "fp8", "--fp8_recipe", "delayed", "--fp8_layers", "ffn"], 1)
    assert (cfg.run.fp8_recipe, cfg.run.fp8_layers) == ("delayed", "ffn")
    with pytest.raises(ConfigError, match="--fp8_recipe applies to --precision fp8 only; drop it with --precision bf16"):
        parse_config([*base, "--precision", "bf16", "--fp8_recipe", "delayed"], 1)
    run_and_time = (REPO / "run_and_time.sh").read_text()
    assert '"FP8_RECIPE --fp8_recipe"' in run_and_time and '"FP8_LAYERS --fp8_layers"' in run_and_time


def test_a_zero_input_scales_the_next_forward_by_one():
    """An all-zero input has amax 0: its output is the bias, and the next forward scales by 1 (amax 448, E4M3's
    largest value), not by 448 / 1e-12."""
    fp8 = layer(4)
    assert torch.equal(fp8(torch.zeros(16, 32)), fp8.bias.detach().expand(16, 48))
    x = torch.randn(16, 32)
    w = quantised(fp8.weight.detach(), float(fp8.weight.detach().abs().max()), E4M3)
    expected = quantised(x, torch.finfo(E4M3).max, E4M3) @ w.t() + fp8.bias.detach().double()
    torch.testing.assert_close(fp8(x).double(), expected, rtol=1e-5, atol=1e-5)


def test_an_eval_forward_before_the_first_training_step_leaves_the_backward_to_calibrate():
    """A forward without gradients (the eval before training) sets no gradient amax: the first backward scales by
    its own amax, as in a run without that eval."""
    fp8 = layer(5)
    with torch.no_grad():
        fp8(torch.randn(16, 32))
    x = torch.randn(16, 32, requires_grad=True)
    grad = torch.randn(16, 48) * 1e-3
    fp8(x).backward(grad)
    w = quantised(fp8.weight.detach(), float(fp8.weight.detach().abs().max()), E4M3)
    torch.testing.assert_close(x.grad.double(), quantised(grad, float(grad.abs().max()), E5M2) @ w, rtol=1e-5,
                               atol=1e-9)


@pytest.mark.parametrize("dtype, autocast", [(torch.float16, True), (torch.bfloat16, False)])
def test_half_precision_outputs_and_input_gradients_keep_their_dtypes(dtype, autocast):
    """Under fp16 autocast the output is fp16 and an fp32 input's gradient fp32; a bf16 input outside autocast gives
    a bf16 output and gradient; the weight and bias gradients are fp32, as the parameters."""
    fp8 = layer(6)
    x = torch.randn(16, 32, dtype=torch.float32 if autocast else dtype, requires_grad=True)
    with torch.autocast("cpu", dtype=dtype, enabled=autocast):
        out = fp8(x)
    out.backward(torch.randn_like(out))
    assert (out.dtype, x.grad.dtype) == (dtype, x.dtype)
    assert fp8.weight.grad.dtype == fp8.bias.grad.dtype == torch.float32


@pytest.mark.parametrize("tokens, padded", [(1, 16), (15, 16), (16, 16), (17, 32), (512, 512)])
def test_token_counts_are_padded_with_zero_rows_to_a_multiple_of_16(tokens, padded):
    rows = _pad_rows(torch.ones(tokens, 4))
    assert rows.shape == (padded, 4) and rows[:tokens].eq(1).all() and rows[tokens:].eq(0).all()


def test_the_bias_gradient_is_summed_over_the_tokens_in_fp32():
    """bf16 output gradients summed as fp32, the bias's own dtype: 1 + 2^-7 + 2^-8 exactly, which bf16 (8
    significant bits) would round away."""
    fp8 = layer(6)
    x = torch.randn(3, 32, dtype=torch.bfloat16, requires_grad=True)
    out = fp8(x)
    grad = torch.zeros_like(out)
    grad[:, 0] = torch.tensor([1.0, 2 ** -7, 2 ** -8], dtype=torch.bfloat16)
    out.backward(grad)
    assert fp8.bias.grad[0].item() == 1 + 2 ** -7 + 2 ** -8 and fp8.bias.grad[1:].eq(0).all()


# ---------------------------------------------------------------- eval between training steps


def _delayed_model() -> BertForPreTraining:
    torch.manual_seed(0)
    return convert_to_fp8(BertForPreTraining(NO_DROPOUT), CPU, Fp8Recipe("delayed"))


def _step(model: BertForPreTraining, batch: FlatBatch) -> None:
    """One training step (SGD: no optimizer state, so a step needs only the model)."""
    forward_backward(model, batch, "fp8")
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.5 * p.grad
            p.grad = None


def _eval(model: BertForPreTraining) -> torch.Tensor:
    """The trainer's eval (eval mode, no gradients: eval_step.scoring) on other tokens than training's."""
    return EagerEval(model, "fp8", CPU).totals([random_batch(9, 6, 24, scale_ids=True)])


def _histories(model: nn.Module) -> dict[str, tuple[list[float], bool, bool]]:
    return {name: (m.amax.tolist(), m.calibrated, m.grad_calibrated) for name, m in model.named_modules()
            if isinstance(m, DelayedFp8Linear)}


def test_an_eval_between_training_steps_leaves_the_scales_and_the_next_step_as_without_it():
    """An eval forward reads and writes no amax history: the training step after an eval scales by the previous
    training step's amax, and its weights equal, bitwise, those of the same steps without the eval between."""
    batches = [random_batch(seed, 4, 16) for seed in range(3)]
    plain, evaluated = _delayed_model(), _delayed_model()
    for model in (plain, evaluated):
        _step(model, batches[0])
        _step(model, batches[1])
    _eval(evaluated)
    assert _histories(evaluated) == _histories(plain)  # the eval set's amax left no trace
    for model in (plain, evaluated):
        _step(model, batches[2])
    for (name, a), b in zip(plain.named_parameters(), evaluated.parameters()):
        assert torch.equal(a, b), name


def test_an_eval_before_training_leaves_the_layers_uncalibrated_and_scores_by_each_batchs_own_amax():
    """The eval at 0 samples sets no history (the first training step calibrates on its own amax), and an eval's
    result does not depend on the history the last training step left (the same weights score the same)."""
    model = _delayed_model()
    before = _eval(model)
    assert all(not calibrated and not grad for _, calibrated, grad in _histories(model).values())
    assert all(m.amax.eq(0).all() for m in model.modules() if isinstance(m, DelayedFp8Linear))
    for module in model.modules():  # a history far from the eval set's amax: eval scales would saturate
        if isinstance(module, DelayedFp8Linear):
            module.amax.fill_(1e-3)
            module.calibrated = module.grad_calibrated = True
    assert torch.equal(_eval(model), before)


# ---------------------------------------------------------------- the fused QKV projection

def _qkv(seed: int = 0, equal_amax: bool = False) -> tuple[DelayedFp8Linear, ...]:
    """Query, key and value over one input; `equal_amax`: each weight scaled to the same absolute maximum, so the
    stacked weight casts to FP8 exactly as each one alone."""
    torch.manual_seed(seed)
    layers = tuple(layer(seed + i) for i in range(3))
    if equal_amax:
        with torch.no_grad():
            for layer_ in layers:
                layer_.weight.mul_(0.25 / layer_.weight.abs().max())
    return layers


def _project(layers: tuple[DelayedFp8Linear, ...], x: torch.Tensor, grads: list[torch.Tensor], fused: bool):
    """Outputs and gradients (input, then each layer's weight and bias), the fused way or one layer at a time."""
    x = x.clone().requires_grad_(True)
    outputs = fused_projection(layers, x) if fused else tuple(layer_(x) for layer_ in layers)
    torch.autograd.backward(outputs, grads)
    return torch.cat(outputs, dim=-1).detach(), [x.grad] + [p.grad for l_ in layers for p in (l_.weight, l_.bias)]


def test_fused_projection_is_one_fp8_gemm_over_the_stacked_weights_scaled_by_the_querys_history():
    """Query, key and value as one FP8 GEMM: the input cast once, the stacked weight by its own amax, the output
    gradient by one amax; the history is the query layer's. Against the hand computation of that GEMM (first call:
    the input's own amax; second call: the first call's), and within FP8 rounding of the three separate layers."""
    layers = _qkv()
    torch.manual_seed(5)
    x1, x2 = torch.randn(24, 32), 2.0 * torch.randn(24, 32)
    grads = [torch.randn(24, 48) * 1e-3 for _ in layers]
    weight = torch.cat([l_.weight for l_ in layers]).detach()
    bias = torch.cat([l_.bias for l_ in layers]).detach().double()
    w8 = quantised(weight, float(weight.abs().max()), E4M3)
    for x, x_amax in ((x1, float(x1.abs().max())), (x2, float(x1.abs().max()))):  # the second: the first's amax
        out, _ = _project(layers, x, grads, fused=True)
        torch.testing.assert_close(out.double(), quantised(x, x_amax, E4M3) @ w8.t() + bias, rtol=1e-5, atol=1e-5)
    query, key, value = layers
    assert float(query.amax[INPUT]) == float(x2.abs().max())
    assert float(query.amax[GRAD]) == max(float(g.abs().max()) for g in grads)
    assert float(query.amax[WEIGHT]) == float(weight.abs().max())  # the stacked weight's, read in its three parts
    assert not key.calibrated and not value.calibrated and key.amax.eq(0).all() and value.amax.eq(0).all()

    # Each FP8 result is about 0.06 from fp32 (relative L2); fused against separate measured up to 0.007 for the
    # outputs and 0.093 for the gradients.
    fused, fused_grads = _project(_qkv(), x1, grads, fused=True)
    separate, separate_grads = _project(_qkv(), x1, grads, fused=False)
    assert 0 < _relative(fused, separate) <= 0.05
    for got, expected in zip(fused_grads, separate_grads):
        assert _relative(got, expected) <= 0.15


def test_fused_projection_equals_the_separate_layers_where_their_fp8_casts_are_the_same():
    """Weights of one absolute maximum and output gradients of one: every FP8 operand of the fused GEMM is the
    separate layers' own, so outputs and gradients agree up to the fp32 sums' order."""
    torch.manual_seed(6)
    x = torch.randn(24, 32)
    grads = [torch.randn(24, 48) * 1e-3 for _ in range(3)]
    grads = [g * (1e-3 / g.abs().max()) for g in grads]
    fused, fused_grads = _project(_qkv(equal_amax=True), x, grads, fused=True)
    separate, separate_grads = _project(_qkv(equal_amax=True), x, grads, fused=False)
    torch.testing.assert_close(fused, separate, rtol=1e-6, atol=1e-6)
    for got, expected in zip(fused_grads, separate_grads):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-8)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())
