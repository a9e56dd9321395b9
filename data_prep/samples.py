"""Step `samples`: MLCommons text files -> one fixed-length hdf5 file of samples per input file.

Per input file (create_pretraining_data.py's parameters: max_seq_length 512,
max_predictions_per_seq 76, masked_lm_prob 0.15, short_seq_prob 0.1, dupe_factor 10, seed
12345): tokenise (text.py), shuffle the documents, then dupe_factor times make the pairs of
every document (pairs.py) and mask them (masking.py), block by block, appending each block
to the output. The reference shuffles all of a file's instances in memory at the end;
here a file's samples are written in (round, shuffled document) order and the `reshard`
step shuffles across all files, which keeps memory bounded by one block.

Randomness is per input file, seeded from (seed, file index), so the outputs are the same
whatever the number of workers, and one part can be regenerated alone. Files are spread
over a process pool; each finished file is renamed into place and recorded in the output
directory's MANIFEST.json, so an interrupted run resumes with the missing files.
"""

from __future__ import annotations

import logging
import os
import random
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import h5py
import numpy as np
from tqdm import tqdm

from data_prep.fileio import Manifest, atomic_output, sha256_file
from data_prep.formats import DataPrepError, text_part_index
from mlperf_bert.shards import ArrayAppender
from data_prep.masking import MaskParams, assemble, mask_samples
from data_prep.parallel import run_jobs
from data_prep.pairs import A_END, A_START, IS_RANDOM, PairMaker, PairParams, truncate_pairs
from mlperf_bert.shards import to_fixed
from data_prep.text import TokenizedText, tokenize_file
from data_prep.vocab import LineEncoder, Vocab, load_vocab, make_tokenizer

log = logging.getLogger(__name__)

BLOCK_ROWS = 4096  # sequences masked and written together (<= 2M tokens, ~12 MB of arrays)
_NAMED_FILE_KEY = 1 << 32  # seed keys of files not named part-XXXXX-of-YYYYY start here


@dataclass(frozen=True)
class SampleParams:
    """create_pretraining_data.py's parameters, MLPerf values."""

    max_seq_length: int = 512
    max_predictions: int = 76
    masked_lm_prob: float = 0.15
    short_seq_prob: float = 0.1
    dupe_factor: int = 10
    seed: int = 12345
    encoding_errors: str = "strict"  # how undecodable bytes are treated: strict, replace, ignore
    compression: str | None = None  # hdf5 filter of the outputs: None, "gzip" or "lzf"

    def __post_init__(self) -> None:
        if self.max_seq_length < 5:
            raise DataPrepError(f"--max_seq_length {self.max_seq_length}: a pair needs at least 5 tokens")
        if not 0.0 < self.masked_lm_prob < 1.0:
            raise DataPrepError(f"--masked_lm_prob {self.masked_lm_prob} must lie in (0, 1)")
        if self.dupe_factor < 1 or self.max_predictions < 1:
            raise DataPrepError("--dupe_factor and --max_predictions must be at least 1")
        if self.encoding_errors not in ("strict", "replace", "ignore"):
            raise DataPrepError(f"--encoding_errors {self.encoding_errors!r}: choose strict, replace or ignore")


@dataclass(frozen=True)
class SampleJob:
    """One input text file and where its samples go."""

    text_path: Path
    output_path: Path
    vocab_path: Path
    params: SampleParams
    excluded_documents: frozenset[bytes] = field(default_factory=frozenset)


@dataclass
class FileStats:
    """What one text file gave; recorded in the manifest next to the output's checksum."""

    name: str = ""
    sha256: str = ""
    text_bytes: int = 0
    documents: int = 0
    excluded_documents: int = 0
    sentences: int = 0
    text_tokens: int = 0
    samples: int = 0
    tokens: int = 0
    predictions: int = 0
    random_next: int = 0


def file_seed_key(name: str) -> int:
    """The file index for seeding: 42 for part-00042-of-00500, a stable hash for other names."""
    index = text_part_index(name)
    return index if index is not None else _NAMED_FILE_KEY + zlib.crc32(name.encode())


def file_rngs(seed: int, name: str) -> tuple[random.Random, np.random.Generator]:
    """(pair rng, masking rng) of one input file, from the global seed and the file index."""
    pair_seq, mask_seq = np.random.SeedSequence([seed, file_seed_key(name)]).spawn(2)
    return random.Random(int(pair_seq.generate_state(1, np.uint64)[0])), np.random.default_rng(mask_seq)


def output_name(text_path: Path) -> str:
    return f"{text_path.stem}.hdf5"


def _span_blocks(maker: PairMaker, doc_order: list[int], dupe_factor: int) -> Iterator[np.ndarray]:
    """[<=BLOCK_ROWS, 5] span tables covering dupe_factor passes over the documents."""
    pending: list[int] = []
    for _ in range(dupe_factor):
        for doc in doc_order:
            maker.document(doc, pending)
            while len(pending) >= 5 * BLOCK_ROWS:
                yield np.array(pending[: 5 * BLOCK_ROWS], dtype=np.int64).reshape(-1, 5)
                del pending[: 5 * BLOCK_ROWS]
    if pending:
        yield np.array(pending, dtype=np.int64).reshape(-1, 5)


