"""Writes a small MLPerf-format BERT dataset that a tiny BERT learns in minutes on a CPU.

Output (DIR = --output_dir):
  DIR/train/part_00000_of_0000K.hdf5 ...  K training shards, sizes differ by at most one
  DIR/eval/part_eval_<M>.hdf5              the eval set (part_eval_10k.hdf5 for 10,000)
  DIR/bert_config.json                     a tiny BERT (Google BERT config keys only)
  DIR/vocab.txt                            one token per line, line i = token id i
  DIR/demo_data.json                       how the data was made, incl. the special token ids

Vocabulary: [PAD]=0, [unused0] .. [unused{U-1}], [UNK], [CLS], [SEP], [MASK], then the content
tokens tok_0 .. up to --vocab_size ids in all (U = --num_unused).

The rule that makes the data learnable: a random permutation of the content tokens, fixed by
the seed, made of cycles of --cycle_length tokens. A sentence is a walk along one cycle, so
every token is the successor of the token before it (token[i+1] = perm[token[i]]). Sentence
A starts at the first token of a random cycle; B of a "next" pair (next_sentence_label 0)
continues A's walk, a random B (label 1) walks another cycle from its first token. A masked
token can therefore be read off either visible neighbour, and also off (the cycle, seen in
any visible token, and the position); the NSP label is read off B's cycle. With cycles of 8
a BERT of 2 layers x 128 reaches 0.70 masked-LM accuracy in about 150 steps of 32 sequences
(AdamW, learning rate 2e-3, 50 warmup steps).

Sequence lengths follow the Wikipedia phase-2 histogram scaled to --max_seq_length; masking
follows the MLPerf data creation (15% of the content tokens, at most
--max_predictions_per_seq, 80% [MASK] / 10% random content token / 10% unchanged, positions
sorted). The same --seed gives the same files.

Every file is written under a temporary name and renamed, so an interrupted run leaves no
half-written shard behind.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mlperf_bert.data.integrity import leaked, sequence_hashes
from mlperf_bert.data.shards import Samples, write_samples
from mlperf_bert.runtime.files import atomic_path
from data_prep import verify_dataset

REPO = Path(__file__).resolve().parents[1]
DEFAULT_HISTOGRAM = REPO / "pytorch" / "mlperf_bert" / "data" / "wikipedia_phase2_seqlen_histogram.json"
NUM_SPECIAL_AFTER_UNUSED = 4  # [UNK] [CLS] [SEP] [MASK]


def eval_file_name(num_eval: int) -> str:
    """The benchmark's naming, as data_prep/eval_set.py uses it: part_eval_10k.hdf5 or part_eval_<n>.hdf5."""
    return "part_eval_10k.hdf5" if num_eval == 10_000 else f"part_eval_{num_eval}.hdf5"


@dataclass(frozen=True)
class Vocab:
    """Token id layout; content tokens are the ids [first_content, size)."""

    size: int
    num_unused: int

    pad: int = 0

    @property
    def unk(self) -> int:
        return 1 + self.num_unused

    @property
    def cls(self) -> int:
        return self.unk + 1

    @property
    def sep(self) -> int:
        return self.unk + 2

    @property
    def mask(self) -> int:
        return self.unk + 3

    @property
    def first_content(self) -> int:
        return self.unk + NUM_SPECIAL_AFTER_UNUSED

    @property
    def num_content(self) -> int:
        return self.size - self.first_content

    def tokens(self) -> list[str]:
        unused = [f"[unused{i}]" for i in range(self.num_unused)]
        content = [f"tok_{i}" for i in range(self.num_content)]
        return ["[PAD]", *unused, "[UNK]", "[CLS]", "[SEP]", "[MASK]", *content]

    def special_ids(self) -> dict[str, int]:
        return {"[PAD]": self.pad, "[UNK]": self.unk, "[CLS]": self.cls, "[SEP]": self.sep, "[MASK]": self.mask}


