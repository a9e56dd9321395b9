"""--precision fp8 on the CPU: which layers convert, its numerics against bf16, checkpoints, eval, start-up.

The CPU runs torchao's emulation: the same FP8 rounding (E4M3 inputs and weights, E5M2 output
gradients, one scale per tensor), matmuls in high precision. The fake-CUDA dry run
(tests/trainer/dryrun/test_dryrun.py) checks that on a GPU the same layers call torch._scaled_mm.

Tolerances, measured on the demo's BERT (2 layers x 128) after 150 fp32 steps (dropout off, same
weights and batch):
- loss: FP8 within 1% of bf16 (measured 0.004%);
- gradients of the FP8 layers' weights: relative L2 error against bf16 at most 0.2 (measured
  0.058 to 0.088) and at least 0.01, which tells FP8 rounding happened (bf16 against fp32 is
  about 0.007); their biases (summed in high precision) at most 0.2 (measured up to 0.058);
  every other parameter's gradient, downstream of the FP8 layers in backward, at most 0.1
  (measured up to 0.046);
- eval of the same weights: masked-LM accuracy within 0.02 of bf16's (measured: equal, 0.652),
  eval loss within 2% (measured 0.02%).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torchao.float8.float8_linear import Float8Linear

from mlperf_bert import trainer
from mlperf_bert.build import Evaluation, eval_step
from mlperf_bert.config.settings import ConfigError
from mlperf_bert.data.batch import FlatBatch
from mlperf_bert.model.bert import BertConfig, BertForPreTraining, fused_projection
from mlperf_bert.model.compiling import compile_model
from mlperf_bert.model import fp8
from mlperf_bert.model.fp8 import (
    LAYER_GEMMS, Fp8Recipe, capability_problem, convert_to_fp8, fp8_config, fp8_layer_names, fp8_unavailable,
)
from mlperf_bert.startup import check_environment
from mlperf_bert.train.checkpoint import read_checkpoint
from mlperf_bert.train.step import forward_backward
from tests.harness.commands import run_cli
from tests.harness.cpu_run import cpu_run
from tests.harness.demo import make_demo_data, trainer_args
from tests.harness.launches import Launch, log_tail, run_launches
from tests.harness.paths import REPO

CPU = torch.device("cpu")
TINY = BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
LOSS_TOLERANCE = 0.01
FP8_GRADIENT_TOLERANCE = 0.2
FP8_ROUNDING_SEEN = 0.01
OTHER_GRADIENT_TOLERANCE = 0.1
ACCURACY_TOLERANCE = 0.02
EVAL_LOSS_TOLERANCE = 0.02
STEPS = 150  # of 32 sequences (make_demo_data.py: about 0.7 masked-LM accuracy)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_fp8_layers_are_each_encoder_layers_qkv_output_and_ffn_linears() -> None:
    model = BertForPreTraining(TINY)
    expected = [f"bert.encoder.layer.{i}.{name}" for i in range(2) for name in (
        "attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
        "intermediate.dense", "output.dense")]
    assert fp8_layer_names(model) == expected
    parameters = {name: p for name, p in model.named_parameters()}
    convert_to_fp8(model, CPU)
    converted = sorted(name for name, m in model.named_modules() if isinstance(m, Float8Linear))
    assert converted == sorted(expected)
    # The pooler, the MLM transform and the NSP head stay plain linears; the tied decoder is the embedding.
    plain = sorted(name for name, m in model.named_modules() if type(m) is nn.Linear)
    assert plain == ["bert.pooler.dense", "cls.predictions.transform.dense", "cls.seq_relationship"]
    assert all(p is parameters[name] for name, p in model.named_parameters())  # same tensors, still fp32
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_fp8_needs_weights_divisible_by_16() -> None:
    odd = BertForPreTraining(dataclasses.replace(TINY, intermediate_size=72))
    with pytest.raises(ValueError, match=r"intermediate.dense is 32 x 72; FP8 GEMMs need hidden_size and "
                                         r"intermediate_size divisible by 16"):
        convert_to_fp8(odd, CPU)


# ---------------------------------------------------------------- the rule at real sizes, every capability

BERT_LARGE_DEPTH = dataclasses.replace(TINY, num_hidden_layers=24, hidden_size=16, intermediate_size=32)


def test_fp8_layers_at_bert_large_depth_are_every_layers_six_gemms() -> None:
    """24 layers, as BERT-Large (a narrow width: no forward pass is needed to list and convert them):
    the two-digit layer indices convert as the one-digit ones."""
    model = BertForPreTraining(BERT_LARGE_DEPTH)
    expected = [f"bert.encoder.layer.{i}.{name}" for i in range(24) for name in LAYER_GEMMS]
    assert fp8_layer_names(model) == expected and len(expected) == 144
    convert_to_fp8(model, CPU)
    converted = [name for name, m in model.named_modules() if isinstance(m, Float8Linear)]
    assert converted == expected


@pytest.mark.parametrize("major", range(5, 11))
def test_fp8_needs_compute_capability_8_9_or_later_at_every_capability(major: int) -> None:
    for minor in range(10):
        problem = capability_problem((major, minor), "GPU")
        assert (problem is None) == ((major, minor) >= (8, 9)), (major, minor)
        if problem is not None:
            assert f"but GPU is {major}.{minor}: use --precision bf16" in problem


def test_fp8_recipe_pads_the_token_dimension_and_emulates_off_a_gpu() -> None:
    """Unpadded batches hold any number of tokens: the weight-gradient GEMM's inner dimension must be
    padded to the FP8 GEMM's multiple of 16."""
    for emulate in (True, False):
        config = fp8_config(emulate)
        assert config.pad_inner_dim and config.emulate == emulate


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_fp8_without_torchao_is_refused_on_every_device(monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    """The CPU emulates FP8 through torchao too: without it no device can train in FP8."""
    monkeypatch.setattr(fp8, "torchao_missing", lambda: "torchao does not import")
    assert fp8_unavailable(torch.device(device)) == "torchao does not import"


# ---------------------------------------------------------------- the fused QKV projection with torchao's layers

def qkv_layers(recipe: Fp8Recipe, seed: int = 0) -> tuple[nn.Module, ...]:
    """Query, key and value of the first encoder layer of TINY converted to `recipe`'s FP8 layers."""
    torch.manual_seed(seed)
    attention = convert_to_fp8(BertForPreTraining(TINY), CPU, recipe).bert.encoder.layer[0].attention.self
    return attention.query, attention.key, attention.value


def projected(layers: tuple[nn.Module, ...], x: torch.Tensor, grads: list[torch.Tensor], fused: bool):
    """Outputs and gradients (input, then each layer's weight and bias) of the projections of `x`, under fp8's
    autocast (bf16), the fused way (`bert.fused_projection`) or one layer at a time."""
    x = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outputs = fused_projection(layers, x) if fused else tuple(layer(x) for layer in layers)
    torch.autograd.backward(outputs, grads)
    return outputs, [x.grad] + [p.grad for layer in layers for p in (layer.weight, layer.bias)]


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise", "rowwise_gw_hp"])
def test_fused_projection_runs_torchaos_fp8_layers_as_the_three_projections(scaling: str) -> None:
    """torchao's Float8Linear is no plain nn.Linear: the fused projection runs the three layers one by one, each in
    FP8 with its own scales, so outputs and gradients equal the separate projections bitwise; a GEMM over the stacked
    weights would run in bf16, not FP8."""
    layers = qkv_layers(Fp8Recipe(scaling))
    assert all(isinstance(layer, Float8Linear) for layer in layers)
    torch.manual_seed(1)
    x, grads = torch.randn(40, 32), [torch.randn(40, 32, dtype=torch.bfloat16) for _ in layers]
    fused, fused_grads = projected(layers, x, grads, fused=True)
    separate, separate_grads = projected(copy.deepcopy(layers), x, grads, fused=False)
    for a, b in zip(fused + tuple(fused_grads), separate + tuple(separate_grads)):
        assert a.dtype == b.dtype and torch.equal(a, b)
    weight = torch.cat([layer.weight for layer in layers]).detach()
    bias = torch.cat([layer.bias for layer in layers]).detach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        unrounded = torch.nn.functional.linear(x, weight, bias)
    assert _relative(torch.cat(fused, dim=-1).detach(), unrounded) >= FP8_ROUNDING_SEEN  # FP8 rounding happened


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory):
    """The demo's BERT (2 layers x 128) after STEPS fp32 AdamW steps on demo data, well above chance."""
    data = make_demo_data(tmp_path_factory.mktemp("demo_128"), "--hidden_size", "128", "--intermediate_size", "512")
    out = tmp_path_factory.mktemp("fp32_run")
    run = cpu_run(trainer_args(data, out, "--do_train", "--max_steps", str(STEPS), "--optimizer", "adam",
                               "--learning_rate", "2e-3", "--warmup_steps", "50", "--train_batch_size", "32",
                               "--eval_iter_samples", "100000", "--log_freq", "1000"))
    try:
        run.hooks.run_start(trainer.run_start_event(run))
        for _ in range(STEPS):
            trainer.train_step(run, STEPS * 32)
    finally:
        run.close()
        run.hooks.close()
    return run


