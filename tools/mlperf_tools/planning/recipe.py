"""A BERT recipe for N accelerators of M GB: global batch, per-device batch, accumulation and a
published hyperparameter set to borrow, with the RCP status of each choice.

    python tools/recipe.py --gpus N (--memory_gb M | --device NAME) [--gbs G] [--write config_X.sh]

For each global batch size near the RCP table's points that N devices can split evenly, it
prints the per-device batch and accumulation that fit the memory, the RCP status the official
checker gives it (training_rules.adoc §13, through `scoring.rcp_window`: covered = its own RCP in
the pruned set, interpolated between two, below the smallest point, missing = above every point)
with the expected samples to converge, and the published hyperparameter set to borrow for it:
one of the RCP table's reference sets or of the shipped configs that copy published submissions.
§9.2 lets an entry replace its hyperparameters by another submitter's "once per benchmark entry",
changing the batch size but taking "all other hyperparameters as a group"; so a set is borrowed
whole, from the same global batch size where one exists, else from the nearest one.
The choice: the covered or interpolated batch size with the fewest expected samples to converge
among those giving every device at least --min_device_batch sequences per step, then the fewest
accumulation steps. --write puts it (or --gbs G) in a config file like the shipped ones, with the
set-up variables (compile mode, eval graph, NCCL, sharded optimizer) of the shipped closed-division
config of the nearest system (`nearest_system`: same device, nearest device count).

Memory is one figure per micro-batch (`device_memory_gb`): the model state plus a per-sequence
activation size, the one function a traced estimate replaces.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Mapping, Sequence

from mlperf_tools.results.package_results import PackageError, rcp_comment, read_config
from mlperf_tools.results.scoring import ABOVE, BELOW, COVERED, INTERPOLATED, RcpWindow, ScoringError, rcp_checker, rcp_window

from mlperf_bert.config.batch_size import config_batch
from mlperf_bert.config.closed_division import eval_interval_samples
from mlperf_bert.runtime.files import output_file_problem

REPO = Path(__file__).resolve().parents[3]  # tools/mlperf_tools/<kind>/<module>.py: the tools work on a checkout

# Device memory in GB (decimal, as the vendors state it).
DEVICE_MEMORY_GB = {"A100": 80.0, "A100-40GB": 40.0, "H100": 80.0, "H200": 141.0, "B200": 180.0, "GB200": 186.0}

# BERT-Large with the vocabulary padded to 30,528: 335.2M parameters. fp32 weights, fp32 gradients and
# LAMB's two fp32 moments are 16 bytes a parameter (5.4 GB), a bf16 copy of the weights 0.7 GB, the
# CUDA context and library workspaces about 1.5 GB.
MODEL_STATE_GB = 7.5
# One 512-token sequence's saved activations: 34 x sequence x hidden bytes a layer in 16-bit with a
# fused attention that keeps no score matrix (Korthikanti et al. 2022, "Reducing Activation
# Recomputation in Large Transformer Models", section 4.1), x 24 layers = 0.43 GB, plus the masked-LM
# head's logits for 76 predictions (0.01 GB). Unpadded batches need less; this is their worst case.
ACTIVATION_GB_PER_SEQUENCE = 0.44
USABLE_FRACTION = 0.9  # what the caching allocator can fill before fragmentation bites

LIMIT_OVER_RCP_MEAN = 1.85  # MAX_SAMPLES_TERMINATION / RCP mean: 4.5M at GBS 448, as the shipped 1x8 config
STATUS = {COVERED: "covered", INTERPOLATED: "interpolated", BELOW: "below the smallest point", ABOVE: "missing"}
# What the official checker says of a result at this batch size that converges like the RCP mean.
CHECKER_WORDS = {COVERED: "RCP found", INTERPOLATED: "RCP Interpolation",
                 BELOW: "RCP not found but slower convergence on smaller batch size (if slower than the "
                        "smallest point's bound; else Missing RCP)",
                 ABOVE: "Missing RCP, please submit RCP with BS = {gbs}"}


class RecipeError(Exception):
    """Bad input; the message names the flag and the fix."""


def device_memory_gb(micro_batch: int) -> float:
    """GB one device needs to train a micro-batch of `micro_batch` 512-token sequences."""
    return MODEL_STATE_GB + micro_batch * ACTIVATION_GB_PER_SEQUENCE


def max_micro_batch(memory_gb: float) -> int:
    """The largest micro-batch whose `device_memory_gb` fits the usable part of the device's memory."""
    usable, fits = memory_gb * USABLE_FRACTION, 0
    while device_memory_gb(fits + 1) <= usable:
        fits += 1
    return fits