@dataclass(frozen=True)
class DemoSample:
    """One sequence [CLS] A [SEP] B [SEP], trimmed; positions index into input_ids."""

    input_ids: np.ndarray  # [n]
    segment_ids: np.ndarray  # [n]
    masked_lm_positions: np.ndarray  # [k], sorted
    masked_lm_ids: np.ndarray  # [k]
    next_sentence_label: int  # 1 = B is random, 0 = B continues A


@dataclass(frozen=True)
class Generator:
    """Everything that decides a sample besides the random stream that draws it."""

    vocab: Vocab
    cycles: tuple[np.ndarray, ...]  # the successor rule: cycle[i + 1] follows cycle[i], wrapping
    lengths: np.ndarray  # possible sequence lengths
    length_probs: np.ndarray  # their probabilities
    max_predictions: int
    masked_lm_prob: float

    def walk(self, cycle: int, offset: int, count: int) -> np.ndarray:
        """`count` tokens of cycle `cycle`, starting `offset` tokens after its first token."""
        tokens = self.cycles[cycle]
        return tokens[(offset + np.arange(count)) % tokens.shape[0]]


def make_cycles(order: np.ndarray, cycle_length: int) -> tuple[np.ndarray, ...]:
    """Cuts `order` into runs of `cycle_length` tokens; the last run also takes the remainder."""
    count = order.shape[0] // cycle_length
    bounds = [i * cycle_length for i in range(count)] + [order.shape[0]]
    return tuple(order[a:b] for a, b in zip(bounds[:-1], bounds[1:]))


