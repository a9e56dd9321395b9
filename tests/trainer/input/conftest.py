"""The input tests' shared fixtures: shards of workers/balance.py's data, stratified."""

from __future__ import annotations

from pathlib import Path

import pytest

from data_prep.stratify import StratifyParams, stratify
from mlperf_bert.data.shards import list_shards
from tests.harness.workers.balance import BOUNDS, MAX_LEN, MAX_PRED


@pytest.fixture(scope="module")
def stratified(plain, tmp_path_factory) -> Path:
    """The strata of the requesting module's `plain` shards (test_sources', test_resume_world_size's)."""
    out = tmp_path_factory.mktemp("stratified") / "data"
    stratify(list_shards(plain), out, StratifyParams(bounds=BOUNDS, shards_per_stratum=2, max_seq_length=MAX_LEN,
                                                      max_predictions=MAX_PRED))
    return out
