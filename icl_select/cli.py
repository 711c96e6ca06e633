"""What every stage shares: `run_cli(main, Args)` parses the flags of `Args` with tyro, opens --help with the first line
of the stage's docstring, sets --threads, and ends bad input, Ctrl-C or a full disk in one line.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import shlex
import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass

import tyro
from tqdm import tqdm


@dataclass
class CpuArgs:
    """The CPU thread count of a stage (every stage that computes with torch has it)."""

    threads: int = 1
    """torch CPU threads (1: the same bytes on every machine; docs/speed.md)."""


# Flags that name places, not settings: a resumed run compares what they hold (the data's digest, the --init
# weights' hash), so a moved run, dataset or init folder still resumes.
PATH_ARGS = ("out", "data", "init")


# ----------------------------------------------------------------------------------------------------------------------
# What a flag's declaration says besides its type, default and help: markers in its Annotated[...], read by `marked`.


@dataclass(frozen=True)
class Side:
    """A flag that changes what is kept, shown or how a run is started, never what is trained: a resumed run may change
    it freely, it is no input of what the run makes (lineage.py), and compare.py does not list it."""


SIDE = Side()


@dataclass(frozen=True)
class PerMode:
    """The default of a flag left at None, by mode (grpo.py: offline or online)."""

    offline: object
    online: object


def modes(offline, online) -> tuple:
    """A flag whose default depends on the mode: its --help hint and its values, declared together
    (`Annotated[float | None, *modes(1e-4, 1e-3)] = None`)."""
    return default_is(f"{offline} offline, {online} online"), PerMode(offline, online)


@dataclass(frozen=True)
class Named:
    """How a flag names a run's default output folder where its value is not its default: a format of the value
    ("lr{:g}"), or a function of it."""

    name: str | Callable[[object], str]

    def of(self, value) -> str:
        return self.name.format(value) if isinstance(self.name, str) else self.name(value)


def marked(cls: type, kind: type) -> dict[str, object]:
    """Each field of the dataclass `cls` declared with a marker of `kind`, in declaration order: name -> the marker."""
    hints = typing.get_type_hints(cls, include_extras=True)
    found = {}
    for f in dataclasses.fields(cls):
        for m in getattr(hints[f.name], "__metadata__", ()):
            if isinstance(m, kind):
                found[f.name] = m
    return found


def side_flags(cls: type) -> tuple[str, ...]:
    """The flags of `cls` marked SIDE."""
    return tuple(marked(cls, Side))


def alias(*names: str):
    """Also accept TRL's name for a flag (--learning-rate for --lr, ...) where the meaning is the same."""
    return tyro.conf.arg(aliases=names)


def default_is(text: str):
    """The default that --help shows for a flag left at None because its value depends on other flags (instead of
    tyro's "(default: None)")."""
    return tyro.conf.arg(help_behavior_hint=f"(default: {text})")


def help_first(*names: str):
    """Class decorator: --help names these flags right after what the script does (tyro lists flags in field order,
    inherited ones such as --threads and the reward weights first)."""

    def mark(cls):
        cls.most_used = names
        return cls

    return mark


def description(main: Callable, args_type: type) -> str:
    """--help's opening: the first line of the stage's module docstring, its most used flags, then the Args class's
    own docstring if it has one (the dataclass decorator writes a signature there when it has none)."""
    first = (sys.modules[main.__module__].__doc__ or "").strip().split("\n")[0]
    used = getattr(args_type, "most_used", ())
    if used:
        first += "\n\nMost used: " + ", ".join(f"--{n.replace('_', '-')}" for n in used)
    own = inspect.cleandoc(args_type.__doc__ or "")
    return first if own.startswith(f"{args_type.__name__}(") else f"{first}\n\n{own}"


def run_cli(main: Callable, args_type: type) -> None:
    """Parse flags with tyro and run `main`; bad input ends in one line on stderr and exit code 2, Ctrl-C in one
    line saying how to continue and exit code 130, no traceback. Set ICL_SELECT_DEBUG=1 to get the traceback."""
    args = tyro.cli(args_type, description=description(main, args_type))
    try:
        if isinstance(args, CpuArgs):
            if args.threads < 1:
                raise ValueError(f"--threads must be >= 1, got {args.threads}")
            import torch

            torch.set_num_threads(args.threads)
        main(args)
    except (ValueError, OSError) as e:  # OSError: a missing file, a read-only or full disk, a path through a file
        if os.environ.get("ICL_SELECT_DEBUG"):
            raise
        close_progress_bars()
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        if os.environ.get("ICL_SELECT_DEBUG"):
            raise
        close_progress_bars()
        command = " ".join(shlex.quote(a) for a in ["python", *sys.argv])  # every stage resumes when re-run as is
        print(
            f"interrupted: what finished (epochs, scored queries) is saved; continue with: {command}", file=sys.stderr
        )
        sys.exit(130)


def close_progress_bars() -> None:
    """A loop that stopped leaves its progress bar open, mid-line: close it so the message gets a line of its own."""
    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()