def read_histogram(path: Path) -> tuple[np.ndarray, int]:
    """A --histogram file's counts (sequences per length 1..L) and L; ValueError naming the file otherwise."""
    try:
        data = json.loads(path.read_text())
        counts = np.asarray(data["counts"], dtype=np.float64)
        longest = int(data["max_seq_length"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"--histogram {path}: not a length histogram ({type(err).__name__}: {err}); give a JSON "
                         "object {\"max_seq_length\": L, \"counts\": [sequences of length 1, ..., L]}") from err
    if counts.ndim != 1 or not counts.size or longest < 1 or counts.min() < 0 or counts.sum() <= 0:
        raise ValueError(f"--histogram {path}: counts must be a non-empty list of non-negative numbers, max_seq_length "
                         ">= 1")
    return counts, longest


def scaled_length_distribution(
    histogram: Path, max_seq_length: int, min_seq_length: int
) -> tuple[np.ndarray, np.ndarray]:
    """Maps every histogram length l to floor(l * max / hist_max + 0.5), clipped to [min, max].

    Returns (lengths, probabilities) over min..max.
    """
    counts, longest = read_histogram(histogram)
    source_lengths = np.arange(1, counts.shape[0] + 1)
    scaled = np.floor(source_lengths * max_seq_length / longest + 0.5).astype(np.int64)
    scaled = np.clip(scaled, min_seq_length, max_seq_length)
    lengths = np.arange(min_seq_length, max_seq_length + 1)
    mass = np.bincount(scaled - min_seq_length, weights=counts, minlength=lengths.shape[0])
    return lengths, mass / mass.sum()


def mask_tokens(
    rng: np.random.Generator, tokens: np.ndarray, candidates: np.ndarray, gen: Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MLPerf masking of `tokens` [n] at some of `candidates`; returns (inputs, positions, labels)."""
    count = min(gen.max_predictions, max(1, int(round(candidates.shape[0] * gen.masked_lm_prob))))
    positions = np.sort(rng.choice(candidates, size=count, replace=False))
    labels = tokens[positions].copy()
    inputs = tokens.copy()
    draw = rng.random(count)
    random_tokens = rng.integers(gen.vocab.first_content, gen.vocab.size, size=count)
    inputs[positions] = np.where(draw < 0.8, gen.vocab.mask, np.where(draw < 0.9, labels, random_tokens))
    return inputs, positions, labels


def make_sample(rng: np.random.Generator, gen: Generator) -> DemoSample:
    """One [CLS] A [SEP] B [SEP] sequence whose length is drawn from the scaled histogram."""
    n = int(rng.choice(gen.lengths, p=gen.length_probs))
    len_a = int(rng.integers(1, n - 3))  # A and B both get at least one token
    len_b = n - 3 - len_a
    num_cycles = len(gen.cycles)
    cycle_a = int(rng.integers(num_cycles))
    tokens_a = gen.walk(cycle_a, 0, len_a)
    is_random = bool(rng.random() < 0.5)
    if is_random:  # B walks another cycle from its start ...
        tokens_b = gen.walk((cycle_a + int(rng.integers(1, num_cycles))) % num_cycles, 0, len_b)
    else:  # ... or continues A's walk
        tokens_b = gen.walk(cycle_a, len_a, len_b)
    v = gen.vocab
    tokens = np.concatenate([[v.cls], tokens_a, [v.sep], tokens_b, [v.sep]])
    segments = np.concatenate([np.zeros(len_a + 2, np.int64), np.ones(len_b + 1, np.int64)])
    candidates = np.concatenate([np.arange(1, 1 + len_a), np.arange(len_a + 2, n - 1)])
    inputs, positions, labels = mask_tokens(rng, tokens, candidates, gen)
    return DemoSample(inputs, segments, positions, labels, int(is_random))


def to_samples(samples: list[DemoSample]) -> Samples:
    """The demo's sequences as the flat vectors every shard writer takes."""
    def joined(key: str, dtype: type) -> np.ndarray:
        return np.concatenate([getattr(s, key) for s in samples]).astype(dtype)

    return Samples(
        input_ids=joined("input_ids", np.int32), segment_ids=joined("segment_ids", np.int8),
        lengths=np.array([s.input_ids.shape[0] for s in samples], np.int64),
        masked_lm_positions=joined("masked_lm_positions", np.int32), masked_lm_ids=joined("masked_lm_ids", np.int32),
        num_predictions=np.array([s.masked_lm_positions.shape[0] for s in samples], np.int64),
        next_sentence_labels=np.array([s.next_sentence_label for s in samples], np.int8),
    )


def write_text(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def bert_config(args: argparse.Namespace) -> dict[str, object]:
    return {
        "attention_probs_dropout_prob": args.dropout_prob,
        "hidden_act": "gelu",
        "hidden_dropout_prob": args.dropout_prob,
        "hidden_size": args.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": args.intermediate_size,
        "max_position_embeddings": args.max_position_embeddings or args.max_seq_length,
        "num_attention_heads": args.num_attention_heads,
        "num_hidden_layers": args.num_hidden_layers,
        "type_vocab_size": 2,
        "vocab_size": args.vocab_size,
    }


def shard_sizes(total: int, num_shards: int) -> list[int]:
    return [total // num_shards + (i < total % num_shards) for i in range(num_shards)]


def build_generator(args: argparse.Namespace, rng: np.random.Generator) -> Generator:
    vocab = Vocab(args.vocab_size, args.num_unused)
    lengths, probs = scaled_length_distribution(args.histogram, args.max_seq_length, args.min_seq_length)
    cycles = make_cycles(rng.permutation(np.arange(vocab.first_content, vocab.size)), args.cycle_length)
    return Generator(vocab, cycles, lengths, probs, args.max_predictions_per_seq, args.masked_lm_prob)


def planned_files(args: argparse.Namespace) -> dict[Path, int]:
    """Every shard this run writes, with its number of samples, in generation order."""
    train = args.output_dir / "train"
    sizes = shard_sizes(args.num_train, args.num_shards)
    names = {train / f"part_{i:05d}_of_{args.num_shards:05d}.hdf5": n for i, n in enumerate(sizes)}
    return names | {args.output_dir / "eval" / eval_file_name(args.num_eval): args.num_eval}


def refuse_foreign_shards(files: dict[Path, int]) -> None:
    """Old shards left in train/ or eval/ would be read together with the new ones."""
    for folder in {p.parent for p in files}:
        present = folder.iterdir() if folder.is_dir() else []
        foreign = sorted(p.name for p in present if p.suffix in (".hdf5", ".h5") and p not in files)
        if foreign:
            sys.exit(f"{folder}: holds shards this run does not write ({', '.join(foreign[:3])}); "
                     "remove them or choose another --output_dir")


def manifest(args: argparse.Namespace, vocab: Vocab, files: dict[Path, int]) -> dict[str, object]:
    return {
        "format": args.format, "seed": args.seed, "num_train": args.num_train, "num_eval": args.num_eval,
        "max_seq_length": args.max_seq_length, "max_predictions_per_seq": args.max_predictions_per_seq,
        "masked_lm_prob": args.masked_lm_prob, "vocab_size": vocab.size, "special_tokens": vocab.special_ids(),
        "first_content_token": vocab.first_content, "histogram": args.histogram.name,
        "files": {str(p.relative_to(args.output_dir)): n for p, n in files.items()},
        "cycle_length": args.cycle_length,
        "rule": "content tokens form random cycles; A walks one from its start; a 'next' B continues the walk, "
                "a random B walks another cycle from its start",
    }


def held_out_samples(rng: np.random.Generator, gen: Generator, count: int, training: np.ndarray) -> Samples:
    """`count` eval samples, none equal to a training sample (`training`: their sorted hashes).

    The demo's rule makes short sequences repeat, so a drawn eval sample can equal a training
    one; it is drawn again, as the test set must be held out (data/integrity.py refuses leaks).
    """
    kept: list[DemoSample] = []
    while len(kept) < count:
        drawn = [make_sample(rng, gen) for _ in range(count - len(kept))]
        fresh = ~leaked(sequence_hashes(to_samples(drawn)), training)
        kept += [sample for sample, ok in zip(drawn, fresh) if ok]
    return to_samples(kept)


def generate(args: argparse.Namespace) -> None:
    chain_seed, train_seed, eval_seed = np.random.SeedSequence(args.seed).spawn(3)
    gen = build_generator(args, np.random.default_rng(chain_seed))
    files = planned_files(args)
    refuse_foreign_shards(files)
    streams = {"train": np.random.default_rng(train_seed), "eval": np.random.default_rng(eval_seed)}
    training: list[np.ndarray] = []  # the training samples' hashes, written first
    for path, count in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        rng = streams[path.parent.name]
        if path.parent.name == "train":
            samples = to_samples([make_sample(rng, gen) for _ in range(count)])
            training.append(sequence_hashes(samples))
        else:
            samples = held_out_samples(rng, gen, count, np.unique(np.concatenate(training)))
        write_samples(path, samples, args.format, args.max_seq_length, args.max_predictions_per_seq)
    out = args.output_dir
    write_text(out / "bert_config.json", json.dumps(bert_config(args), indent=2, sort_keys=True) + "\n")
    write_text(out / "vocab.txt", "\n".join(gen.vocab.tokens()) + "\n")
    write_text(out / "demo_data.json", json.dumps(manifest(args, gen.vocab, files), indent=2) + "\n")
    verify(args, gen.vocab.size)


def verify(args: argparse.Namespace, vocab_size: int) -> None:
    """The full verification of both folders, as for real data: it writes the verification records
    a run reads before its clock starts (mlperf_bert/data/record.py)."""
    train, evals = args.output_dir / "train", args.output_dir / "eval"
    code = verify_dataset.main([str(train), str(evals), "--eval_dir", str(evals), "--vocab_size", str(vocab_size),
                                "--max_seq_length", str(args.max_seq_length),
                                "--max_predictions", str(args.max_predictions_per_seq), "--workers", "1"])
    if code != 0:
        sys.exit(f"{args.output_dir}: the demo data failed its verification (the lines above); this is a bug")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output_dir", type=Path, required=True)
    p.add_argument("--num_train", type=int, default=20_000, help="training sequences")
    p.add_argument("--num_eval", type=int, default=1_000, help="eval sequences")
    p.add_argument("--num_shards", type=int, default=4, help="training shards")
    p.add_argument("--max_seq_length", type=int, default=128)
    p.add_argument("--max_predictions_per_seq", type=int, default=20)
    p.add_argument("--min_seq_length", type=int, default=8, help="shorter scaled lengths are raised to this")
    p.add_argument("--masked_lm_prob", type=float, default=0.15)
    p.add_argument("--vocab_size", type=int, default=512)
    p.add_argument("--num_unused", type=int, default=4, help="[unusedN] tokens between [PAD] and [UNK]")
    p.add_argument("--cycle_length", type=int, default=8, help="content tokens per cycle of the successor rule")
    p.add_argument("--seed", type=int, default=12345)
    p.add_argument("--format", choices=("fixed", "varlength"), default="fixed")
    p.add_argument("--histogram", type=Path, default=DEFAULT_HISTOGRAM, help="sequence-length histogram json")
    model = p.add_argument_group("bert_config.json")
    model.add_argument("--hidden_size", type=int, default=128)
    model.add_argument("--num_hidden_layers", type=int, default=2)
    model.add_argument("--num_attention_heads", type=int, default=2)
    model.add_argument("--intermediate_size", type=int, default=512)
    model.add_argument("--max_position_embeddings", type=int, default=0, help="0: --max_seq_length")
    model.add_argument("--dropout_prob", type=float, default=0.1, help="hidden and attention dropout")
    args = p.parse_args(argv)
    problem = check_args(args)
    if problem:
        p.error(problem)
    return args


def _histogram_problem(path: Path) -> str | None:
    try:
        read_histogram(path)
    except ValueError as err:
        return str(err)
    return None


def check_args(args: argparse.Namespace) -> str:
    """The first flag problem, or '' when the flags are consistent."""
    first_content = 1 + args.num_unused + NUM_SPECIAL_AFTER_UNUSED
    rules = [
        (args.num_shards >= 1 and args.num_train >= args.num_shards, "--num_train must be >= --num_shards >= 1"),
        (args.num_eval >= 1, "--num_eval must be >= 1"),
        (5 <= args.min_seq_length <= args.max_seq_length,
         "need 5 <= --min_seq_length <= --max_seq_length ([CLS] A [SEP] B [SEP])"),
        (args.max_predictions_per_seq >= 1, "--max_predictions_per_seq must be >= 1"),
        (0.0 < args.masked_lm_prob < 1.0, "--masked_lm_prob must lie in (0, 1)"),
        (args.num_unused >= 0, "--num_unused must be >= 0"),
        (args.cycle_length >= 2, "--cycle_length must be >= 2"),
        (args.vocab_size >= first_content + 2 * args.cycle_length,
         f"--vocab_size must be >= {first_content + 2 * args.cycle_length}: "
         "the specials plus two cycles of --cycle_length"),
        (args.histogram.is_file(), f"--histogram {args.histogram} does not exist"),
        (not args.histogram.is_file() or _histogram_problem(args.histogram) is None,
         _histogram_problem(args.histogram) or ""),
        (args.hidden_size % args.num_attention_heads == 0, "--hidden_size must be a multiple of --num_attention_heads"),
        (args.max_position_embeddings == 0 or args.max_position_embeddings >= args.max_seq_length,
         "--max_position_embeddings must be >= --max_seq_length"),
    ]
    return next((message for ok, message in rules if not ok), "")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    generate(args)
    print(f"wrote {args.num_train} training sequences in {args.num_shards} shards "
          f"and {args.num_eval} eval sequences to {args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
