"""Command-line flags (the names MLPerf BERT users know) -> `TrainConfig`."""

from __future__ import annotations

import argparse
from typing import Sequence

from .config import (
    BALANCE_DEALS,
    BALANCE_POLICIES,
    CLIP_MODES,
    COMPILE_MODES,
    DEVICES,
    DIVISIONS,
    INPUT_LAYOUTS,
    INPUT_PIPELINES,
    OPTIMIZER_IMPLS,
    OPTIMIZERS,
    PRECISIONS,
    SUBMISSION_STATUSES,
    CheckpointSettings,
    DataSettings,
    EvalSettings,
    FaultSettings,
    ModelSettings,
    OptimSettings,
    RunSettings,
    ScheduleSettings,
    TrainConfig,
)


def _data_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--input_dir", help="folder of training hdf5 shards (fixed, varlength or packed)")
    g.add_argument("--eval_dir", required=True, help="folder (or file) of the eval hdf5 shard(s)")
    g.add_argument("--max_seq_length", type=int, default=512, help="longest sequence, in tokens (default 512)")
    g.add_argument("--max_predictions_per_seq", type=int, default=76, help="masked positions per sequence (76)")
    g.add_argument("--input_layout", choices=INPUT_LAYOUTS, default="unpadded",
                   help="padded: every sequence padded to max_seq_length; unpadded: real tokens only; "
                        "packed: packed shards, up to 3 sequences per row (default unpadded)")
    g.add_argument("--balance", choices=BALANCE_POLICIES, default="none",
                   help="load balancing of unpadded batches across ranks (default none)")
    g.add_argument("--balance_deal", choices=BALANCE_DEALS, default="auto",
                   help="how sorted samples are dealt to ranks; auto: raster for global_presort and "
                        "cpu_exchange, snake for local_presort (greedy balances best)")


def _model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--bert_config_path", required=True, help="Google-format bert_config.json")
    g.add_argument("--init_checkpoint", help="{'model': state_dict} .pt file or HuggingFace directory")
    g.add_argument("--attention_backend", choices=("auto", "sdpa", "varlen"), default="auto",
                   help="sdpa: reference, runs anywhere; varlen: GPU kernels on flat tokens; "
                        "auto picks varlen on a GPU when it is exact (default auto)")


def _optim_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("optimizer and schedule")
    g.add_argument("--optimizer", choices=OPTIMIZERS, default="lamb", help="lamb (closed division) or adam")
    g.add_argument("--optimizer_impl", choices=OPTIMIZER_IMPLS, default="auto",
                   help="auto: apex when importable, else PyTorch multi-tensor (foreach)")
    g.add_argument("--learning_rate", type=float, default=4e-4, help="peak learning rate")
    g.add_argument("--opt_lamb_beta_1", type=float, default=0.9, help="first-moment decay")
    g.add_argument("--opt_lamb_beta_2", type=float, default=0.999, help="second-moment decay")
    g.add_argument("--opt_epsilon", type=float, default=1e-6, help="optimizer epsilon (1e-6 LAMB)")
    g.add_argument("--weight_decay_rate", type=float, default=0.01,
                   help="decoupled weight decay, not applied to biases and LayerNorm")
    g.add_argument("--max_grad_norm", type=float, default=1.0, help="gradient clipping norm")
    g.add_argument("--clip_mode", choices=CLIP_MODES, default="after_allreduce",
                   help="where gradients are clipped relative to the all-reduce")
    g.add_argument("--max_steps", type=int, required=True, help="optimizer steps; the LR reaches 0 here")
    warm = g.add_mutually_exclusive_group()
    warm.add_argument("--warmup_steps", type=int, help="linear warm-up steps")
    warm.add_argument("--warmup_proportion", type=float, help="warm-up as a fraction of max_steps")
    g.add_argument("--start_warmup_step", type=int, default=0,
                   help="schedule offset; negative values start the warm-up part-way (NVIDIA configs)")
    g.add_argument("--decay_steps", type=int,
                   help="steps over which the LR decays to --end_learning_rate (default: max_steps)")
    g.add_argument("--end_learning_rate", type=float, default=0.0, help="LR after the decay")
    g.add_argument("--decay_from_warmup_end", action="store_true",
                   help="measure decay progress from the end of warm-up (Samsung's schedule)")
    g.add_argument("--train_batch_size", type=int, default=8,
                   help="per rank and optimizer step: sequences, or packs with --input_layout packed")
    g.add_argument("--gradient_accumulation_steps", type=int, default=1,
                   help="micro-batches per optimizer step (micro-batch = train_batch_size / this)")


def _eval_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("evaluation and stopping")
    g.add_argument("--target_mlm_accuracy", type=float, default=0.720, help="stop with success at this accuracy")
    g.add_argument("--num_eval_examples", type=int, default=10000, help="eval samples (first N of eval_dir)")
    g.add_argument("--eval_batch_size", type=int, default=128, help="eval sequences per rank and step")
    g.add_argument("--eval_iter_start_samples", type=int,
                   help="samples before the first eval (default: the MLPerf eval interval)")
    g.add_argument("--eval_iter_samples", type=int,
                   help="samples between evals (default: the MLPerf formula of the global batch size)")
    g.add_argument("--max_samples_termination", type=int, help="stop with status aborted after this many samples")