def _gradients(model: nn.Module, batch: FlatBatch, precision: str) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = forward_backward(model, batch, precision).loss.total.item()
    return loss, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


# Every recipe over every encoder GEMM, and tensorwise and delayed over the FFN's two only.
RECIPES = [Fp8Recipe(scaling) for scaling in ("tensorwise", "rowwise", "rowwise_gw_hp", "delayed")] + [
    Fp8Recipe("tensorwise", "ffn"), Fp8Recipe("delayed", "ffn")]


@pytest.mark.parametrize("recipe", RECIPES, ids=Fp8Recipe.describe)
def test_fp8_step_loss_and_gradients_stay_within_tolerance_of_bf16(trained_run, recipe: Fp8Recipe) -> None:
    """Every recipe's first step (the delayed one calibrates on it: its second step is test_fp8_delayed.py's)."""
    model = copy.deepcopy(trained_run.eval.model).eval()  # no dropout: both steps see the same network
    batch = trained_run.eval.data.batches()[0]
    loss_bf16, grads_bf16 = _gradients(model, batch, "bf16")
    loss_fp8, grads_fp8 = _gradients(convert_to_fp8(copy.deepcopy(model), CPU, recipe), batch, "fp8")
    assert abs(loss_fp8 - loss_bf16) <= LOSS_TOLERANCE * loss_bf16, (loss_fp8, loss_bf16)
    assert grads_fp8.keys() == grads_bf16.keys()
    fp8_weights = {f"{layer}.weight" for layer in fp8_layer_names(model, recipe)}
    fp8_biases = {f"{layer}.bias" for layer in fp8_layer_names(model, recipe)}
    largest = max(float(g.norm()) for g in grads_bf16.values())
    for name, reference in grads_bf16.items():
        if float(reference.norm()) < 1e-4 * largest:
            continue  # e.g. the key bias, whose gradient is zero up to rounding (softmax ignores it)
        error = _relative(grads_fp8[name], reference)
        if name in fp8_weights:
            assert FP8_ROUNDING_SEEN <= error <= FP8_GRADIENT_TOLERANCE, (name, error)
        elif name in fp8_biases:
            assert error <= FP8_GRADIENT_TOLERANCE, (name, error)
        else:
            assert error <= OTHER_GRADIENT_TOLERANCE, (name, error)