# ---------------------------------------------------------------------------------------------
# Published hyperparameter sets


@dataclass(frozen=True)
class HyperparameterSet:
    """The tunable BERT hyperparameters (training_rules.adoc §9.1) of one published run setup."""

    source: str
    global_batch_size: int
    learning_rate: float
    max_steps: int
    warmup_steps: int
    start_warmup_step: int
    beta_1: float
    beta_2: float
    weight_decay: float
    epsilon: float

    def exports(self) -> dict[str, str]:
        return {"LR": f"{self.learning_rate:g}", "MAX_STEPS": str(self.max_steps),
                "WARMUP_STEPS": str(self.warmup_steps), "START_WARMUP_STEP": str(self.start_warmup_step),
                "OPT_LAMB_BETA_1": f"{self.beta_1:g}", "OPT_LAMB_BETA_2": f"{self.beta_2:g}",
                "WEIGHT_DECAY_RATE": f"{self.weight_decay:g}", "OPT_EPSILON": f"{self.epsilon:g}"}


def rcp_sets(ruleset: str) -> list[HyperparameterSet]:
    """The reference hyperparameters of every RCP in the table (pruned or not: all were published)."""
    sets = []
    for name, record in rcp_checker(ruleset).rcp_data.items():
        hp: Mapping[str, Any] = record["Hyperparams"]
        sets.append(HyperparameterSet(
            f"RCP {name}", int(record["BS"]), float(hp["opt_base_learning_rate"]),
            int(hp["opt_learning_rate_training_steps"]), int(hp["num_warmup_steps"]), int(hp["start_warmup_step"]),
            float(hp["opt_lamb_beta_1"]), float(hp["opt_lamb_beta_2"]), float(hp["opt_lamb_weight_decay_rate"]),
            float(hp["opt_epsilon"])))
    return sets


def config_sets(configs: Sequence[Path]) -> list[HyperparameterSet]:
    """The hyperparameters of the shipped closed-division configs (copies of published submissions)."""
    sets = []
    for path in configs:
        env = read_config(path)
        if env.get("DIVISION") != "closed":
            continue
        gbs = config_batch(env, path.name).global_batch_size
        sets.append(HyperparameterSet(
            path.name, gbs, float(env["LR"]), int(env["MAX_STEPS"]), int(env.get("WARMUP_STEPS") or 0),
            int(env.get("START_WARMUP_STEP") or 0), float(env["OPT_LAMB_BETA_1"]), float(env["OPT_LAMB_BETA_2"]),
            float(env["WEIGHT_DECAY_RATE"]), float(env.get("OPT_EPSILON") or 1e-6)))
    return sets


def borrowable(gbs: int, sets: Sequence[HyperparameterSet]) -> HyperparameterSet:
    """The set tuned at this global batch size, else the nearest one (in ratio; the smaller on a tie).
    RCP sets come first in `sets`, so they win over a config at the same batch size."""
    return min(sets, key=lambda s: (abs(math.log(s.global_batch_size / gbs)), s.global_batch_size))


# ---------------------------------------------------------------------------------------------
# Candidates


