"""The stratify step's length bounds scale with --max_seq_length, so short datasets stratify too."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from mlperf_bert.data.stratified import stratum_shares
from mlperf_bert.data.lengths import load_length_histogram
from tests.harness.commands import run_cli


def test_default_bounds_are_the_quarters_of_max_seq_length(demo_data, tmp_path):
    out = tmp_path / "strat"
    done = run_cli([sys.executable, "data_prep/prepare.py", "--quiet", "stratify", "--input", str(demo_data / "train"),
                    "--out", str(out), "--max_seq_length", "64", "--max_predictions", "10", "--workers", "1"])
    assert done.returncode == 0, done.stderr[-2000:]
    strata = json.loads((out / "strata.json").read_text())
    assert strata["bounds"] == [16, 32, 48, 64]
    assert sum(strata["counts"]) == 2000
    # The demo's lengths follow the Wikipedia histogram scaled to 64 tokens, so the strata
    # hold about the Wikipedia shares (36.9 / 19.7 / 11.7 / 31.6 %).
    wikipedia = stratum_shares(load_length_histogram())
    assert np.allclose(strata["shares"], wikipedia, atol=0.04)


@pytest.mark.parametrize("bounds, message", [("10,20", "end at --max_seq_length"), ("a,64", "integers")])
def test_bad_bounds_are_rejected(demo_data, tmp_path, bounds, message):
    done = run_cli([sys.executable, "data_prep/prepare.py", "--quiet", "stratify", "--input", str(demo_data / "train"),
                    "--out", str(tmp_path / "s"), "--max_seq_length", "64", "--strata_bounds", bounds])
    assert done.returncode != 0 and message in done.stderr