@pytest.mark.parametrize("recipe", [Fp8Recipe(), Fp8Recipe("delayed")], ids=Fp8Recipe.describe)
def test_fp8_layers_compile_to_the_eager_step(trained_run, recipe: Fp8Recipe) -> None:
    """torch.compile traces torchao's FP8 tensor subclass and the delayed recipe's autograd function with
    its amax buffers (dynamo + AOT autograd, `compiling.compile_model`): the loss equals the eager FP8 step's,
    and so do torchao's gradients. The delayed recipe's forward is the eager one to the bit (its amax
    buffers are equal); its gradients differ by E5M2 roundings that flip where the traced backward's fp32
    sums round differently (measured up to 0.034 relative on a weight, against FP8's own 0.058-0.088 from
    bf16), so they are held to 0.05. aot_eager: the trace without Inductor's code generation, which takes
    minutes on the CPU."""
    eager = convert_to_fp8(copy.deepcopy(trained_run.eval.model), CPU, recipe).eval()  # no dropout
    compiled = compile_model(copy.deepcopy(eager), "default", backend="aot_eager")
    batch = trained_run.eval.data.batches()[0]
    loss_eager, grads_eager = _gradients(eager, batch, "fp8")
    loss_compiled, grads_compiled = _gradients(compiled, batch, "fp8")
    assert loss_compiled == pytest.approx(loss_eager, rel=1e-6)
    if recipe.scaling == "delayed":
        for name in fp8_layer_names(eager, recipe):
            assert torch.equal(compiled.get_submodule(name).amax[0], eager.get_submodule(name).amax[0]), name
        largest = max(float(g.norm()) for g in grads_eager.values())
        for name, reference in grads_eager.items():
            if float(reference.norm()) >= 1e-4 * largest:  # not the key bias's zero up to rounding
                assert _relative(grads_compiled[name], reference) <= 0.05, name
        return
    for name, reference in grads_eager.items():
        torch.testing.assert_close(grads_compiled[name], reference, rtol=1e-5, atol=1e-7, msg=name)


