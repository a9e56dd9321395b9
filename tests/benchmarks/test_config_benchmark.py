"""Configs = benchmark: `benchmarks/throughput.py --from_config` times the set-up each GPU config trains with.

The trainer's side is the TrainConfig the trainer builds from the flags run_and_time.sh gives it
for the config; the benchmark's side is the set-up `--from_config` builds. A variant config whose
every set-up variable differs from the benchmark's own defaults shows that each one is taken from
the config, not from a default that happens to agree.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from clip_study import trainer_flags
from mlperf_bert.config.cli import parse_config
from mlperf_bert.config.settings import TrainConfig
from tests.harness.commands import load_script
from tests.harness.demo import config_exports
from tests.harness.paths import REPO

H200 = REPO / "config_DGXH200_1x8.sh"
GPU_CONFIGS = sorted(p.name for p in REPO.glob("config_*.sh") if "export DEVICE=cpu" not in p.read_text())
# Every set-up variable other than the shipped configs' values and the benchmark's defaults.
VARIANT = {"INPUT_LAYOUT": "unpadded", "PRECISION": "fp16", "COMPILE_MODE": "max-autotune-no-cudagraphs",
           "CUDA_GRAPHS": "0", "ATTENTION_BACKEND": "grouped", "ATTENTION_GROUP_BOUNDS": "100,300,512",
           "OPTIMIZER": "adam", "DIST_OPTIMIZER": "0", "BATCHSIZE": "7", "BALANCE": "none", "DIVISION": "open"}


@pytest.fixture(scope="module")
def bench():
    return load_script(REPO / "benchmarks" / "throughput.py", "throughput_from_config")


def _variant(folder: Path) -> Path:
    text = (REPO / "config_DGXH200_1x8.sh").read_text()
    for name, value in VARIANT.items():
        text, found = re.subn(rf"^export {name}=.*$", f"export {name}={value}", text, flags=re.M)
        if not found:
            text += f"export {name}={value}\n"
    path = folder / "config_VARIANT_1x8.sh"
    path.write_text(text)
    return path


def _trainer_config(config: Path, folder: Path) -> TrainConfig:
    """What the trainer builds from this config: run_and_time.sh's flags, parsed by the trainer."""
    for name in ("data", "eval"):
        (folder / name).mkdir(exist_ok=True)
    (folder / "bert_config.json").write_text("{}")
    (folder / "ckpt.pt").touch()
    flags = trainer_flags(config, {"DATADIR_PHASE2": str(folder / "data"), "EVALDIR": str(folder / "eval"),
                                   "BERT_CONFIG": str(folder / "bert_config.json"),
                                   "INIT_CHECKPOINT": str(folder / "ckpt.pt"), "OUTPUT_DIR": str(folder / "out"),
                                   "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1"})
    exports = config_exports(config)
    return parse_config(flags, int(exports["DGXNGPU"]) * int(exports["DGXNNODES"]))