def _run_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("run")
    g.add_argument("--output_dir", required=True, help="where the MLPerf log and resolved config go")
    g.add_argument("--seed", type=int, default=12345, help="seed of weights, data order and dropout")
    g.add_argument("--do_train", action="store_true",
                   help="train; without it the init checkpoint is evaluated once")
    g.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="fp32 (CPU), bf16 or fp16 with dynamic loss scaling (GPU)")
    g.add_argument("--init_loss_scale", type=float, default=2.0**16, help="fp16 initial loss scale")
    g.add_argument("--cuda_graphs", action="store_true", help="capture the packed training step as a CUDA graph")
    g.add_argument("--compile_mode", choices=COMPILE_MODES, default="none",
                   help="torch.compile each encoder layer (fuses bias+GELU and dropout+residual+LayerNorm)")
    g.add_argument("--sync_every", type=int, default=1,
                   help="steps between host reads of the device (loss check, stop agreement); above 1 a "
                        "non-finite loss rolls the run back to the last good read (docs/FAULTS.md)")
    g.add_argument("--input_pipeline", choices=INPUT_PIPELINES, default="torch",
                   help="host-to-device input: torch (pinned memory, side-stream copies) or NVIDIA DALI")
    g.add_argument("--device", choices=DEVICES, default="auto", help="auto: cuda when available")
    g.add_argument("--log_freq", type=int, default=10, help="steps between progress lines on stderr")
    g.add_argument("--mlperf_log_file", help="MLPerf log path (default OUTPUT_DIR/mlperf.log)")
    g.add_argument("--submission_division", choices=DIVISIONS, default="closed")
    g.add_argument("--submission_org", default="reference", help="logged as submission_org")
    g.add_argument("--submission_platform", default="unknown", help="logged as submission_platform")
    g.add_argument("--submission_status", choices=SUBMISSION_STATUSES, default="onprem")


def _fault_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpoints and faults (docs/FAULTS.md)")
    g.add_argument("--checkpoint_dir",
                   help="run checkpoints; must be inside --output_dir (default OUTPUT_DIR/checkpoints)")
    g.add_argument("--checkpoint_every_samples", type=int,
                   help="write a checkpoint after the step that passes each multiple of this many samples")
    g.add_argument("--checkpoint_every_minutes", type=float,
                   help="write a checkpoint when this many minutes passed since the last one (rank 0's clock)")
    g.add_argument("--keep_checkpoints", type=int, default=3, help="newest checkpoints kept, older ones deleted")
    g.add_argument("--resume_from_checkpoint", metavar="PATH|auto",
                   help="continue a run from a checkpoint file; auto: the newest in --checkpoint_dir, "
                        "or a fresh start when there is none (a resumed run is never a timing result)")
    g.add_argument("--collective_timeout_s", type=float, default=600.0,
                   help="seconds a rank waits in a collective before the run stops naming the lost rank; "
                        "must exceed the time to write a checkpoint")
    g.add_argument("--max_consecutive_skipped_steps", type=int, default=50,
                   help="fp16: stop (with a checkpoint) after this many overflow-skipped steps in a row")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="run_pretraining.py",
        description="MLPerf BERT phase-2 pretraining to a masked-LM accuracy target.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for add in (_data_flags, _model_flags, _optim_flags, _eval_flags, _run_flags, _fault_flags):
        add(p)
    return p


def config_from_args(args: argparse.Namespace, world_size: int) -> TrainConfig:
    """Builds the validated config tree; raises ConfigError naming the flag to fix."""
    return TrainConfig(
        model=ModelSettings(args.bert_config_path, args.init_checkpoint, args.attention_backend),
        data=DataSettings(args.input_dir, args.eval_dir, args.max_seq_length, args.max_predictions_per_seq,
                          args.input_layout, args.balance, args.balance_deal),
        optim=OptimSettings(args.optimizer, args.learning_rate, args.opt_lamb_beta_1, args.opt_lamb_beta_2,
                            args.opt_epsilon, args.weight_decay_rate, args.max_grad_norm, args.clip_mode,
                            args.optimizer_impl),
        schedule=ScheduleSettings(args.max_steps, args.warmup_steps, args.warmup_proportion, args.start_warmup_step,
                                  args.decay_steps, args.end_learning_rate, args.decay_from_warmup_end),
        eval=EvalSettings(args.target_mlm_accuracy, args.num_eval_examples, args.eval_batch_size,
                          args.eval_iter_start_samples, args.eval_iter_samples),
        run=RunSettings(args.output_dir, args.seed, args.do_train, args.max_samples_termination, args.precision,
                        args.device, args.log_freq, args.init_loss_scale, args.cuda_graphs, args.mlperf_log_file,
                        args.submission_division, args.submission_org, args.submission_platform,
                        args.submission_status, args.compile_mode, args.sync_every, args.input_pipeline),
        train_batch_size=args.train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        world_size=world_size,
        checkpoint=CheckpointSettings(args.checkpoint_dir, args.checkpoint_every_samples, args.checkpoint_every_minutes,
                                      args.keep_checkpoints, args.resume_from_checkpoint),
        faults=FaultSettings(args.collective_timeout_s, args.max_consecutive_skipped_steps),
    )


def parse_config(argv: Sequence[str] | None, world_size: int) -> TrainConfig:
    return config_from_args(build_parser().parse_args(argv), world_size)