def test_eval_under_fp8_scores_the_weights_as_bf16_does(trained_run) -> None:
    ev = trained_run.eval
    bf16 = dataclasses.replace(ev.cfg, run=dataclasses.replace(ev.cfg.run, precision="bf16"))
    fp8 = dataclasses.replace(ev.cfg, run=dataclasses.replace(ev.cfg.run, precision="fp8"))
    accuracy_bf16, loss_bf16 = trainer.evaluate(dataclasses.replace(ev, cfg=bf16,
                                                                    step=eval_step(bf16, ev.model, ev.device)))
    fp8_model = convert_to_fp8(copy.deepcopy(ev.model), CPU)
    accuracy_fp8, loss_fp8 = trainer.evaluate(Evaluation(fp8, ev.denv, ev.device, fp8_model, ev.logger, ev.data,
                                                         ev.hooks, eval_step(fp8, fp8_model, ev.device)))
    assert accuracy_bf16 > 0.3  # far above chance (1/128): the comparison means something
    assert abs(accuracy_fp8 - accuracy_bf16) <= ACCURACY_TOLERANCE, (accuracy_fp8, accuracy_bf16)
    assert abs(loss_fp8 - loss_bf16) <= EVAL_LOSS_TOLERANCE * loss_bf16, (loss_fp8, loss_bf16)


def _train(demo_data: Path, out: Path, precision: str, steps: int, *extra: str) -> Launch:
    flags = trainer_args(demo_data, out, "--do_train", "--max_steps", str(steps), "--precision", precision,
                         "--checkpoint_every_samples", "16", "--keep_checkpoints", "10", *extra)
    return Launch(1, flags, out / "logs")


