"""`prepare.py all` resumes on the content of its inputs, not their names: a text part edited in
place (same name, same size, same flags) makes every output that depends on it again, and the
result equals a fresh run on the edited text; a touched but unchanged part makes nothing again."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from data_prep.corpus import write_corpus
from data_prep.prepare import main as prepare

MAX_LEN, MAX_PRED = 64, 10


def _all(text: Path, vocab: Path, out: Path) -> None:
    code = prepare(["--quiet", "all", "--text_dir", str(text), "--vocab", str(vocab), "--out", str(out),
                    "--dupe_factor", "2", "--max_seq_length", str(MAX_LEN), "--max_predictions", str(MAX_PRED),
                    "--num_shards", "2", "--num_eval_samples", "20", "--workers", "1", "--skip_stratify"])
    assert code == 0


def _outputs(out: Path) -> dict[str, tuple[bytes, int]]:
    """Every hdf5 output: its bytes and mtime."""
    return {str(p.relative_to(out)): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(out.rglob("*.hdf5"))}


def _edit_in_place(part: Path) -> None:
    """Two different letters swapped: same name, same size, other samples."""
    text = part.read_text()
    i = next(i for i in range(len(text) - 1) if text[i].isalpha() and text[i + 1].isalpha() and text[i] != text[i + 1])
    part.write_text(text[:i] + text[i + 1] + text[i] + text[i + 2:])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("text"), num_parts=2, documents_per_part=25, eval_documents=15,
                        vocab_size=400)


def test_an_edited_text_part_makes_its_outputs_again(corpus, tmp_path):
    out = tmp_path / "data"
    _all(corpus.parts[0].parent, corpus.vocab, out)
    before = _outputs(out)
    size = corpus.parts[1].stat().st_size
    _edit_in_place(corpus.parts[1])
    assert corpus.parts[1].stat().st_size == size
    _all(corpus.parts[0].parent, corpus.vocab, out)
    after = _outputs(out)
    fresh = tmp_path / "fresh"
    _all(corpus.parts[0].parent, corpus.vocab, fresh)
    assert {k: v[0] for k, v in after.items()} == {k: v[0] for k, v in _outputs(fresh).items()}
    changed = {k for k in before if before[k][0] != after[k][0]}
    assert f"parts/{corpus.parts[1].name}.hdf5" in changed and any(k.startswith("hdf5_2_shards") for k in changed)
    assert after[f"parts/{corpus.parts[0].name}.hdf5"] == before[f"parts/{corpus.parts[0].name}.hdf5"]  # not redone


def test_a_touched_but_unchanged_part_makes_nothing_again(corpus, tmp_path):
    out = tmp_path / "data"
    _all(corpus.parts[0].parent, corpus.vocab, out)
    before = _outputs(out)
    stat = corpus.parts[0].stat()
    os.utime(corpus.parts[0], ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    _all(corpus.parts[0].parent, corpus.vocab, out)
    assert _outputs(out) == before
