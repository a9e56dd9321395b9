"""Kill soak: a run killed again and again at random moments, and resumed each time, must end
bitwise like the same run left alone.

  python tools/kill_soak.py --kills 50 --data demo_data --work soak_runs [--set NAME=VALUE ...]

What it does, all through `run_and_time.sh` and a config file (default `config_CPU_1x2.sh`,
two torchrun workers), with periodic checkpoints on:
1. the baseline: one uninterrupted run; its timings (start-up, step, eval) pace the kills;
2. the soak: the same run, killed `--kills` times. Each kill aims at a moment, in rounds of four
   that cover start-up, a training step, a checkpoint write and an eval in random order, and
   sends SIGKILL (three kills of four) or SIGTERM (one of four) to every process of the job at
   once (the shell, torchrun's agent, the workers), as a cluster that preempts a job does.
   After each kill the job starts again with RESUME_FROM_CHECKPOINT=auto; a kill before the
   first checkpoint leaves nothing to resume, so the folder is cleared and the run starts over.
   Kill i waits until the run has checkpointed i/(kills+1) of the samples up to the baseline's
   last eval before its end, so the kills spread over the run and leave its end to finish;
3. the verdict: the last checkpoint (weights, optimizer, loss scaler, train state, data
   position) equal bitwise to the baseline's, and every eval accuracy in the soak's MLPerf log
   equal to the baseline's at the same sample count, with the same eval points.

Which moment a kill hit is read from what the trainer leaves, not from the aim: a checkpoint
temporary file (`.ckpt-*.pt.tmp-<pid>`) means a checkpoint write; an `eval_start` of this
attempt without its `eval_stop` means an eval; no `init_start` of this attempt in the MLPerf log
yet means the launch (imports, rendezvous, process group); `init_start` but no `block_start` or
`eval_start` yet means the initialisation (data, model, checkpoint load); anything else a
training step. For SIGKILL the files are read after the kill (the processes are gone, so they
are frozen at the moment of death); for SIGTERM, which the trainer answers with a checkpoint,
just before it.

The checkpoint folder is watched with inotify, so a kill aimed at a write lands within a fraction
of a millisecond of the temporary file's creation. Exit code 0: every kill done, the last
attempt ended by itself with exit 0, and the result is bitwise equal; 1 otherwise, with the
differences named. `--report FILE` writes everything measured as JSON.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from mlperf_bert.config.batch_size import config_batch
from mlperf_bert.runtime.files import output_file

REPO = Path(__file__).resolve().parents[3]  # tools/mlperf_tools/<kind>/<module>.py: the tools work on a checkout
MLLOG_TOKEN = ":::MLLOG "
TEMP_CHECKPOINT = re.compile(r"\.ckpt-(\d{12,})\.pt\.tmp-\d+")
CHECKPOINT = re.compile(r"ckpt-(\d{12,})\.pt")
TARGETS = ("startup", "step", "checkpoint", "eval")
COMPARED_PARTS = ("model", "optimizer", "scaler", "train_state", "data")
POLL_S = 0.002
SIGTERM_EXIT_LIMIT_S = 120.0  # a job told to stop must be gone by then (torchrun's own grace is 30 s)


# ---------------------------------------------------------------------------------------------
# Reading what a run leaves


def mllog_events(path: Path, offset: int = 0) -> list[dict[str, Any]]:
    """The MLPerf log's events from byte `offset` on (a line cut by a kill is skipped)."""
    if not path.exists():
        return []
    with open(path, "rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    events = []
    for line in text.splitlines():
        if MLLOG_TOKEN in line:
            try:
                events.append(json.loads(line.split(MLLOG_TOKEN, 1)[1]))
            except json.JSONDecodeError:
                continue
    return events


def checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """Finished checkpoints (samples, path), oldest first."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := CHECKPOINT.fullmatch(p.name))]
    return sorted(found)


def temp_checkpoints(folder: Path) -> set[str]:
    """Names of the checkpoints being written (or left half-written by a kill)."""
    if not folder.is_dir():
        return set()
    return {p.name for p in folder.iterdir() if TEMP_CHECKPOINT.fullmatch(p.name)}


class LogTail:
    """The events of an MLPerf log from a byte offset on, read incrementally (whole lines only)."""

    def __init__(self, path: Path, offset: int) -> None:
        self.path, self.offset = path, offset
        self.events: list[dict[str, Any]] = []
        self.keys: set[str] = set()

    def update(self) -> "LogTail":
        if not self.path.exists():
            return self
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        whole = data[:data.rfind(b"\n") + 1]
        self.offset += len(whole)
        for line in whole.decode(errors="replace").splitlines():
            if MLLOG_TOKEN in line:
                try:
                    event = json.loads(line.split(MLLOG_TOKEN, 1)[1])
                except json.JSONDecodeError:
                    continue
                self.events.append(event)
                self.keys.add(event["key"])
        return self


def open_eval(events: Sequence[dict[str, Any]]) -> int | None:
    """The sample count of an eval started and not finished in these events, or None."""
    marks = [e for e in events if e["key"] in ("eval_start", "eval_stop")]
    return int(marks[-1]["metadata"]["epoch_num"]) if marks and marks[-1]["key"] == "eval_start" else None


def moment(run_dir: Path, log_offset: int, stale: set[str]) -> str:
    """What the job was doing, from what it left (module docstring); `stale`: temporary
    checkpoint files an earlier attempt left, which are no evidence of this one."""
    if temp_checkpoints(run_dir / "checkpoints") - stale:
        return "checkpoint write"
    events = mllog_events(run_dir / "mlperf.log", log_offset)
    keys = {e["key"] for e in events}
    if "init_start" not in keys:
        return "launch"
    if not keys & {"block_start", "eval_start"}:
        return "init"
    return "eval" if open_eval(events) is not None else "step"


def eval_accuracies(log: Path) -> dict[int, list[float]]:
    """Every logged eval accuracy by sample count (a re-done eval adds a value)."""
    found: dict[int, list[float]] = {}
    for event in mllog_events(log):
        if event["key"] == "eval_accuracy":
            found.setdefault(int(event["metadata"]["epoch_num"]), []).append(event["value"])
    return found


def run_stop_status(log: Path) -> str | None:
    stops = [e for e in mllog_events(log) if e["key"] == "run_stop"]
    return stops[-1]["metadata"].get("status") if stops else None


def differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Where two nested checkpoint parts differ (tensors compared bitwise, dtype included)."""
    if type(a) is not type(b):
        return [f"{where}: {type(a).__name__} vs {type(b).__name__}"]
    if isinstance(a, torch.Tensor):
        same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [f"{where}: tensors differ"]
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(map(str, a.keys() ^ b.keys()))} in one only"]
        return [d for key in a for d in differences(a[key], b[key], f"{where}/{key}")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} vs {b!r}"]