@pytest.mark.slow
def test_checkpoint_written_under_fp8_resumes_under_bf16_and_back(demo_data: Path, tmp_path: Path) -> None:
    start = tmp_path / "fp8" / "checkpoints" / "ckpt-000000000016.pt"
    back = tmp_path / "bf16" / "checkpoints" / "ckpt-000000000032.pt"
    launches = {  # in this order, in one process
        "fp8": _train(demo_data, tmp_path / "fp8", "fp8", 4),
        "bf16": _train(demo_data, tmp_path / "bf16", "bf16", 4, "--resume_from_checkpoint", str(start)),
        "fp8_again": _train(demo_data, tmp_path / "fp8_again", "fp8", 6, "--resume_from_checkpoint", str(back))}
    for name, codes in run_launches(launches, tmp_path / "launches").items():
        assert codes == [0], (name, log_tail(launches[name].logs / "rank0.err"))
    written = read_checkpoint(tmp_path / "fp8" / "checkpoints" / "ckpt-000000000032.pt")["model"]
    reference = BertForPreTraining(BertConfig.from_json(demo_data / "bert_config.json")).state_dict()
    assert list(written) == list(reference)  # the keys of a model that never saw FP8
    assert {t.dtype for t in written.values() if t.is_floating_point()} == {torch.float32}

    resumed = read_checkpoint(tmp_path / "fp8_again" / "checkpoints" / "ckpt-000000000048.pt")["model"]
    assert list(resumed) == list(reference)
    moved = [name for name in reference if not torch.equal(resumed[name], written[name])]
    assert moved, "the resumed fp8 run trained"


def test_gpu_without_fp8_tensor_cores_stops_at_start_up(demo_data: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    assert capability_problem((9, 0), "H100") is None and capability_problem((8, 9), "L4") is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    run = cpu_run(trainer_args(demo_data, tmp_path, "--precision", "fp8"))  # a config the CPU accepts
    run.close()
    run.hooks.close()
    with pytest.raises(ConfigError) as refused:
        check_environment(run.cfg, {}, torch.device("cuda", 0))
    assert str(refused.value) == ("--precision fp8 needs FP8 tensor cores (compute capability >= 8.9: Ada, Hopper, "
                                  "Blackwell), but NVIDIA A100-SXM4-80GB is 8.0: use --precision bf16 on this GPU")


@pytest.mark.slow
def test_demo_with_precision_fp8_trains_and_passes_both_rulesets(tmp_path: Path) -> None:
    """`PRECISION=fp8 tools/run_demo.sh` (what `PRECISION=fp8 make demo` runs), at toy size: the environment's
    precision replaces the config's, and the FP8 run's MLPerf log passes the compliance checker."""
    toy = {"DEMO_NUM_TRAIN": "600", "DEMO_NUM_SHARDS": "2", "DEMO_HIDDEN_SIZE": "32", "DEMO_INTERMEDIATE_SIZE": "64",
           "NUM_EVAL_EXAMPLES": "100", "EVAL_BATCH_SIZE": "50", "BATCHSIZE": "8", "EVAL_ITER_START_SAMPLES": "32",
           "EVAL_ITER_SAMPLES": "32", "MAX_STEPS": "4", "WARMUP_STEPS": "1", "TARGET_MLM_ACCURACY": "0.01",
           "MAX_SAMPLES_TERMINATION": "64", "MAX_SEQ_LENGTH": "64", "MAX_PREDICTIONS_PER_SEQ": "10"}
    config = tmp_path / "config_toy.sh"
    config.write_text((REPO / "config_CPU_1x2.sh").read_text() + "".join(f"export {k}={v}\n" for k, v in toy.items()))
    result = run_cli(["bash", "tools/run_demo.sh"], env={
        "PYTHON": sys.executable, "PRECISION": "fp8", "DEMO_CONFIG": str(config), "SEED": "3",
        "DEMO_DATA": str(tmp_path / "data"), "LOGDIR": str(tmp_path / "runs")})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "precision fp8" in result.stdout
    assert "ruleset 5.0.0: SUCCESS" in result.stdout and "ruleset 2.0.0: SUCCESS" in result.stdout, result.stdout
    (resolved,) = (tmp_path / "runs").glob("*_3/resolved_config.json")
    assert json.loads(resolved.read_text())["run"]["precision"] == "fp8"
