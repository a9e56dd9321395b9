"""The config variables behind the trainer's flags, for error lines a config-file user can act on.

`run_and_time.sh` turns each variable of a `config_<SYSTEM>.sh` file into one trainer flag
(`BATCHSIZE` -> `--train_batch_size`) and hands its table over in `MLPERF_BERT_FLAG_VARIABLES`
as space-separated `NAME=--flag` entries. Someone who ran a config file knows its variables, not
the flags, so an error line that names flags ends with the variable and value behind each:

    error: --cuda_graphs needs static shapes: use it with --input_layout packed
    (config: --cuda_graphs is CUDA_GRAPHS=1, --input_layout is INPUT_LAYOUT=unpadded)

(one line). The values are read back from the trainer's own argv, so they are what the trainer
got: a switch is `=1` when given and `=0` when not; a value flag that was not given is "unset".
Without the environment variable (the trainer started by hand) messages stay as they are.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Collection, Mapping, Sequence

from .settings import ConfigError

ENV_VARIABLE = "MLPERF_BERT_FLAG_VARIABLES"
_ENTRY = re.compile(r"([A-Z][A-Z0-9_]*)=(--[a-z][a-z0-9_]*)")
_FLAG_IN_TEXT = re.compile(r"--[a-z][a-z0-9_]*(?![a-z0-9_-])")


@dataclass(frozen=True)
class FlagVariables:
    """flag ("--cuda_graphs") -> config variable ("CUDA_GRAPHS"), and which flags are switches."""

    variables: Mapping[str, str]
    switches: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, text: str, flags: Collection[str], switches: Collection[str]) -> FlagVariables:
        """Reads `NAME=--flag ...`; flags: the trainer's flags (a table naming another is a launcher bug)."""
        variables: dict[str, str] = {}
        for entry in text.split():
            match = _ENTRY.fullmatch(entry)
            if match is None:
                raise ConfigError(f"{ENV_VARIABLE}: entry {entry!r} is not NAME=--flag; fix the launcher's table")
            name, flag = match.groups()
            if flag not in flags:
                raise ConfigError(f"{ENV_VARIABLE}: {name}={flag} names no trainer flag; fix the launcher's table")
            variables[flag] = name
        return cls(variables, frozenset(switches))

    @classmethod
    def from_environ(cls, environ: Mapping[str, str], flags: Collection[str],
                     switches: Collection[str]) -> FlagVariables:
        """The launcher's table, or an empty one when the trainer was started without it."""
        return cls.parse(environ.get(ENV_VARIABLE, ""), flags, switches)

    def annotate(self, message: str, argv: Sequence[str]) -> str:
        """`message`, plus the config variable and value of each table flag it names (in order)."""
        named = [flag for flag in dict.fromkeys(_FLAG_IN_TEXT.findall(message)) if flag in self.variables]
        if not named:
            return message
        notes = ", ".join(f"{flag} is {self._setting(flag, argv)}" for flag in named)
        return f"{message} (config: {notes})"

    def _setting(self, flag: str, argv: Sequence[str]) -> str:
        name = self.variables[flag]
        if flag in self.switches:
            return f"{name}={int(flag in argv)}"
        value = given_value(flag, argv)
        return f"{name} unset" if value is None else f"{name}={shlex.quote(value)}"


def given_value(flag: str, argv: Sequence[str]) -> str | None:
    """The value of the last `flag VALUE` or `flag=VALUE` in argv, as argparse takes it; None if absent."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(f"{flag}="):
            value = arg[len(flag) + 1:]
    return value
