"""The data preparation command line: `python data_prep/prepare.py STEP ...`.

Steps (each skips the outputs that already exist and still match their MANIFEST.json, so an
interrupted run is resumed by running the same command again):
  check-inputs        downloaded files against the published MLCommons sizes and md5 sums
  samples             text parts -> one fixed hdf5 per part, the reference's rows in its order
  import-tfrecord     the reference's TFRecord files -> the same fixed hdf5 files
  reshard             per-part files -> N balanced shards, fixed and varlength, shuffled
  eval                eval samples -> the 10,000-sample eval set (pick_eval_samples.py's pick)
  pack                shards -> packed shards + packing_report.json
  stratify            shards -> stratum_0..3 shards + strata.json
  verify              check dataset folders (same as data_prep/verify_dataset.py)
  convert-checkpoint  TF1 / PyTorch / HuggingFace checkpoint conversion
  all                 samples (train + eval), eval, reshard, pack, stratify, verify
  vocab               text files -> a WordPiece vocab.txt trained on them
  model-config        a named BERT size (tiny ... large) -> bert_config.json
See data_prep/README.md for a full walk-through.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from data_prep import check_inputs, convert_checkpoint, verify_dataset
from data_prep.eval_set import EvalParams, make_eval_set
from data_prep.fileio import Manifest
from data_prep.formats import MAX_PREDICTIONS, MAX_SEQ_LENGTH, NUM_EVAL_SAMPLES, DataPrepError
from data_prep.model_files import MLPERF_VOCAB_SIZE, MODEL_SIZES, model_config, train_vocab, write_model_config
from data_prep.pack import PackParams, pack_dataset
from data_prep.reshard import ReshardParams, reshard, shard_dir_name
from data_prep.samples import SampleParams, create_samples
from data_prep.samples import output_name as samples_output_name
from mlperf_bert.data.shards import REFUSED_NAME, list_shards
from data_prep.stratify import StratifyParams, stratify
from data_prep.vocab import load_vocab

log = logging.getLogger("data_prep")

EVAL_TEXT = "eval.txt"
TEXT_GLOB = "part-*-of-*"


def text_files(paths: list[Path]) -> list[Path]:
    """Files given directly, plus the part-XXXXX-of-YYYYY files of given folders, sorted."""
    found: list[Path] = []
    for path in paths:
        if path.is_dir():
            found += sorted(p for p in path.glob(TEXT_GLOB) if p.is_file())
        elif path.is_file():
            found.append(path)
        else:
            raise DataPrepError(f"{path}: no such text file or folder (--text)")
    return found


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max_seq_length", type=int, default=MAX_SEQ_LENGTH)
    parser.add_argument("--max_predictions", type=int, default=MAX_PREDICTIONS, help="max_predictions_per_seq")
    parser.add_argument("--seed", type=int, default=12345)
    parser.add_argument("--compression", choices=("gzip", "lzf"), help="hdf5 filter of the outputs (default none)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="processes for samples and reshard (default: all cores)")


def _sample_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vocab", type=Path, required=True, help="vocab.txt of the MLPerf checkpoint")
    parser.add_argument("--dupe_factor", type=int, default=10)
    parser.add_argument("--masked_lm_prob", type=float, default=0.15)
    parser.add_argument("--short_seq_prob", type=float, default=0.1)
    parser.add_argument("--encoding_errors", choices=("strict", "replace", "ignore"), default="strict",
                        help="what to do with bytes that are not UTF-8 (default: stop with an error)")


def _sample_params(args: argparse.Namespace) -> SampleParams:
    return SampleParams(args.max_seq_length, args.max_predictions, args.masked_lm_prob, args.short_seq_prob,
                        args.dupe_factor, args.seed, args.encoding_errors, args.compression)


def cmd_samples(args: argparse.Namespace) -> None:
    create_samples(text_files(args.text), args.out, args.vocab, _sample_params(args), args.workers, args.exclude_text)


def cmd_import_tfrecord(args: argparse.Namespace) -> None:
    sources = []
    for path in args.input:
        if not path.exists():
            raise DataPrepError(f"{path}: no such TFRecord file or folder (--input)")
        sources += sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    # Here, not at the top: crc32c and protobuf are this step's alone, and a machine that only packs or
    # verifies (a GPU machine making tools/gpu_perf.sh's shards) need not have them.
    from data_prep.tfrecords import import_tfrecords

    import_tfrecords(sources, args.out, args.max_seq_length, args.max_predictions, args.compression, args.workers)


def _print_list(title: str, lines: list[str]) -> None:
    if lines:
        print(f"{title} ({len(lines)}):", *lines, sep="\n  ", file=sys.stderr)


def _missing_lines(names: list[str]) -> list[str]:
    """Missing inputs, the part files as one line when there are many."""
    parts = [n for n in names if n.startswith("part-")]
    if len(parts) <= 3:
        return names
    return [n for n in names if not n.startswith("part-")] + [f"{len(parts)} part files ({parts[0]} .. {parts[-1]})"]


def cmd_check_inputs(args: argparse.Namespace) -> None:
    table = check_inputs.read_table(args.table) if args.table else dict(check_inputs.PUBLISHED)
    for md5_list in args.md5_list or []:
        table.update(check_inputs.read_md5_list(md5_list))
    report = check_inputs.check_inputs(args.inputs, table)
    print(f"check-inputs: {len(report.good)} files match the published size and md5")
    _print_list("not checked: no published md5 (for the part files pass --md5_list "
                "bert_reference_results_text_md5.txt)", report.unchecked)
    _print_list("missing inputs", [] if args.allow_missing else _missing_lines(report.missing))
    _print_list("WRONG", report.bad)
    if report.bad or (report.missing and not args.allow_missing):
        raise DataPrepError(f"{len(report.bad)} files differ from the published ones, "
                            f"{0 if args.allow_missing else len(report.missing)} missing (listed above)")


def _reshard_params(args: argparse.Namespace) -> ReshardParams:
    return ReshardParams(args.num_shards, tuple(args.formats.split(",")), not args.no_shuffle, args.seed,
                         args.max_seq_length, args.max_predictions, args.bucket_samples, args.compression, args.workers)


def cmd_reshard(args: argparse.Namespace) -> None:
    params = _reshard_params(args)
    out_dirs = {fmt: args.out / shard_dir_name(params.num_shards, fmt) for fmt in params.formats}
    reshard(list_shards(args.input), out_dirs, params)


def _eval_params(args: argparse.Namespace) -> EvalParams:
    return EvalParams(args.num_eval_samples, args.max_seq_length, args.max_predictions, args.compression)


def cmd_eval(args: argparse.Namespace) -> None:
    out_dirs = {"fixed": args.out / "eval_fixed", "varlength": args.out / "eval_varlength"}
    make_eval_set(list_shards(args.input), out_dirs, _eval_params(args))


def _pack_params(args: argparse.Namespace) -> PackParams:
    return PackParams(args.algorithm, args.max_seq_length, args.max_sequences_per_pack, args.num_pack_shards,
                      args.group_samples, args.seed, args.compression)


def cmd_pack(args: argparse.Namespace) -> None:
    pack_dataset(list_shards(args.input), args.out, _pack_params(args))


def _strata_bounds(args: argparse.Namespace) -> tuple[int, ...]:
    """--strata_bounds, or the four quarters of --max_seq_length (128/256/384/512 at 512)."""
    if not args.strata_bounds:
        return tuple(args.max_seq_length * k // 4 for k in range(1, 5))
    try:
        bounds = tuple(int(b) for b in args.strata_bounds.split(","))
    except ValueError as err:
        raise SystemExit(f"--strata_bounds must be comma-separated integers, got {args.strata_bounds!r}") from err
    if list(bounds) != sorted(set(bounds)) or bounds[0] <= 0 or bounds[-1] != args.max_seq_length:
        raise SystemExit(f"--strata_bounds must increase and end at --max_seq_length {args.max_seq_length}; "
                         f"got {args.strata_bounds}")
    return bounds


def _stratify_params(args: argparse.Namespace) -> StratifyParams:
    return StratifyParams(bounds=_strata_bounds(args), shards_per_stratum=args.shards_per_stratum, fmt=args.format,
                          max_seq_length=args.max_seq_length, max_predictions=args.max_predictions,
                          compression=args.compression)


def cmd_stratify(args: argparse.Namespace) -> None:
    stratify(list_shards(args.input), args.out, _stratify_params(args))


def _verify(directories: list[Path], vocab: Path | None, args: argparse.Namespace) -> None:
    namespace = argparse.Namespace(directory=directories, vocab=vocab, vocab_size=None,
                                   max_seq_length=args.max_seq_length, max_predictions=args.max_predictions,
                                   expect_samples=None, no_checksums=False, workers=args.workers)
    if verify_dataset.run(namespace, refuse=True) != 0:
        raise DataPrepError(f"verification failed (problems listed above); each refused folder holds "
                            f"{REFUSED_NAME} and no step or run will read it")


def _refuse_orphans(manifest: Manifest, texts: list[Path]) -> None:
    """Samples whose text part is gone from --text_dir would still reach the training shards (reshard
    reads every file of the folder): name them rather than train on a part the user removed."""
    kept = {samples_output_name(p) for p in texts}
    orphans = sorted(name for name in manifest.files if name not in kept)
    deleted = [name for name in orphans if not (manifest.directory / name).is_file()]
    if deleted:  # the user deleted them, as told below: the manifest forgets them too
        manifest.forget(deleted)
        orphans = [name for name in orphans if name not in deleted]
    if orphans:
        raise DataPrepError(f"{manifest.directory}: holds the samples of {len(orphans)} text parts that are no "
                            f"longer in --text_dir ({', '.join(orphans[:3])}{' ...' if len(orphans) > 3 else ''}); "
                            "restore those parts, or delete these files and rerun to make the dataset without them")


def cmd_all(args: argparse.Namespace) -> None:
    """Every step from the text folder to DATADIR / EVALDIR, then verification."""
    out, params = args.out, _sample_params(args)
    eval_text = args.text_dir / EVAL_TEXT
    if not eval_text.is_file():
        raise DataPrepError(f"{eval_text}: not found; --text_dir must hold eval.txt and the part-* files")
    texts = text_files([args.text_dir])
    _refuse_orphans(create_samples(texts, out / "parts", args.vocab, params, args.workers), texts)
    create_samples([eval_text], out / "eval_parts", args.vocab, params, 1)
    make_eval_set(list_shards(out / "eval_parts"), {"fixed": out / "eval_fixed", "varlength": out / "eval_varlength"},
                  _eval_params(args))
    reshard_params = _reshard_params(args)
    shard_dirs = {fmt: out / shard_dir_name(reshard_params.num_shards, fmt) for fmt in reshard_params.formats}
    reshard(list_shards(out / "parts"), shard_dirs, reshard_params)
    training = shard_dirs.get("varlength", next(iter(shard_dirs.values())))
    finished = [*shard_dirs.values(), out / "eval_fixed", out / "eval_varlength"]
    if not args.skip_pack:
        finished.append(out / f"packed_{reshard_params.num_shards}_{args.algorithm}")
        pack_dataset(list_shards(training), finished[-1], _pack_params(args))
    if not args.skip_stratify:
        finished.append(out / f"stratified_{reshard_params.num_shards}")
        stratify(list_shards(training), finished[-1], _stratify_params(args))
    _verify(finished, args.vocab, args)
    log.info("done: DATADIR=%s EVALDIR=%s", training, out / "eval_varlength")


def _samples_io(p: argparse.ArgumentParser) -> None:
    p.add_argument("--text", type=Path, nargs="+", required=True, help="part-* files or folders holding them")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--exclude_text", type=Path,
                   help="drop the documents of this file (eval.txt) from the inputs; not the reference's behaviour: "
                        "a file that loses a document no longer gives the MLCommons samples")


def _io(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", type=Path, required=True, help="folder of input shards (or one shard)")
    p.add_argument("--out", type=Path, required=True)


def _all_io(p: argparse.ArgumentParser) -> None:
    p.add_argument("--text_dir", type=Path, required=True, help="folder with part-XXXXX-of-00500 and eval.txt")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--skip_pack", action="store_true")
    p.add_argument("--skip_stratify", action="store_true")


def _import_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", type=Path, nargs="+", required=True,
                   help="TFRecord files (part-XXXXX-of-00500, eval_intermediate, eval_10k) or folders of them; "
                        "an eval file goes to an --out folder of its own (verify_dataset takes it for an eval set)")
    p.add_argument("--out", type=Path, required=True)


def _check_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", type=Path, nargs="+", help="downloaded files or folders (searched recursively)")
    p.add_argument("--md5_list", type=Path, action="append",
                   help="md5sum-format list to check against too, e.g. bert_reference_results_text_md5.txt")
    p.add_argument("--table", type=Path, help='JSON {"name": [size or null, "md5"]} replacing the published table')
    p.add_argument("--allow_missing", action="store_true", help="check what is there; do not require every input")


def _reshard_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num_shards", type=int, default=4320)
    p.add_argument("--formats", default="fixed,varlength", help="comma-separated: fixed, varlength")
    p.add_argument("--no_shuffle", action="store_true", help="keep the input order instead of shuffling")
    p.add_argument("--bucket_samples", type=int, default=1_000_000,
                   help="samples a worker holds while shuffling (~1.5 KB each)")


def _eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num_eval_samples", type=int, default=NUM_EVAL_SAMPLES,
                   help="pick_eval_samples.py's --num_examples_to_pick")


def _pack_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--algorithm", choices=("nnlshp", "lpfhp", "spfhp"), default="nnlshp")
    p.add_argument("--max_sequences_per_pack", type=int, default=3)
    p.add_argument("--num_pack_shards", type=int, help="packed shards (default: as many as input shards)")
    p.add_argument("--group_samples", type=int, default=1_000_000, help="sequences packed together")


def _stratify_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", choices=("varlength", "fixed"), default="varlength")
    p.add_argument("--shards_per_stratum", type=int, help="default: as many as input shards")
    p.add_argument("--strata_bounds", help="upper length bound of each stratum, comma-separated "
                                           "(default: the quarters of --max_seq_length, 128,256,384,512)")


def cmd_vocab(args: argparse.Namespace) -> None:
    size = train_vocab(text_files(args.text), args.out, args.size, args.lower_case, args.unused, args.min_frequency)
    log.info("wrote %s: %d tokens", args.out, size)


def _vocab_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--text", type=Path, nargs="+", required=True,
                   help="text files (one sentence a line) or folders of part-* files")
    p.add_argument("--out", type=Path, required=True, help="the vocab.txt to write")
    p.add_argument("--size", type=int, default=MLPERF_VOCAB_SIZE, help="tokens in the vocabulary, reserved "
                   "ones included (default %(default)s, the MLPerf vocabulary's; at most 32768)")
    p.add_argument("--lower_case", action=argparse.BooleanOptionalAction, default=True,
                   help="lower-case and strip accents first, as the uncased MLPerf model does (default: on; "
                        "`samples` always tokenises uncased, so --no-lower_case is for other tokenisers)")
    p.add_argument("--unused", type=int, default=0, help="[unusedN] placeholder tokens; 994 gives the "
                   "MLPerf ids ([UNK] 100, [CLS] 101, [SEP] 102, [MASK] 103) (default %(default)s)")
    p.add_argument("--min_frequency", type=int, default=2, help="occurrences a merge needs (default %(default)s)")


def cmd_model_config(args: argparse.Namespace) -> None:
    vocab_size = load_vocab(args.vocab).size if args.vocab else MLPERF_VOCAB_SIZE
    write_model_config(args.out, model_config(args.size, vocab_size, args.max_position_embeddings))
    log.info("wrote %s: BERT-%s, vocab_size %d", args.out, args.size, vocab_size)


def _model_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", choices=tuple(MODEL_SIZES), required=True,
                   help="published BERT shapes: " + ", ".join(f"{name} {layers}x{hidden}/{heads} heads"
                                                              for name, (layers, hidden, heads) in MODEL_SIZES.items()))
    p.add_argument("--out", type=Path, required=True, help="the bert_config.json to write")
    p.add_argument("--vocab", type=Path, help=f"take vocab_size from this vocab.txt (default {MLPERF_VOCAB_SIZE})")
    p.add_argument("--max_position_embeddings", type=int, default=512, help="longest sequence (default %(default)s)")


def _run_verify(args: argparse.Namespace) -> None:
    code = verify_dataset.run(args)
    if code:
        raise SystemExit(code)


# step: (help, function, argument groups)
STEPS = {
    "check-inputs": ("downloads vs the published MLCommons md5 table", cmd_check_inputs,
                     (_check_args,)),
    "samples": ("text parts -> per-part hdf5, the reference's rows and order", cmd_samples,
                (_samples_io, _sample_args, _common)),
    "import-tfrecord": ("reference TFRecords -> per-part fixed hdf5", cmd_import_tfrecord,
                        (_import_args, _common)),
    "reshard": ("per-part files -> OUT/hdf5_N_shards_{fixed,varlength}", cmd_reshard, (_io, _reshard_args, _common)),
    "eval": ("eval samples -> OUT/eval_fixed and OUT/eval_varlength", cmd_eval, (_io, _eval_args, _common)),
    "pack": ("shards -> packed shards + packing_report.json", cmd_pack, (_io, _pack_args, _common)),
    "stratify": ("shards -> stratum_0..3 shards + strata.json", cmd_stratify, (_io, _stratify_args, _common)),
    "verify": ("check dataset folders", _run_verify, (verify_dataset.add_arguments,)),
    "convert-checkpoint": ("TF1 / .pt / HuggingFace checkpoint conversion", convert_checkpoint.run,
                           (convert_checkpoint.add_arguments,)),
    "all": ("text folder -> every dataset folder, verified", cmd_all,
            (_all_io, _sample_args, _common, _reshard_args, _eval_args, _pack_args, _stratify_args)),
    "vocab": ("text files -> a WordPiece vocab.txt trained on them", cmd_vocab, (_vocab_args,)),
    "model-config": ("named BERT size -> bert_config.json", cmd_model_config, (_model_config_args,)),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="MLPerf BERT data preparation", epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quiet", action="store_true", help="log warnings only")
    sub = parser.add_subparsers(dest="step", required=True)
    for name, (help_text, func, groups) in STEPS.items():
        step = sub.add_parser(name, help=help_text)
        for add in groups:
            add(step)
        step.set_defaults(func=func)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        args.func(args)
    except DataPrepError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
