"""Argument types and the parser shared by the command-line tools: every value checked at parse time.

A bad value ends the command before any work with one line, ``PROG: error: argument --OPT: ...``,
and exit code 2 (argparse's convention). The types here refuse what makes no sense for any option
of their kind (a negative count, NaN, a device that does not exist), so that no option silently
means something else.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import zlib
from pathlib import Path


class CliError(ValueError):
    """Bad input to a command-line tool: printed as one ``error: ...`` line, exit code 2. The one base class
    of the errors of every CLI (crisp-bench, crisp-profile, crisp-eval, the tools), so a command that calls
    another package's loaders still catches their refusals (two unrelated classes let one escape as a
    traceback)."""


# Seeds go to torch.Generator.manual_seed and numpy; 2**32 - 1 is the largest both take unchanged.
MAX_SEED = 2**32 - 1
# More threads than this is a typo (the largest machines have a few hundred cores); torch would
# try to start them all.
MAX_THREADS = 1024


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage block): ``PROG: error: MESSAGE`` and exit code 2."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def int_in(low: int | None = None, high: int | None = None):
    """An argparse type: an integer (no float, no bool) in [low, high]."""

    def parse(text: str) -> int:
        try:
            value = int(str(text).strip(), 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if (low is not None and value < low) or (high is not None and value > high):
            if high is None:
                want = f">= {low}"
            elif low is None:
                want = f"<= {high}"
            else:
                want = f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"expected an integer {want}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def float_in(low: float | None = None, high: float | None = None, *, low_open: bool = False,
             high_open: bool = False):
    """An argparse type: a finite float in the interval (``low_open`` / ``high_open`` exclude the ends)."""

    def parse(text: str) -> float:
        try:
            value = float(str(text).strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        bad = not math.isfinite(value)
        if low is not None:
            bad |= value <= low if low_open else value < low
        if high is not None:
            bad |= value >= high if high_open else value > high
        if bad:
            left = "(" if low_open else "["
            right = ")" if high_open else "]"
            lo = "-inf" if low is None else f"{low:g}"
            hi = "inf" if high is None else f"{high:g}"
            raise argparse.ArgumentTypeError(f"expected a finite number in {left}{lo}, {hi}{right}, got {text!r}")
        return value

    parse.__name__ = "number"
    return parse


positive_int = int_in(1)
nonnegative_int = int_in(0)
seed_int = int_in(0, MAX_SEED)
threads_int = int_in(1, MAX_THREADS)


def device_name(text: str) -> str:
    """An argparse type: ``cpu``, ``auto``, ``cuda`` or ``cuda:N`` of a GPU that exists here."""
    name = str(text).strip()
    if name in ("cpu", "auto"):
        return name
    if name == "cuda" or (name.startswith("cuda:") and name[5:].isdigit()):
        import torch

        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{name}: no CUDA device is available here (use cpu)")
        count = torch.cuda.device_count()
        if name != "cuda" and int(name[5:]) >= count:
            raise argparse.ArgumentTypeError(f"{name}: this machine has {count} CUDA device(s) (cuda:0..{count - 1})")
        return name
    raise argparse.ArgumentTypeError(f"unknown device {name!r}; choose from cpu, cuda, cuda:N, auto")


def nonempty_path(text: str) -> str:
    if not str(text).strip():
        raise argparse.ArgumentTypeError("expected a path, got an empty string")
    return text


class JsonInputError(ValueError):
    """A JSON input file that cannot be read: missing, a folder, not UTF-8, not JSON, too deep."""


def read_json(path: str | os.PathLike, what: str):
    """The parsed JSON of a local file, or :class:`JsonInputError` naming ``what`` and the path.

    Refuses a folder, a file that is not UTF-8, invalid JSON and nesting so deep that the parser
    recurses out of stack (Python's json raises RecursionError on ~100k nested brackets).
    """
    p = Path(path)
    if p.is_dir():
        raise JsonInputError(f"{what} {path}: is a folder, expected a JSON file")
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise JsonInputError(f"{what} {path}: cannot read it ({exc.strerror or exc})") from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JsonInputError(f"{what} {path}: not UTF-8 text (byte {exc.start})") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise JsonInputError(f"{what} {path}: not valid JSON ({exc.msg} at line {exc.lineno})") from exc
    except RecursionError as exc:
        raise JsonInputError(f"{what} {path}: JSON nested too deeply to read") from exc


# Errors of reading compressed or archived input (a truncated .npz or .gz): clear messages, not tracebacks.
CORRUPT_DATA_ERRORS: tuple[type[BaseException], ...] = (zlib.error, EOFError)


def add_force(p: argparse.ArgumentParser) -> None:
    """``--force``: what ``crisp_runtime.storage.outputs.check_outputs(force=...)`` takes (every command with an
    output file has it)."""
    p.add_argument("--force", action="store_true",
                   help="replace an existing output file that no CRISP tool wrote, or that holds another kind of "
                        "CRISP output (the option's own kind of output, an earlier run's, is replaced without it)")


def interrupted(prog: str, *, resumable: bool) -> int:
    """Print the one-line message of a Ctrl-C and return the shell's code for SIGINT (130)."""
    hint = "rerun the same command to resume" if resumable else "rerun the same command to start again"
    print(f"\n{prog}: interrupted; {hint}", file=sys.stderr)
    return 130


__all__ = ["Parser", "int_in", "float_in", "positive_int", "nonnegative_int", "seed_int", "threads_int",
           "device_name", "nonempty_path", "JsonInputError", "read_json", "CORRUPT_DATA_ERRORS", "interrupted",
           "MAX_SEED", "MAX_THREADS"]
