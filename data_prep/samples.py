"""Step `samples`: MLCommons text files -> one fixed-length hdf5 file of samples per input file.

Each output is, row for row, what MLCommons create_pretraining_data.py writes for that
input file with the same vocabulary and flags (MLPerf values: max_seq_length 512,
max_predictions_per_seq 76, masked_lm_prob 0.15, short_seq_prob 0.1, dupe_factor 10,
random_seed 12345): the same tokens (vocab.LineEncoder), the same instances drawn from the
same `random.Random(seed)`, seeded afresh for every file whatever its name, and the same
final shuffle (instances.py). A file's instances are held as spans and masks (~0.5 KB
each) and written in blocks of padded rows.

Files are spread over a process pool; each finished file is renamed into place and recorded
in the output directory's MANIFEST.json, so an interrupted run resumes with the missing
files, and the outputs do not depend on the number of workers.
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

import h5py
import numpy as np
from tqdm import tqdm

from data_prep.fileio import Manifest, content_key, same_content, sha256_file
from mlperf_bert.runtime.files import atomic_path
from data_prep.formats import DataPrepError, refuse_mixed_roles
from mlperf_bert.data.shards import ArrayAppender
from data_prep.instances import IS_RANDOM, InstanceParams, fixed_rows, make_instances
from data_prep.parallel import run_jobs
from data_prep.text import TokenizedText, tokenize_file
from data_prep.vocab import LineEncoder, Vocab, load_vocab

log = logging.getLogger(__name__)

BLOCK_ROWS = 4096  # padded rows written together (~6 MB of arrays at 512 tokens)


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


def output_name(text_path: Path) -> str:
    return f"{text_path.stem}.hdf5"


def instance_params(vocab: Vocab, params: SampleParams) -> InstanceParams:
    return InstanceParams(params.max_seq_length, params.max_predictions, params.masked_lm_prob, params.short_seq_prob,
                          params.dupe_factor, vocab.size, vocab.cls_id, vocab.sep_id, vocab.mask_id)


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
    params = instance_params(vocab, job.params)
    instances = make_instances(text, params, random.Random(job.params.seed))
    with atomic_path(job.output_path) as temp, h5py.File(temp, "w") as handle:
        appender = ArrayAppender(handle, job.params.compression)
        for start in range(0, len(instances), BLOCK_ROWS):
            appender.append(fixed_rows(text.tokens, instances, slice(start, start + BLOCK_ROWS), params))
    stats.samples = len(instances)
    stats.tokens = int(instances.lengths.sum())
    stats.predictions = int(instances.num_predictions.sum())
    stats.random_next = int(instances.spans[:, IS_RANDOM].sum())


def create_file_samples(job: SampleJob) -> FileStats:
    """Makes the samples of one text file (runs in a pool worker)."""
    vocab = load_vocab(job.vocab_path)
    text = tokenize_file(job.text_path, LineEncoder(vocab), job.params.encoding_errors)
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
    text = tokenize_file(text_path, LineEncoder(load_vocab(vocab_path)), encoding_errors)
    return frozenset(text.document_keys())


def _one_tokenizer_thread() -> None:
    # The pool, not the tokenizer, decides how many cores work.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def sample_params_record(params: SampleParams, vocab_path: Path, exclude_path: Path | None) -> dict:
    """What the manifest stores as the parameters of a samples directory."""
    record = asdict(params)
    record["order"] = "mlcommons"  # rows are the reference's rows in its order
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
    refuse_mixed_roles(sorted({*manifest.files, *map(output_name, text_paths)}), f"--text (with what {out_dir} holds)")
    todo = [p for p in text_paths if not manifest.is_done(output_name(p), source=p)]
    log.info("samples: %d of %d text files to do in %s (%d already done)", len(todo), len(text_paths), out_dir,
             len(text_paths) - len(todo))
    source_keys = {output_name(p): content_key(p) for p in todo}  # before reading: an edit meanwhile shows next time
    edited = [p.name for p in todo if output_name(p) in manifest.files and
              not same_content(source_keys[output_name(p)], manifest.files[output_name(p)].get("source"))]
    if edited:
        log.warning("samples: %d text files changed since their samples were made, making them again: %s",
                    len(edited), ", ".join(edited))
    if not todo:
        return manifest
    excluded = document_keys(exclude_path, vocab_path, params.encoding_errors) if exclude_path else frozenset()
    jobs = [SampleJob(p, out_dir / output_name(p), vocab_path, params, excluded) for p in todo]
    with tqdm(total=sum(p.stat().st_size for p in todo), unit="B", unit_scale=True, desc="samples") as bar:
        for stats in run_jobs(create_file_samples, jobs, workers, _one_tokenizer_thread):
            extra = {k: v for k, v in asdict(stats).items() if k not in ("name", "sha256", "samples")}
            manifest.record(stats.name, stats.samples, "fixed", sha256=stats.sha256, source=source_keys[stats.name],
                            **extra)
            log.info("samples: %s: %d documents (%d excluded), %d samples", stats.name, stats.documents,
                     stats.excluded_documents, stats.samples)
            if stats.excluded_documents:
                log.warning("samples: %s: %d documents dropped by --exclude_text; this file's samples are no longer "
                            "the MLCommons reference's", stats.name, stats.excluded_documents)
            bar.update(stats.text_bytes)
    return manifest
