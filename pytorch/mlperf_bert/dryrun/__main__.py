"""`python -m mlperf_bert.dryrun`: see the package docstring."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from ..runtime.files import output_file


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="python -m mlperf_bert.dryrun",
                                description="Runs the configured training steps and an eval on 'cuda' "
                                            "(fake without a GPU) and reports the host reads.",
                                epilog="Everything after -- is the trainer's flags (run_pretraining.py); "
                                       "WORLD_SIZE/RANK set the ranks, as for the trainer.")
    p.add_argument("--steps", type=int, default=3, help="training steps to run (default 3)")
    p.add_argument("--real", action="store_true", help="run on the real GPU instead of the fake device")
    p.add_argument("--cost_json", type=output_file, default=None, metavar="FILE",
                   help="write one device's memory estimate and the traced step's and eval's work here (JSON)")
    split = argv.index("--") if "--" in argv else len(argv)
    return p.parse_args(argv[:split]), argv[split + 1:]


def main(argv: list[str] | None = None) -> int:
    opts, trainer_argv = parse(sys.argv[1:] if argv is None else argv)
    if trainer_argv and trainer_argv[0].endswith("run_pretraining.py"):
        trainer_argv = trainer_argv[1:]  # called as $PYTHON by run_and_time.sh
    if not opts.real:
        from .native import load

        load()
    from ..config.settings import ConfigError
    from .report import print_report
    from .run import dry_run

    try:
        report = dry_run(trainer_argv, steps=opts.steps, fake=not opts.real)
    except ConfigError as refused:
        print(f"dry run: the trainer refuses these flags: {refused}", file=sys.stderr)
        return 2
    print_report(report)
    if opts.cost_json is not None and report.memory is not None and report.work is not None:
        opts.cost_json.write_text(json.dumps({"memory": vars(report.memory), "work": report.work.to_dict(),
                                              "world_size": report.world_size}) + "\n")
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
