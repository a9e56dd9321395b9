"""Text -> data_prep's whole pipeline -> the trainer, in every input layout and on stratified shards."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from conftest import TRAINER, run_cli
from data_prep.corpus import write_corpus

MAX_LEN, MAX_PRED = 64, 10


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pipeline")
    corpus = write_corpus(root / "text", num_parts=2, documents_per_part=40, eval_documents=30, vocab_size=600)
    done = run_cli([sys.executable, "data_prep/prepare.py", "--quiet", "all", "--text_dir", str(root / "text"),
                    "--vocab", str(corpus.vocab), "--out", str(root / "data"), "--dupe_factor", "2",
                    "--max_seq_length", str(MAX_LEN), "--max_predictions", str(MAX_PRED), "--num_shards", "4",
                    "--num_eval_samples", "60", "--workers", "1"])
    assert done.returncode == 0, done.stderr[-3000:]
    stratify_by_quartiles(root / "data")
    vocab_size = len(corpus.vocab.read_text().splitlines())
    (root / "bert_config.json").write_text(json.dumps({
        "vocab_size": vocab_size, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        "intermediate_size": 64, "max_position_embeddings": MAX_LEN, "type_vocab_size": 2,
    }))
    return root


def stratify_by_quartiles(data: Path) -> None:
    """The small corpus's pairs are mostly near max_seq_length, so the default quarter bounds
    leave strata nearly empty; bounds at the length quartiles give four usable strata."""
    lengths = np.concatenate([h5py.File(p, "r")["input_mask"][()].sum(axis=1)
                              for p in sorted(only(data, "hdf5_*_shards_fixed").glob("*.hdf5"))])
    bounds = sorted({int(q) for q in np.quantile(lengths, [0.25, 0.5, 0.75])} - {MAX_LEN}) + [MAX_LEN]
    done = run_cli([sys.executable, "data_prep/prepare.py", "--quiet", "stratify", "--input",
                    str(only(data, "hdf5_*_shards_varlength")), "--out", str(data / "stratified_quartiles"),
                    "--max_seq_length", str(MAX_LEN), "--max_predictions", str(MAX_PRED),
                    "--strata_bounds", ",".join(map(str, bounds))])
    assert done.returncode == 0, done.stderr[-3000:]


def only(root: Path, pattern: str) -> Path:
    found = sorted(root.glob(pattern))
    assert len(found) == 1, (pattern, [p.name for p in root.iterdir()])
    return found[0]


@pytest.mark.slow
@pytest.mark.parametrize("folder, layout", [
    ("hdf5_*_shards_fixed", "padded"),
    ("hdf5_*_shards_varlength", "unpadded"),
    ("packed_*", "packed"),
    ("stratified_quartiles", "unpadded"),
])
def test_trainer_trains_on_every_prepared_folder(prepared, tmp_path, folder, layout):
    data = prepared / "data"
    out = tmp_path / "out"
    result = run_cli([sys.executable, str(TRAINER), "--do_train", "--input_dir", str(only(data, folder)),
                      "--eval_dir", str(only(data, "eval_varlength")), "--bert_config_path",
                      str(prepared / "bert_config.json"), "--output_dir", str(out), "--input_layout", layout,
                      "--max_seq_length", str(MAX_LEN), "--max_predictions_per_seq", str(MAX_PRED),
                      "--num_eval_examples", "60", "--train_batch_size", "4", "--max_steps", "3",
                      "--eval_iter_samples", "100", "--submission_division", "open"])
    assert result.returncode == 0, result.stderr[-3000:]
    log = (out / "mlperf.log").read_text()
    assert '"key": "run_stop"' in log and '"key": "eval_accuracy"' in log
