"""Command-line flags (the names MLPerf BERT users know) -> `TrainConfig`.

The flags are generated from the config dataclasses: each field declared with
`config.flag(...)` is one flag, and its default, choices, help and --help section live only
there. A field's type gives the flag's: int, float, str, a switch for bool; `X | None` takes X
and defaults to None.
"""

from __future__ import annotations

import argparse
import types
import typing
from dataclasses import MISSING, Field, is_dataclass
from typing import Any, Callable, Mapping, Sequence, cast

from .settings import GROUPS, TrainConfig, flag_name, is_flag, settings_fields
from .flag_variables import FlagVariables
from ..runtime.exits import say_once


class _HelpFormatter(argparse.HelpFormatter):
    """Adds each flag's default (or "required") to its help, once; None and off switches show none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.required:
            return f"{text} (required)"
        if action.default is None or action.default is False or action.default == argparse.SUPPRESS:
            return text
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """A usage error is one line: the flag and what is wrong, not the 50-line usage first.

    annotate: adds to that line (the config variables behind the flags it names).
    """

    annotate: Callable[[str], str] = staticmethod(lambda message: message)

    def error(self, message: str) -> typing.NoReturn:
        say_once(f"error: {self.annotate(f'{message} ({self.prog} --help lists the flags)')}")
        self.exit(2)


def _value_type(kind: Any) -> type:
    """int / float / str of a field type, unwrapping `X | None`."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        kind = next(arg for arg in typing.get_args(kind) if arg is not type(None))
    return kind


def _add_flag(group: argparse._ActionsContainer, f: Field, kind: Any) -> None:
    meta, value_type = f.metadata, _value_type(kind)
    name = f"--{flag_name(f)}"
    if value_type is bool:
        group.add_argument(name, action="store_true", help=meta["help"])
        return
    options: dict[str, Any] = {"type": value_type, "help": meta["help"]}
    if f.default is MISSING and value_type is kind:
        options["required"] = True
    else:
        options["default"] = None if f.default is MISSING else f.default
    for key in ("choices", "metavar"):
        if meta[key] is not None:
            options[key] = meta[key]
    group.add_argument(name, **options)


def _flag_fields(cls: type = TrainConfig) -> list[tuple[Field, Any]]:
    """Every flag field of the config tree, depth first in declaration order."""
    found: list[tuple[Field, Any]] = []
    for f, kind in settings_fields(cls):
        if is_dataclass(kind):
            found += _flag_fields(cast(type, kind))
        elif is_flag(f):
            found.append((f, kind))
    return found


def build_parser(annotate: Callable[[str], str] | None = None) -> argparse.ArgumentParser:
    """annotate: applied to a usage error's line (`FlagVariables.annotate`)."""
    p = _Parser(
        prog="run_pretraining.py",
        description="MLPerf BERT phase-2 pretraining to a masked-LM accuracy target.",
        formatter_class=_HelpFormatter,
    )
    if annotate is not None:
        p.annotate = annotate
    groups = {title: p.add_argument_group(title) for title in GROUPS}
    exclusive: dict[str, argparse._MutuallyExclusiveGroup] = {}
    for f, kind in _flag_fields():
        group: argparse._ActionsContainer = groups[f.metadata["group"]]
        tag = f.metadata["exclusive"]
        if tag is not None:
            if tag not in exclusive:
                exclusive[tag] = groups[f.metadata["group"]].add_mutually_exclusive_group()
            group = exclusive[tag]
        _add_flag(group, f, kind)
    return p


def launcher_flag_variables(environ: Mapping[str, str]) -> FlagVariables:
    """The launcher's config-variable table (`flag_variables`), checked against the trainer's flags."""
    flags = {f"--{flag_name(f)}": _value_type(kind) for f, kind in _flag_fields()}
    switches = [flag for flag, value_type in flags.items() if value_type is bool]
    return FlagVariables.from_environ(environ, flags, switches)


def _build(cls: type, args: argparse.Namespace, world_size: int) -> Any:
    values: dict[str, Any] = {}
    for f, kind in settings_fields(cls):
        if is_dataclass(kind):
            values[f.name] = _build(cast(type, kind), args, world_size)
        elif is_flag(f):
            values[f.name] = getattr(args, flag_name(f))
    if cls is TrainConfig:
        values["world_size"] = world_size
    return cls(**values)


def config_from_args(args: argparse.Namespace, world_size: int) -> TrainConfig:
    """Builds the validated config tree; raises ConfigError naming the flag to fix."""
    return _build(TrainConfig, args, world_size)


def parse_config(argv: Sequence[str] | None, world_size: int) -> TrainConfig:
    """Flags -> config, validated from the values alone (the machine is checked by `startup`)."""
    return config_from_args(build_parser().parse_args(argv), world_size)