def _mask_params(vocab: Vocab, params: SampleParams) -> MaskParams:
    return MaskParams(vocab.size, vocab.cls_id, vocab.sep_id, vocab.mask_id, params.masked_lm_prob,
                      params.max_predictions)


def _exclude(text: TokenizedText, excluded: frozenset[bytes]) -> tuple[TokenizedText, int]:
    if not excluded:
        return text, 0
    keep = np.array([key not in excluded for key in text.document_keys()], dtype=bool)
    if keep.all():
        return text, 0
    if not keep.any():
        raise DataPrepError("every document of the file is an excluded (eval) document")
    return text.keep_documents(keep), int((~keep).sum())


def _write_samples(job: SampleJob, text: TokenizedText, vocab: Vocab, stats: FileStats) -> None:
    params = job.params
    pair_rng, mask_rng = file_rngs(params.seed, job.text_path.name)
    doc_order = list(range(text.num_documents))
    pair_rng.shuffle(doc_order)
    maker = PairMaker(text, PairParams(params.max_seq_length, params.short_seq_prob), pair_rng)
    mask_params = _mask_params(vocab, params)
    with atomic_output(job.output_path) as temp, h5py.File(temp, "w") as handle:
        appender = ArrayAppender(handle, params.compression)
        for spans in _span_blocks(maker, doc_order, params.dupe_factor):
            spans = truncate_pairs(spans, params.max_seq_length - 3, mask_rng)
            a_lengths = spans[:, A_END] - spans[:, A_START]
            samples = mask_samples(assemble(text.tokens, spans, mask_params), a_lengths, mask_params, mask_rng)
            appender.append(to_fixed(samples, params.max_seq_length, params.max_predictions))
            stats.samples += len(samples)
            stats.tokens += int(samples.lengths.sum())
            stats.predictions += int(samples.num_predictions.sum())
            stats.random_next += int(spans[:, IS_RANDOM].sum())


def create_file_samples(job: SampleJob) -> FileStats:
    """Makes the samples of one text file (runs in a pool worker)."""
    vocab = load_vocab(job.vocab_path)
    text = tokenize_file(job.text_path, LineEncoder(make_tokenizer(vocab)), job.params.encoding_errors)
    try:
        text, excluded = _exclude(text, job.excluded_documents)
    except DataPrepError as err:
        raise DataPrepError(f"{job.text_path}: {err}; it must not be a copy of the eval text") from err
    stats = FileStats(name=job.output_path.name, text_bytes=job.text_path.stat().st_size,
                      documents=text.num_documents, excluded_documents=excluded,
                      sentences=text.num_sentences, text_tokens=int(text.tokens.shape[0]))
    _write_samples(job, text, vocab, stats)
    stats.sha256 = sha256_file(job.output_path)
    return stats


def document_keys(text_path: Path, vocab_path: Path, encoding_errors: str = "strict") -> frozenset[bytes]:
    """Digests of the documents of a text file (eval.txt), to keep them out of training samples."""
    text = tokenize_file(text_path, LineEncoder(make_tokenizer(load_vocab(vocab_path))), encoding_errors)
    return frozenset(text.document_keys())


def _one_tokenizer_thread() -> None:
    # The pool, not the tokenizer, decides how many cores work.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def sample_params_record(params: SampleParams, vocab_path: Path, exclude_path: Path | None) -> dict:
    """What the manifest stores as the parameters of a samples directory."""
    record = asdict(params)
    record["vocab_sha256"] = sha256_file(vocab_path)
    record["exclude_sha256"] = sha256_file(exclude_path) if exclude_path else None
    return record


def create_samples(
    text_paths: list[Path], out_dir: Path, vocab_path: Path, params: SampleParams, workers: int = 1,
    exclude_path: Path | None = None,
) -> Manifest:
    """Makes (or completes) the per-file samples of `text_paths` in `out_dir`."""
    load_vocab(vocab_path)  # fail early on a bad vocabulary, not inside every worker
    if not text_paths:
        raise DataPrepError("no input text files; point --text at part-XXXXX-of-00500 files or their folder")
    manifest = Manifest.open(out_dir, "samples", sample_params_record(params, vocab_path, exclude_path))
    todo = [p for p in text_paths if not manifest.is_done(output_name(p), source=p)]
    log.info("samples: %d of %d text files to do in %s (%d already done)", len(todo), len(text_paths), out_dir,
             len(text_paths) - len(todo))
    if not todo:
        return manifest
    excluded = document_keys(exclude_path, vocab_path, params.encoding_errors) if exclude_path else frozenset()
    jobs = [SampleJob(p, out_dir / output_name(p), vocab_path, params, excluded) for p in todo]
    text_of = {output_name(p): p for p in todo}
    with tqdm(total=sum(p.stat().st_size for p in todo), unit="B", unit_scale=True, desc="samples") as bar:
        for stats in run_jobs(create_file_samples, jobs, workers, _one_tokenizer_thread):
            extra = {k: v for k, v in asdict(stats).items() if k not in ("name", "sha256", "samples")}
            manifest.record(stats.name, stats.samples, "fixed", sha256=stats.sha256, source=text_of[stats.name],
                            **extra)
            log.info("samples: %s: %d documents (%d excluded), %d samples", stats.name, stats.documents,
                     stats.excluded_documents, stats.samples)
            bar.update(stats.text_bytes)
    return manifest
