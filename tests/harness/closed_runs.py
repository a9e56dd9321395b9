"""A closed-division run on the session's demo data: the inputs that keep the rules, and the checks its MLPerf
log must pass (the closed-division tests refuse each broken rule; the clock tests run it audited)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.harness.commands import run_cli
from tests.harness.demo import trainer_args, verify_folder
from tests.harness.launches import mllog_events


def closed_run_inputs(demo_data: Path, tmp_path: Path) -> list[str]:
    """Demo data made closed-compliant: 10,000 eval samples (the demo's, repeated), a 24-layer
    tiny BERT with 512 positions and its saved initial weights as the init checkpoint."""
    import torch

    from mlperf_bert.data.shards import Samples, list_shards, read_samples, write_samples
    from mlperf_bert.model.bert import BertConfig, BertForPreTraining

    bert = json.loads((demo_data / "bert_config.json").read_text())
    bert.update(num_hidden_layers=24, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                max_position_embeddings=512)
    (tmp_path / "bert_config.json").write_text(json.dumps(bert))
    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig.from_json(str(tmp_path / "bert_config.json")))
    torch.save({"model": model.state_dict()}, tmp_path / "phase1.pt")
    demo_eval = read_samples(list_shards(demo_data / "eval")[0])
    (tmp_path / "eval").mkdir()
    tiled = Samples.concat([demo_eval] * (10_000 // len(demo_eval)))
    write_samples(tmp_path / "eval" / "part_eval_10k.hdf5", tiled, "fixed", 64, 10)
    verify_folder(tmp_path / "eval", "--max_seq_length", "64", "--max_predictions", "10")
    args = trainer_args(demo_data, tmp_path / "out", "--do_train", "--max_steps", "2", "--train_batch_size", "8")
    replace = {"--eval_dir": str(tmp_path / "eval"), "--bert_config_path": str(tmp_path / "bert_config.json"),
               "--max_seq_length": "512", "--max_predictions_per_seq": "76", "--num_eval_examples": "10000",
               "--submission_division": "closed"}
    for flag, value in replace.items():
        args[args.index(flag) + 1] = value
    at = args.index("--eval_iter_samples")
    return args[:at] + args[at + 2:] + ["--init_checkpoint", str(tmp_path / "phase1.pt"), "--eval_batch_size", "500"]


def check_closed_log(log: Path, scratch: Path) -> None:
    """The MLPerf log of a closed run on closed_run_inputs: it logs the rules it kept, and passes the same
    table and the official checker (all but the accuracy target, out of a tiny model's reach). The run is
    the clock tests' audited closed run, which also shows it read no data before run_start."""
    from mlperf_tools.results.package_results import closed_rule_problems

    values = {e["key"]: e["value"] for e in mllog_events(log)}
    assert (values["eval_samples"], values["eval_iter_samples"], values["eval_iter_start_samples"]) == (
        10_000, 150_000, 150_000)
    assert values["submission_division"] == "closed" and values["init_checkpoint"].endswith("phase1.pt")
    assert closed_rule_problems(log) == ([], [])
    names = [e["metadata"]["tensor"] for e in mllog_events(log) if e["key"] == "weights_initialization"]
    assert len(names) == 398
    # The official checker: everything but the accuracy target (a tiny model in 2 steps) passes.
    checked = run_cli([sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage", "training",
                       "--ruleset", "5.0.0", "--log_output", str(scratch / "checker.log"), str(log)])
    report = checked.stdout + checked.stderr
    failed = [line for line in report.splitlines() if "Failed checks" in line or "ERROR" in line]
    assert failed and all("eval_accuracy" in line or line.strip().endswith("FAILED") for line in failed), report