def compare_runs(baseline: Path, soak: Path) -> list[str]:
    """Why the soak's result is not the baseline's (empty: bitwise equal)."""
    problems = []
    ends = [checkpoints(d / "checkpoints") for d in (baseline, soak)]
    if not ends[0] or not ends[1]:
        return ["a run has no checkpoint"]
    (base_samples, base_path), (soak_samples, soak_path) = ends[0][-1], ends[1][-1]
    if base_samples != soak_samples:
        problems.append(f"last checkpoints at {base_samples} and {soak_samples} samples")
    base, other = (torch.load(p, map_location="cpu", weights_only=True) for p in (base_path, soak_path))
    for part in COMPARED_PARTS:
        problems += differences(base.get(part), other.get(part), part)
    base_evals, soak_evals = eval_accuracies(baseline / "mlperf.log"), eval_accuracies(soak / "mlperf.log")
    if base_evals.keys() != soak_evals.keys():
        problems.append(f"eval points {sorted(base_evals)} vs {sorted(soak_evals)}")
    for samples, values in soak_evals.items():
        expected = base_evals.get(samples, [None])[0]
        if any(v != expected for v in values):
            problems.append(f"eval at {samples} samples: {values} vs {expected}")
    for name, folder in (("baseline", baseline), ("soak", soak)):
        if run_stop_status(folder / "mlperf.log") is None:
            problems.append(f"the {name} MLPerf log has no run_stop")
    return problems