@pytest.mark.parametrize("config", [*GPU_CONFIGS, "variant"])
def test_benchmark_from_config_sets_up_what_the_trainer_trains(bench, config: str, tmp_path: Path) -> None:
    path = _variant(tmp_path) if config == "variant" else REPO / config
    train = _trainer_config(path, tmp_path)
    ctx = bench.build_context(bench.parse_args(["--from_config", str(path), "--device", "cpu"]))
    packed = train.data.input_layout == "packed"
    assert ctx.layouts == (train.data.input_layout,) and ctx.precisions == (train.run.precision,)
    assert (ctx.precision, ctx.compile_mode, ctx.graphs) == (train.run.precision, train.run.compile_mode,
                                                             train.run.cuda_graphs)
    assert (ctx.attention_backend, ctx.group_bounds) == (train.model.attention_backend, train.model.group_bounds)
    assert (ctx.optimizer, ctx.sharded) == (train.optim.optimizer, train.optim.distributed)
    # the step: the config's packs per GPU, or the rows holding its sequences (a pack counts as 2)
    assert ctx.cfg.rows == (train.micro_batch_size if packed else -(-train.micro_batch_size // 2))
    assert (ctx.cfg.max_seq_length, ctx.cfg.max_predictions) == (train.data.max_seq_length,
                                                                 train.data.max_predictions_per_seq)
    if config == "variant":
        assert (ctx.compile_mode, ctx.optimizer, ctx.group_bounds, ctx.cfg.rows) == (
            "max-autotune-no-cudagraphs", "adam", (100, 300, 512), 4)


@pytest.mark.parametrize("config", GPU_CONFIGS)
def test_every_gpu_config_compiles_and_graphs_its_eval(config: str) -> None:
    """Each GPU config names its compile mode (the benchmark's on a GPU) and turns the eval graph on; its
    comment points at the section of docs/PERFORMANCE.md that gives the reason."""
    exports = config_exports(REPO / config)
    assert exports.get("COMPILE_MODE") == "default" and exports.get("EVAL_CUDA_GRAPH") == "1"
    section = re.search(r'docs/PERFORMANCE\.md, "([^"]+)"', (REPO / config).read_text())
    assert section and f"### {section.group(1)}" in (REPO / "docs" / "PERFORMANCE.md").read_text()


def test_from_config_refuses_flags_that_would_change_the_set_up(bench, capsys) -> None:
    with pytest.raises(SystemExit, match="--from_config takes the set-up from the config: drop --precision"):
        bench.main(["--from_config", str(REPO / GPU_CONFIGS[0]), "--precision", "bf16"])


def test_from_config_names_a_config_the_launcher_refuses(bench, tmp_path: Path) -> None:
    bad = tmp_path / "config_BAD.sh"
    bad.write_text((REPO / GPU_CONFIGS[0]).read_text().replace("export BATCHSIZE=", "export BATCHSIZE=x"))
    with pytest.raises(SystemExit, match=r"run_and_time.sh refused it: .*BATCHSIZE=x.* is not a whole number"):
        bench.config_setup(bad)


# ---------------------------------------------------------------- --config_var: the same step, one thing changed


def test_config_var_sets_the_variable_before_the_launcher_reads_the_config(bench) -> None:
    args = bench.parse_args(["--from_config", str(H200), "--device", "cpu", "--config_var", "PRECISION=bf16",
                             "--config_var", "COMPILE_MODE=none"])
    ctx = bench.build_context(args)
    assert (ctx.precision, ctx.precisions, ctx.compile_mode) == ("bf16", ("bf16",), "none")
    assert ctx.config_vars == (("PRECISION", "bf16"), ("COMPILE_MODE", "none"))
    assert ctx.graphs and ctx.layouts == ("packed",)  # the rest stays the config's
    result = bench.Result("packed", "bf16", "ok", config_vars=dict(ctx.config_vars))
    assert result.name == "packed/bf16 [PRECISION=bf16, COMPILE_MODE=none]"
    assert result.file_stem == "packed_bf16_PRECISION=bf16_COMPILE_MODE=none"


@pytest.mark.parametrize(("given", "message"), [
    ("precision=bf16", "--config_var precision=bf16: give NAME=VALUE with an UPPER_CASE config variable name"),
    ("PRECISION", "--config_var PRECISION: give NAME=VALUE"),
    ("=bf16", "--config_var =bf16: give NAME=VALUE"),
    ("FP8_NO_SUCH_THING=1", "--config_var FP8_NO_SUCH_THING=1: run_and_time.sh does not read FP8_NO_SUCH_THING, so "
                            "it would change nothing"),
    ("DATADIR_PHASE2=/data", "--config_var DATADIR_PHASE2=/data: the benchmark sets DATADIR_PHASE2 itself"),
])
def test_a_bad_config_var_is_refused_with_one_line(bench, given: str, message: str) -> None:
    with pytest.raises(SystemExit) as refused:
        bench.main(["--from_config", str(H200), "--device", "cpu", "--config_var", given])
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)


def test_config_var_without_from_config_is_refused(bench) -> None:
    with pytest.raises(SystemExit, match="--config_var sets a variable of a config: it needs --from_config"):
        bench.build_context(bench.parse_args(["--config", "tiny", "--config_var", "PRECISION=bf16"]))


def test_a_value_the_trainer_refuses_is_its_flag_parsers_one_line(bench, capsys) -> None:
    with pytest.raises(SystemExit) as refused:
        bench.config_setup(H200, {"PRECISION": "fp12"})
    assert refused.value.code == 2
    assert capsys.readouterr().err.startswith("error: argument --precision: invalid choice: 'fp12'")