@dataclass(frozen=True)
class Candidate:
    global_batch_size: int
    devices: int
    accumulation: int
    window: RcpWindow
    borrow: HyperparameterSet

    @property
    def per_device(self) -> int:
        """Sequences per device and optimizer step (BATCHSIZE)."""
        return self.global_batch_size // self.devices

    @property
    def micro_batch(self) -> int:
        return self.per_device // self.accumulation

    @property
    def status(self) -> str:
        return STATUS[self.window.coverage]

    @property
    def checker_words(self) -> str:
        return CHECKER_WORDS[self.window.coverage].format(gbs=self.global_batch_size)

    @property
    def expected_samples(self) -> float | None:
        return self.window.rcp_mean


def accumulation_steps(per_device: int, limit: int) -> int:
    """The fewest accumulation steps that split `per_device` into equal micro-batches of <= limit."""
    return next(a for a in range(1, per_device + 1) if per_device % a == 0 and per_device // a <= limit)


def candidate_sizes(devices: int, rcp_sizes: Sequence[int], min_device_batch: int) -> list[int]:
    """Multiples of `devices` at or next to every RCP table point, one past the largest, and the
    smallest that gives every device `min_device_batch` sequences."""
    sizes = {devices * min_device_batch, (max(rcp_sizes) // devices + 1) * devices}
    for bs in rcp_sizes:
        sizes |= {bs // devices * devices, -(-bs // devices) * devices}
    return sorted(size for size in sizes if size >= devices)


def candidates(devices: int, memory_gb: float, ruleset: str, sets: Sequence[HyperparameterSet],
               sizes: Sequence[int] | None = None, min_device_batch: int = 4) -> list[Candidate]:
    limit = max_micro_batch(memory_gb)
    if limit < 1:
        raise RecipeError(f"--memory_gb {memory_gb:g}: one device needs {device_memory_gb(1):.1f} GB for a single "
                          f"sequence ({MODEL_STATE_GB} GB of model state); BERT-Large needs more memory per device")
    table = sorted({int(record["BS"]) for record in rcp_checker(ruleset).rcp_data.values()})
    return [Candidate(gbs, devices, accumulation_steps(gbs // devices, limit), rcp_window(gbs, ruleset),
                      borrowable(gbs, sets))
            for gbs in (sizes or candidate_sizes(devices, table, min_device_batch))]


def choose(found: Sequence[Candidate], min_device_batch: int) -> Candidate | None:
    """Fewest expected samples among covered/interpolated sizes with enough work per device."""
    usable = [c for c in found if c.window.coverage in (COVERED, INTERPOLATED) and c.per_device >= min_device_batch]
    return min(usable, key=lambda c: (c.expected_samples, c.accumulation, c.global_batch_size), default=None)


# ---------------------------------------------------------------------------------------------
# Output


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def table(found: Sequence[Candidate], chosen: Candidate | None) -> str:
    lines = [f"{'':2}{'GBS':>6} {'per device':>10} {'micro x accum':>13}  {'RCP status':<26}{'RCP mean':>11} "
             f"{'min accepted':>13}  hyperparameters to borrow"]
    for c in found:
        mark = "* " if c is chosen else "  "
        own = "its own GBS" if c.borrow.global_batch_size == c.global_batch_size else \
            f"GBS {c.borrow.global_batch_size}"
        lines.append(f"{mark}{c.global_batch_size:>6} {c.per_device:>10} {f'{c.micro_batch} x {c.accumulation}':>13}  "
                     f"{c.status:<26}{_count(c.expected_samples):>11} {_count(c.window.min_mean):>13}  "
                     f"{c.borrow.source} ({own})")
    return "\n".join(lines)


def explain(chosen: Candidate, devices: int, device: str) -> list[str]:
    borrow = chosen.borrow
    moved = "" if borrow.global_batch_size == chosen.global_batch_size else (
        f"; it was tuned at GBS {borrow.global_batch_size}, so its {borrow.max_steps} steps now span "
        f"{borrow.max_steps * chosen.global_batch_size:,} samples and its convergence here is untested")
    return [
        f"choice: GBS {chosen.global_batch_size} = {chosen.micro_batch} sequences x {chosen.accumulation} accumulation "
        f"step(s) x {devices} {device}: {chosen.status} ({chosen.window.where()}); the official checker says "
        f"\"{chosen.checker_words}\" for a result that converges like the RCP mean",
        f"borrow: {borrow.source}: LR {borrow.learning_rate:g}, {borrow.max_steps} steps, warm-up "
        f"{borrow.warmup_steps} from step {borrow.start_warmup_step}, betas {borrow.beta_1:g}/{borrow.beta_2:g}, weight "
        f"decay {borrow.weight_decay:g}, epsilon {borrow.epsilon:g}, taken as a group with only the batch size changed "
        f"(training_rules.adoc §9.2){moved}",
    ]


# ---------------------------------------------------------------------------------------------
# The config file


def node_split(devices: int, per_node: int | None) -> tuple[int, int]:
    """(nodes, devices per node): up to 8 per node unless told."""
    per_node = per_node or min(devices, 8)
    if per_node < 1 or devices % per_node:
        raise RecipeError(f"--gpus_per_node {per_node}: {devices} devices do not split into nodes of {per_node}; "
                          "pass a divisor of --gpus")
    return devices // per_node, per_node


def shipped_device(env: Mapping[str, str]) -> str:
    """The device of a shipped config's DGXSYSTEM ("DGXA100_1x8" -> "A100", "GB200_2x4" -> "GB200")."""
    return env.get("DGXSYSTEM", "").split("_")[0].removeprefix("DGX")


def nearest_system(configs: Sequence[Path], device: str, devices: int) -> tuple[Path, dict[str, str]]:
    """The shipped closed-division GPU config of the same device (else any) with the nearest device count."""
    shipped = [(path, read_config(path)) for path in configs]
    shipped = [(path, env) for path, env in shipped if env.get("DIVISION") == "closed" and "DGXNGPU" in env
               and not path.name.startswith("config_CPU_")]
    if not shipped:
        raise RecipeError("no shipped closed-division GPU config_*.sh to take the set-up variables from")

    def distance(item: tuple[Path, dict[str, str]]) -> tuple[bool, float, str]:
        env = item[1]
        world = int(env["DGXNGPU"]) * int(env.get("DGXNNODES") or 1)
        return shipped_device(env) != device, abs(math.log(world / devices)), item[0].name

    path, env = min(shipped, key=distance)
    text = path.read_text()  # the file's order, not the environment's
    return path, dict(sorted(env.items(), key=lambda item: (text.find(f"export {item[0]}="), item[0])))


def setup_exports(nearest: Mapping[str, str], written: Collection[str], devices: int) -> dict[str, str]:
    """The nearest system's set-up variables the recipe does not decide itself (compile mode, eval graph, NCCL, the
    sharded optimizer, ...), in its order; a shard group that does not divide `devices` is left out (all ranks)."""
    setup = {name: value for name, value in nearest.items() if name not in written and name not in NOT_SETUP}
    if devices % max(int(setup.get("DIST_OPTIMIZER_GROUP_SIZE") or 1), 1):
        del setup["DIST_OPTIMIZER_GROUP_SIZE"]
    return setup


# The recipe's own decisions, not copied from the nearest system: the batch and its layout (BATCHSIZE counts
# sequences unpadded; a packed row holds two), the numbers precision and graphs change in memory.
NOT_SETUP = ("INPUT_LAYOUT", "BALANCE", "PRECISION", "CUDA_GRAPHS")


def config_text(chosen: Candidate, system: str, device: str, memory_gb: float, ruleset: str,
                per_node: int | None = None, nearest: tuple[Path, Mapping[str, str]] | None = None) -> str:
    nodes, per = node_split(chosen.devices, per_node)
    gbs, interval = chosen.global_batch_size, eval_interval_samples(chosen.global_batch_size)
    b = chosen.borrow
    # Room past the expected end; above every RCP there is none to expect: the end of the LR schedule.
    expected = LIMIT_OVER_RCP_MEAN * chosen.expected_samples if chosen.expected_samples else b.max_steps * gbs
    limit = max(math.ceil(expected / 100_000) * 100_000, interval)
    header = [
        "# shellcheck shell=bash",
        f"# {nodes} node(s) x {per} {device} ({memory_gb:g} GB): written by tools/recipe.py.",
        f"# Batch arithmetic: {chosen.micro_batch} sequences/GPU x {chosen.accumulation} accumulation step(s) x "
        f"{chosen.devices} GPUs = {gbs} global batch (BATCHSIZE {chosen.per_device} per GPU and optimizer step).",
        f"# Memory estimate per GPU: {device_memory_gb(chosen.micro_batch):.1f} GB of {memory_gb:g} GB "
        "(tools/recipe.py device_memory_gb).",
        f"# Eval interval (REFERENCE formula): floor_25k(0.05 x (230.23 x {gbs} + 3,000,000)) = {interval:,} samples.",
        f"# Hyperparameters: {b.source} (GBS {b.global_batch_size}), borrowed as a group (training_rules.adoc §9.2).",
        rcp_comment(gbs, ruleset),
    ]
    groups = [
        {"DGXSYSTEM": system, "DGXNNODES": str(nodes), "DGXNGPU": str(per),
         "WALLTIME": str(60 * math.ceil(8 / min(chosen.devices, 8)))},  # minutes: small systems take hours
        {"BATCHSIZE": str(chosen.per_device), "GRADIENT_STEPS": str(chosen.accumulation), **b.exports(),
         "OPTIMIZER": "lamb", "MAX_GRAD_NORM": "1.0", "CLIP_MODE": "after_allreduce"},
        {"EVAL_ITER_START_SAMPLES": str(interval), "EVAL_ITER_SAMPLES": str(interval),
         "MAX_SAMPLES_TERMINATION": str(limit), "TARGET_MLM_ACCURACY": "0.720", "NUM_EVAL_EXAMPLES": "10000",
         "EVAL_BATCH_SIZE": "128", "MAX_SEQ_LENGTH": "512", "MAX_PREDICTIONS_PER_SEQ": "76"},
        {"INPUT_LAYOUT": "unpadded", "BALANCE": "global_presort" if chosen.devices > 1 else "none",
         "PRECISION": "bf16", "CUDA_GRAPHS": "0", "SYNC_EVERY": "10"},
        {"DIVISION": "closed", "SUBMISSION_ORG": "reference", "SUBMISSION_PLATFORM": f"{chosen.devices}x{device}"},
    ]
    if nearest is not None:
        setup = setup_exports(nearest[1], {name for group in groups for name in group}, chosen.devices)
        if setup:
            header.append(f"# Set-up ({', '.join(setup)}): as {nearest[0].name}, the nearest shipped system.")
            groups.insert(-1, setup)
    body = "\n\n".join("\n".join(f"export {name}={value}" for name, value in group.items()) for group in groups)
    return "\n".join(header) + "\n" + body + "\n"


def system_name(path: Path) -> str:
    """The system of a --write path, whose folders are made now (RecipeError where it cannot be written)."""
    if not (path.name.startswith("config_") and path.name.endswith(".sh")) or len(path.name) <= len("config_.sh"):
        raise RecipeError(f"--write {path}: name the file config_<SYSTEM>.sh (the launchers find it by that name)")
    problem = output_file_problem(path)
    if problem is not None:
        raise RecipeError(f"--write {path}: {problem}")
    return path.name[len("config_"):-len(".sh")]


# ---------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, required=True, help="accelerators in the system")
    parser.add_argument("--memory_gb", type=float, help="memory of one accelerator, GB (default: --device's)")
    parser.add_argument("--device", default=None, help=f"accelerator name ({', '.join(DEVICE_MEMORY_GB)} or any)")
    parser.add_argument("--gbs", type=int, default=None, help="take this global batch size instead of the choice")
    parser.add_argument("--min_device_batch", type=int, default=4,
                        help="fewest sequences per device and step the choice allows (default 4, NVIDIA's "
                             "smallest at scale)")
    parser.add_argument("--gpus_per_node", type=int, default=None, help="for --write (default: up to 8)")
    parser.add_argument("--ruleset", default="5.0.0", help="training ruleset whose RCPs to use (default 5.0.0)")
    parser.add_argument("--write", type=Path, default=None, help="write the choice as this config_<SYSTEM>.sh")
    return parser.parse_args(argv)


def memory_of(args: argparse.Namespace) -> tuple[float, str]:
    if args.memory_gb is not None:
        if args.memory_gb <= 0:
            raise RecipeError(f"--memory_gb {args.memory_gb:g}: give the accelerator's memory in GB (> 0)")
        return args.memory_gb, args.device or "GPU"
    if args.device is None:
        raise RecipeError("give --memory_gb M or --device NAME (" + ", ".join(DEVICE_MEMORY_GB) + ")")
    if args.device not in DEVICE_MEMORY_GB:
        raise RecipeError(f"--device {args.device}: its memory is not known here; pass --memory_gb too "
                          f"(known: {', '.join(DEVICE_MEMORY_GB)})")
    return DEVICE_MEMORY_GB[args.device], args.device


def run(args: argparse.Namespace) -> int:
    if args.gpus < 1:
        raise RecipeError(f"--gpus {args.gpus}: give the number of accelerators (1 or more)")
    if args.gbs is not None and (args.gbs < args.gpus or args.gbs % args.gpus):
        raise RecipeError(f"--gbs {args.gbs}: a global batch size must be a multiple of --gpus {args.gpus}")
    if args.min_device_batch < 1:
        raise RecipeError(f"--min_device_batch {args.min_device_batch}: give 1 or more sequences")
    memory_gb, device = memory_of(args)
    system = system_name(args.write) if args.write else ""
    if args.write:
        node_split(args.gpus, args.gpus_per_node)
    sets = rcp_sets(args.ruleset) + config_sets(sorted(REPO.glob("config_*.sh")))
    found = candidates(args.gpus, memory_gb, args.ruleset, sets, min_device_batch=args.min_device_batch)
    if args.gbs is not None:
        found = [c for c in found if c.global_batch_size != args.gbs]
        found += candidates(args.gpus, memory_gb, args.ruleset, sets, [args.gbs])
        found.sort(key=lambda c: c.global_batch_size)
    chosen = next(c for c in found if c.global_batch_size == args.gbs) if args.gbs else \
        choose(found, args.min_device_batch)
    print(f"{args.gpus} x {device}, {memory_gb:g} GB each: micro-batches up to {max_micro_batch(memory_gb)} sequences "
          f"of 512 tokens ({MODEL_STATE_GB} GB state + {ACTIVATION_GB_PER_SEQUENCE} GB a sequence, "
          f"{USABLE_FRACTION:.0%} usable); RCPs of training {args.ruleset}")
    print(table(found, chosen))
    if chosen is None:
        print(f"no covered or interpolated GBS gives {args.gpus} devices {args.min_device_batch}+ sequences each: "
              "lower --min_device_batch or pass --gbs")
        return 1
    print("\n".join(explain(chosen, args.gpus, device)))
    if args.write:
        nearest = nearest_system(sorted(REPO.glob("config_*.sh")), device, args.gpus)
        args.write.write_text(config_text(chosen, system, device, memory_gb, args.ruleset, args.gpus_per_node,
                                          nearest))
        print(f"wrote {args.write}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except (RecipeError, ScoringError, PackageError) as err:
        print(f"recipe.py: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