# ---------------------------------------------------------------------------------------------
# The job and its processes


def _children() -> dict[int, list[int]]:
    """Parent pid -> child pids of every live (not zombie) process."""
    tree: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if state != "Z":
            tree.setdefault(int(ppid), []).append(int(entry.name))
    return tree


def descendants(pid: int) -> list[int]:
    tree, found, todo = _children(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def become_subreaper() -> None:
    """Orphans of a killed job become this process's children, so none escapes the kill.

    torchrun starts its workers in sessions of their own: a signal to the job's process group
    misses them, and a killed agent would leave them running.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def reap_orphans(keep: int) -> None:
    """Collects the exit status of adopted processes (all but `keep`, which Popen waits for)."""
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != keep:
            try:
                stat = Path(entry.path, "stat").read_text()
                if stat.rsplit(")", 1)[1].split()[1] == str(os.getpid()):
                    os.waitpid(int(entry.name), os.WNOHANG)
            except (OSError, ChildProcessError):
                continue


class DirWatch:
    """Names created in one folder, from inotify (no polling gap to slip through)."""

    IN_CREATE = 0x100
    HEADER = struct.Struct("iIII")

    def __init__(self, folder: Path) -> None:
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0 or self.libc.inotify_add_watch(self.fd, bytes(folder), self.IN_CREATE) < 0:
            raise OSError(ctypes.get_errno(), f"inotify on {folder} failed")

    def created(self, timeout_s: float) -> list[str]:
        if not select.select([self.fd], [], [], timeout_s)[0]:
            return []
        data, names, at = os.read(self.fd, 65536), [], 0
        while at < len(data):
            _, _, _, length = self.HEADER.unpack_from(data, at)
            at += self.HEADER.size
            names.append(data[at:at + length].rstrip(b"\0").decode(errors="replace"))
            at += length
        return names

    def close(self) -> None:
        os.close(self.fd)


@dataclass
class Job:
    """One `run_and_time.sh` launch with the config file and overrides."""

    proc: subprocess.Popen
    started: float
    known: dict[int, int] = field(default_factory=dict)  # pid -> pidfd of the job's processes at the last look

    @classmethod
    def start(cls, config: Path, overrides: dict[str, str], logs: Path) -> "Job":
        script = 'set -a; source "$0"; set +a; for kv in "$@"; do export "$kv"; done; exec "$RUN_AND_TIME"'
        command = ["bash", "-c", script, str(config), *(f"{k}={v}" for k, v in overrides.items())]
        env = {**os.environ, "RUN_AND_TIME": str(REPO / "run_and_time.sh"), "PYTHON": sys.executable}
        with open(logs.with_suffix(".out"), "w") as out, open(logs.with_suffix(".err"), "w") as err:
            proc = subprocess.Popen(command, env=env, cwd=REPO, stdout=out, stderr=err, start_new_session=True)
        return cls(proc, time.monotonic())

    def alive(self) -> bool:
        return self.proc.poll() is None

    def look(self) -> None:
        """Holds a pidfd of each process of the job: a kill needs no /proc scan then, and a
        pidfd never reaches another process that reused the number."""
        for pid in descendants(self.proc.pid):
            if pid not in self.known:
                try:
                    self.known[pid] = os.pidfd_open(pid)
                except OSError:
                    continue

    def signal_all(self, sig: signal.Signals) -> None:
        """`sig` once to every process of the job, the shell last (it only waits)."""
        for fd in self.known.values():
            try:
                signal.pidfd_send_signal(fd, sig)
            except ProcessLookupError:
                pass
        for pid in [*descendants(self.proc.pid)[::-1], self.proc.pid]:
            if pid not in self.known:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass

    def forget(self) -> None:
        for fd in self.known.values():
            os.close(fd)
        self.known.clear()

    def kill_everything(self) -> None:
        """SIGKILL until no process of the job (or adopted from it) is left."""
        deadline = time.monotonic() + 30
        while self.alive() or descendants(os.getpid()):
            self.signal_all(signal.SIGKILL)
            for pid in descendants(os.getpid()):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            reap_orphans(self.proc.pid)
            if time.monotonic() > deadline:
                raise RuntimeError("processes of a killed job are still alive after 30 s")
            time.sleep(0.01)
        self.proc.wait()
        reap_orphans(self.proc.pid)
        self.forget()

    def wait(self, timeout_s: float) -> int | None:
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None
        reap_orphans(self.proc.pid)
        return code


# ---------------------------------------------------------------------------------------------
# Waiting for a moment


@dataclass(frozen=True)
class Pace:
    """The baseline's timings, which place the kills."""

    startup_s: float  # launch to the first training block
    step_s: float
    eval_s: float
    samples: int  # where the run ends
    kill_span: int  # the last eval point before the end: the kills are spread up to it
    eval_points: tuple[int, ...]  # the evals up to kill_span, the ones a kill may aim at


@dataclass
class Kill:
    index: int
    target: str  # what the kill waited for (an eval already passed for good turns into a step)
    signal: str
    planned: str = ""  # the plan's target
    moment: str = ""
    exit_code: int | None = None
    after_s: float = 0.0  # from the launch to the signal
    resumed_from: int | None = None  # samples of the checkpoint the attempt resumed from; None: fresh


class Soak:
    """The soak's state: the run folder, the job of the current attempt, the random choices."""

    def __init__(self, args: argparse.Namespace, overrides: dict[str, str], pace: Pace) -> None:
        self.args, self.overrides, self.pace = args, overrides, pace
        self.rng = random.Random(args.seed)
        self.run_dir = args.work / "soak"
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.attempts = 0
        self.fresh_starts = 0
        self.resumes = 0  # attempts that continued from a checkpoint
        self.stale: set[str] = set()  # temporary checkpoint files left before this attempt
        self.kills: list[Kill] = []

    def plan(self) -> list[tuple[str, signal.Signals]]:
        """Rounds of four kills: each target once, and SIGTERM once, in random order."""
        plan: list[tuple[str, signal.Signals]] = []
        while len(plan) < self.args.kills:
            targets = list(TARGETS)
            signals = [signal.SIGKILL] * 3 + [signal.SIGTERM]
            self.rng.shuffle(targets)
            self.rng.shuffle(signals)
            plan += zip(targets, signals)
        return plan[:self.args.kills]

    def launch(self) -> tuple[Job, int, int | None]:
        """The next attempt: resumed from the newest checkpoint, or fresh in a cleared folder."""
        found = checkpoints(self.ckpt_dir)
        if not found and self.run_dir.exists():
            shutil.rmtree(self.run_dir)  # killed before its first checkpoint: nothing to resume
            self.fresh_starts += 1
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        log = self.run_dir / "mlperf.log"
        offset = log.stat().st_size if log.exists() else 0
        self.attempts += 1
        self.resumes += bool(found)
        self.stale = temp_checkpoints(self.ckpt_dir)
        overrides = {**self.overrides, "OUTPUT_DIR": str(self.run_dir), "RESUME_FROM_CHECKPOINT": "auto"}
        job = Job.start(self.args.config, overrides, self.args.work / f"attempt_{self.attempts:03d}")
        return job, offset, found[-1][0] if found else None

    def floor(self, index: int) -> int:
        """Kill `index` (1-based) waits for this many checkpointed samples: the kills spread up to
        the last eval before the end (a kill aimed at that eval, or a stop signal, near the end
        would let the run finish before the kills are spent)."""
        return self.pace.kill_span * index // (self.args.kills + 1)

    def _wait(self, job: Job, ready: Callable[[], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        looked = 0.0
        while not ready():
            if not job.alive() or time.monotonic() > deadline:
                return False
            if time.monotonic() - looked > 0.2:
                job.look()
                looked = time.monotonic()
            time.sleep(POLL_S)
        return True

    def _progress(self) -> int:
        found = checkpoints(self.ckpt_dir)
        return found[-1][0] if found else 0

    def reach(self, job: Job, target: str, floor: int, offset: int) -> bool:
        """Waits for the moment to kill at (True), or the job's end (False)."""
        timeout = self.args.attempt_timeout
        log = self.run_dir / "mlperf.log"
        if target == "startup":
            delay = self.rng.uniform(0, self.pace.startup_s)
            return self._wait(job, lambda: time.monotonic() - job.started >= delay, timeout)
        if target == "checkpoint":
            return self._wait_checkpoint_write(job, floor, timeout)
        tail = LogTail(log, offset)
        if target == "eval":
            point = self.eval_point(floor)
            if not self._wait(job, lambda: open_eval(tail.update().events) == point, timeout):
                return False
            delay = self.rng.uniform(0, 0.8 * self.pace.eval_s)
        else:
            started = lambda: bool({"block_start", "eval_start"} & tail.update().keys)
            if not self._wait(job, lambda: self._progress() >= floor and started(), timeout):
                return False
            delay = self.rng.uniform(0, self.pace.step_s)
        time.sleep(delay)
        return job.alive()

    def eval_point(self, floor: int) -> int | None:
        """The eval a kill with this floor aims at: the first eval point at or after it."""
        return next((p for p in self.pace.eval_points if p >= floor), None)

    def aim(self, planned: str, floor: int) -> str:
        """The target for this attempt: an eval the run has passed for good (its newest checkpoint
        lies beyond it, so no resume repeats it) or none left before the end makes it a step, so
        that the run does not race ahead of the kills still to come."""
        if planned == "eval":
            point = self.eval_point(floor)
            if point is None or self._progress() > point:
                return "step"
        return planned

    def _wait_checkpoint_write(self, job: Job, floor: int, timeout_s: float) -> bool:
        watch = DirWatch(self.ckpt_dir)
        try:
            deadline = time.monotonic() + timeout_s
            while job.alive() and time.monotonic() < deadline:
                job.look()
                for name in watch.created(0.2):
                    m = TEMP_CHECKPOINT.fullmatch(name)
                    if m and int(m.group(1)) >= floor:
                        return True
            return False
        finally:
            watch.close()

    def kill(self, job: Job, index: int, target: str, sig: signal.Signals, offset: int) -> Kill:
        kill = Kill(index, target, sig.name, after_s=round(time.monotonic() - job.started, 3))
        if sig == signal.SIGTERM:
            kill.moment = moment(self.run_dir, offset, self.stale)
            job.signal_all(sig)
            code = job.wait(SIGTERM_EXIT_LIMIT_S)
            if code is None:
                raise RuntimeError(f"kill {index}: the job did not exit within {SIGTERM_EXIT_LIMIT_S:.0f} s "
                                   "of SIGTERM (a hang)")
            kill.exit_code = code
            job.kill_everything()  # nothing should be left; this makes sure
        else:
            job.signal_all(sig)
            job.kill_everything()
            kill.moment = moment(self.run_dir, offset, self.stale)
            kill.exit_code = job.proc.returncode
        return kill

    def run(self) -> int:
        """Kills, resumes, and finally lets the run end; the last attempt's exit code."""
        for index, (planned, sig) in enumerate(self.plan(), start=1):
            target = self.aim(planned, self.floor(index))
            job, offset, resumed_from = self.launch()
            if not self.reach(job, target, self.floor(index), offset):
                code = job.wait(self.args.attempt_timeout)
                job.kill_everything()
                raise RuntimeError(f"kill {index} ({target}): the run ended (exit {code}) before the moment "
                                   f"came; see {self.args.work}/attempt_{self.attempts:03d}.err")
            kill = self.kill(job, index, target, sig, offset)
            kill.resumed_from, kill.planned = resumed_from, planned
            self.kills.append(kill)
            print(f"kill {index:3d}: {sig.name:7s} aimed at {target:10s} hit {kill.moment:16s} "
                  f"{kill.after_s:6.2f} s after launch, exit {kill.exit_code}", flush=True)
        job, _, _ = self.launch()
        code = job.wait(self.args.attempt_timeout)
        job.kill_everything()
        return -1 if code is None else code


# ---------------------------------------------------------------------------------------------
# The baseline


def run_baseline(args: argparse.Namespace, overrides: dict[str, str]) -> Pace:
    """The uninterrupted run, and the timings of its phases."""
    out = args.work / "baseline"
    if out.exists():
        shutil.rmtree(out)
    launched = time.time()
    job = Job.start(args.config, {**overrides, "OUTPUT_DIR": str(out)}, args.work / "baseline")
    code = job.wait(args.attempt_timeout)
    job.kill_everything()
    if code != 0:
        raise RuntimeError(f"the baseline run failed (exit {code}); see {args.work}/baseline.err")
    events = mllog_events(out / "mlperf.log")
    first = {e["key"]: e["time_ms"] / 1000 for e in reversed(events)}  # the first time of each key
    evals = [e for e in events if e["key"] in ("eval_start", "eval_stop")]
    eval_s = [(b["time_ms"] - a["time_ms"]) / 1000 for a, b in zip(evals[::2], evals[1::2])]
    end = checkpoints(out / "checkpoints")[-1]
    state = torch.load(end[1], map_location="cpu", weights_only=True)["train_state"]
    steps = max(int(state["step"]), 1)
    train_s = first.get("run_stop", first["run_start"]) - first["run_start"] - sum(eval_s)
    points = sorted({int(e["metadata"]["epoch_num"]) for e in events if e["key"] == "eval_accuracy"})
    before_end = [p for p in points if p < end[0]]
    return Pace(startup_s=first["block_start"] - launched, step_s=max(train_s / steps, 0.001),
                eval_s=sum(eval_s) / max(len(eval_s), 1), samples=end[0],
                kill_span=before_end[-1] if before_end else end[0], eval_points=tuple(before_end))


# ---------------------------------------------------------------------------------------------
# Command line


def make_demo_data(config: Path, data: Path) -> None:
    """The config's demo dataset (tools/run_demo.sh --data-only), when `data` holds no dataset."""
    if (data / ".complete").exists() or all((data / part).exists() for part in ("train", "eval", "bert_config.json")):
        return
    env = {**os.environ, "DEMO_DATA": str(data), "DEMO_CONFIG": str(config), "PYTHON": sys.executable}
    subprocess.run(["bash", str(REPO / "tools" / "run_demo.sh"), "--data-only"], env=env, check=True)


def parse_overrides(pairs: Sequence[str]) -> dict[str, str]:
    found = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise SystemExit(f"error: --set {pair!r}: give NAME=VALUE with a config variable's name")
        found[name] = value
    return found


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=50, help="how many times the run is killed (default 50)")
    parser.add_argument("--config", type=Path, default=REPO / "config_CPU_1x2.sh", help="the config file")
    parser.add_argument("--data", type=Path, required=True,
                        help="demo data folder (train/, eval/, bert_config.json); made with the config's "
                             "DEMO_* sizes when it holds none")
    parser.add_argument("--work", type=Path, required=True, help="folder for the runs and their logs")
    parser.add_argument("--checkpoint_every_samples", type=int, default=0,
                        help="CHECKPOINT_EVERY_SAMPLES of both runs (default: two global batches)")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="a config variable for both runs (repeatable), e.g. --set BATCHSIZE=8")
    parser.add_argument("--seed", type=int, default=1, help="seed of the kill plan and its delays")
    parser.add_argument("--attempt_timeout", type=float, default=900.0, help="seconds one attempt may take")
    parser.add_argument("--report", type=output_file, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    if args.kills < 0:
        parser.error("--kills must be >= 0")
    return args


def run_overrides(args: argparse.Namespace) -> dict[str, str]:
    """The config variables both runs get besides the config file's."""
    overrides = {"DATADIR_PHASE2": str(args.data / "train"), "EVALDIR": str(args.data / "eval"),
                 "BERT_CONFIG": str(args.data / "bert_config.json"), "INIT_CHECKPOINT": "none",
                 "SEED": "1", "ECHO_MLLOG": "0", "KEEP_CHECKPOINTS": "2", **parse_overrides(args.set)}
    every = args.checkpoint_every_samples
    if every <= 0:
        config = dict(re.findall(r"^export (\w+)=(\S*)", args.config.read_text(), re.M))
        merged = {**config, **overrides}
        every = 2 * config_batch(merged, args.config.name).global_batch_size
    overrides["CHECKPOINT_EVERY_SAMPLES"] = str(every)
    return overrides


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.work = args.work.resolve()
    args.data = args.data.resolve()
    args.config = args.config.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    become_subreaper()
    make_demo_data(args.config, args.data)
    overrides = run_overrides(args)
    began = time.monotonic()
    pace = run_baseline(args, overrides)
    baseline_s = time.monotonic() - began
    print(f"baseline: {pace.samples} samples in {baseline_s:.0f} s (start-up {pace.startup_s:.1f} s, "
          f"step {pace.step_s:.3f} s, eval {pace.eval_s:.2f} s)", flush=True)
    soak = Soak(args, overrides, pace)
    soak_began = time.monotonic()
    problems: list[str] = []
    try:
        last_code = soak.run()
    except RuntimeError as err:
        problems.append(str(err))
        last_code = None
    soak_s = time.monotonic() - soak_began
    if last_code is not None and last_code != 0:
        problems.append(f"the last attempt exited with {last_code}; see {args.work}/attempt_{soak.attempts:03d}.err")
    if not problems:
        problems = compare_runs(args.work / "baseline", soak.run_dir)
    report = summary(args, soak, pace, baseline_s, soak_s, problems)
    if args.report:
        args.report.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{len(soak.kills)} kills ({dict(report['signals'])}), moments hit {dict(report['moments'])}, "
          f"{report['resumes']} resumes from a checkpoint, {soak.fresh_starts} fresh starts, "
          f"{soak.attempts} attempts in {soak_s:.0f} s (baseline {baseline_s:.0f} s)")
    if problems:
        print("NOT EQUAL to the uninterrupted run:\n  " + "\n  ".join(problems[:20]), file=sys.stderr)
        return 1
    print(f"bitwise equal to the uninterrupted run: final checkpoint at {pace.samples} samples "
          f"({', '.join(COMPARED_PARTS)}) and {report['eval_points']} eval accuracies")
    return 0


def summary(args: argparse.Namespace, soak: Soak, pace: Pace, baseline_s: float, soak_s: float,
            problems: list[str]) -> dict[str, Any]:
    evals = eval_accuracies(args.work / "baseline" / "mlperf.log")
    return {
        "kills": len(soak.kills), "planned_kills": args.kills, "attempts": soak.attempts,
        "signals": Counter(k.signal for k in soak.kills), "planned": Counter(k.planned for k in soak.kills),
        "targets": Counter(k.target for k in soak.kills),
        "moments": Counter(k.moment for k in soak.kills),
        "exit_codes": Counter(str(k.exit_code) for k in soak.kills),
        "resumes": soak.resumes,
        "fresh_starts": soak.fresh_starts, "baseline_seconds": round(baseline_s, 1),
        "soak_seconds": round(soak_s, 1), "pace": asdict(pace), "eval_points": len(evals),
        "equal": not problems, "problems": problems, "kill_log": [asdict(k) for k in soak.kills],
        "config": str(args.config), "seed": args.seed,
    }


if __name__ == "__main__":
    sys.exit(main())
