"""Output paths of the command-line tools: resolved and checked before any work, written atomically.

Every tool (crisp-profile, crisp-eval, crisp-bench, the evidence report) calls :func:`check_outputs`
with all its output options and all its inputs before it loads a model, so that a bad output path
costs nothing and no output can destroy an input. An output is refused when it

- is an existing folder, or its folder does not exist, is not writable or is on a read-only
  file system;
- is an existing file marked read-only (the user's choice is respected, not overridden);
- is an input (the same file, also through a symlink or a hard link);
- lies inside an input folder (a model checkpoint, a pack, a saved dataset), at any depth;
- lies inside a CRISP pack folder (one holding ``pack.json``), input or not: a pack's files are
  written only by the pack writers, as a whole;
- is given to two output options at once.

Writes go through :func:`write_atomic`: a temporary file in the destination folder, fsync, then
``os.replace``, so an interrupted run leaves the old file or none, never half a file, and a reader
that has the old file mapped (safetensors, numpy) keeps its pages.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable, Mapping
from pathlib import Path

PathLike = str | os.PathLike

# New files get ordinary permissions (mkstemp creates 0600): rw for the owner, readable by all.
NEW_FILE_MODE = 0o644


class OutputPathError(ValueError):
    """An output path that cannot be written, or whose writing would destroy an input."""


def _pack_info_name() -> str:
    from crisp_runtime.storage.pack import INFO_FILE

    return INFO_FILE


def _as_paths(value) -> list[Path]:
    if value is None:
        return []
    if isinstance(value, (str, os.PathLike)):
        return [Path(value)]
    return [Path(v) for v in value if v is not None]


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return a == b


def _is_within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _read_only_fs(folder: Path) -> bool:
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        return False


def check_writable_folder(option: str, folder: PathLike) -> None:
    """Refuse a folder that cannot take new files (missing, not writable, on a read-only file system)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise OutputPathError(f"{option}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or _read_only_fs(folder):
        raise OutputPathError(f"{option}: folder {folder} is not writable")


def check_output(option: str, path: PathLike) -> Path:
    """The resolved path of one output, checked to be writable (see the module docstring)."""
    given = Path(path).expanduser()
    if str(path) == "":
        raise OutputPathError(f"{option}: empty path")
    if given.is_dir():
        raise OutputPathError(f"{option} {path}: is a folder; give a file path")
    resolved = given.resolve()  # follows symlinks: a link onto an input is that input
    if resolved.is_dir():
        raise OutputPathError(f"{option} {path}: is (a link to) a folder; give a file path")
    parent = resolved.parent
    check_writable_folder(f"{option} {path}", parent)
    if resolved.exists():
        mode = resolved.stat().st_mode
        if not stat.S_ISREG(mode):
            raise OutputPathError(f"{option} {path}: exists and is not a regular file")
        if not mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH):
            raise OutputPathError(f"{option} {path}: the file is read-only; refusing to replace it")
    for folder in (parent, *parent.parents):
        if (folder / _pack_info_name()).is_file():
            raise OutputPathError(f"{option} {path}: lies inside the CRISP pack folder {folder}; "
                                  f"write it elsewhere (pack files are written only by crisp-profile)")
    return resolved


def check_outputs(outputs: Mapping[str, PathLike | None], inputs: Mapping[str, object] | None = None
                  ) -> dict[str, Path]:
    """Check every output option against the file system and against every input.

    ``outputs``: {option name: path or None (not given)}; ``inputs``: {option name: a path, a list
    of paths or None}; an input that is a folder protects everything inside it. Returns
    {option: resolved path} for the outputs given. Raises :class:`OutputPathError` naming the
    option and the input it would destroy.
    """
    resolved: dict[str, Path] = {}
    for option, path in outputs.items():
        if path is None:
            continue
        out = check_output(option, path)
        for other, seen in resolved.items():
            if _same_file(out, seen):
                raise OutputPathError(f"{option} {path}: the same file as {other}; give two different paths")
        for in_option, value in (inputs or {}).items():
            for src in _as_paths(value):
                src_resolved = src.expanduser().resolve()
                if src_resolved.is_dir():
                    if _is_within(out, src_resolved):
                        raise OutputPathError(f"{option} {path}: lies inside the input {in_option} {src}; "
                                              f"refusing to write into an input folder")
                elif _same_file(out, src_resolved):
                    raise OutputPathError(f"{option} {path}: is the input {in_option}; refusing to overwrite it")
        resolved[option] = out
    return resolved


def check_not_input_folder(option: str, folder: PathLike, inputs: Mapping[str, object]) -> Path:
    """For an output *folder* (a pack, a work folder): refuse one that is, contains or lies inside
    an input (file or folder). Returns the absolute, resolved folder path."""
    out = Path(folder).expanduser().resolve()
    for in_option, value in inputs.items():
        for src in _as_paths(value):
            src_resolved = src.expanduser().resolve()
            if _is_within(out, src_resolved) or _is_within(src_resolved, out):
                how = ("is" if out == src_resolved else "lies inside" if _is_within(out, src_resolved)
                       else "contains")
                raise OutputPathError(f"{option} {folder}: {how} the input {in_option} {src}; choose another folder")
    return out


# ----------------------------------------------------------------------------- atomic writers


def write_atomic(path: PathLike, write: Callable[[str], None]) -> None:
    """Call ``write(tmp)`` on a temporary file beside ``path``, fsync, and rename it onto ``path``.

    An existing file keeps its permission bits; a new one gets ``NEW_FILE_MODE``.
    """
    from crisp_kernels.io import atomic_write

    path = Path(path)
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError:
        mode = NEW_FILE_MODE

    def write_with_mode(tmp: str) -> None:
        write(tmp)
        os.chmod(tmp, mode)

    atomic_write(path, write_with_mode)


def write_bytes(path: PathLike, data: bytes) -> None:
    write_atomic(path, lambda tmp: Path(tmp).write_bytes(data))


def write_text(path: PathLike, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def write_json(path: PathLike, data, *, indent: int = 1, allow_nan: bool = False) -> None:
    """Strict JSON (no NaN unless allowed) with a final newline, written atomically."""
    write_text(path, json.dumps(data, indent=indent, allow_nan=allow_nan) + "\n")


__all__ = ["OutputPathError", "check_writable_folder", "check_output", "check_outputs", "check_not_input_folder",
           "write_atomic", "write_bytes", "write_text", "write_json", "NEW_FILE_MODE"]
