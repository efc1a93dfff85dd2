"""The checkpoint folder of a crisp-profile run: it creates and deletes only what it owns.

Layout, under the work root (``--work-dir``, default ``.<out>.crisp-work`` beside ``--out``):

    <root>/.crisp-work              marker: the root was created by crisp-profile (absent if the
                                    user gave an existing folder; then the root is never removed)
    <root>/run-<key>/stats.safetensors   checkpoint of one run (key = model, data and settings)
    <root>/run-<key>/lock           held (flock) while a run uses the folder

One folder per run key: two runs with other settings on the same ``--out`` never touch each other's
checkpoint; two runs with the same key cannot run at once (the second is refused). On success the
run removes its two files, then its folder if empty, then the root if it created it and only the
marker is left. Nothing is removed recursively, so a user file in the work root survives.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from crisp_runtime.storage.outputs import OutputPathError, check_writable_folder

from .calibration import CliError

MARKER = ".crisp-work"
LOCK = "lock"


class WorkFolder:
    def __init__(self, root: Path, run_key: str, checkpoint_name: str):
        self.root = root
        self.run_dir = root / f"run-{run_key[:16]}"
        self.checkpoint = self.run_dir / checkpoint_name
        self._lock_fd: int | None = None

    def check(self) -> None:
        """Refuse a root or run folder that exists and is not a folder (before any work)."""
        for p in (self.root, self.run_dir):
            if p.exists() and not p.is_dir():
                raise CliError(f"--work-dir {self.root}: {p} exists and is not a folder")
        try:
            check_writable_folder(f"--work-dir {self.root}", self.root if self.root.is_dir() else self.root.parent)
        except OutputPathError as exc:
            raise CliError(str(exc)) from exc

    def open(self) -> None:
        """Create what is missing (marking a root created here) and take the run's lock."""
        if not self.root.exists():
            try:
                self.root.mkdir()
            except FileExistsError:
                pass  # another run created it meanwhile; it is marked by that run
            else:
                (self.root / MARKER).write_text("created by crisp-profile; removed with the folder when empty\n")
        self.run_dir.mkdir(exist_ok=True)
        fd = os.open(self.run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise CliError(f"--work-dir {self.root}: another crisp-profile run with the same model, data and "
                           f"settings is using {self.run_dir}; wait for it to finish") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def release(self) -> None:
        """Let go of the lock, keeping the checkpoint (an interrupted run resumes from it)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def others(self) -> list[Path]:
        """Checkpoint folders of other runs (other settings) in the same root, left for them to resume."""
        return sorted(p for p in self.root.glob("run-*") if p != self.run_dir and p.is_dir())

    def remove(self) -> None:
        """After success: remove this run's files, then the folders that became empty and are ours."""
        self.checkpoint.unlink(missing_ok=True)
        (self.run_dir / LOCK).unlink(missing_ok=True)
        self.release()
        try:
            self.run_dir.rmdir()
        except OSError:
            return  # something else is in it: leave it
        marker = self.root / MARKER
        if marker.is_file() and [p.name for p in self.root.iterdir()] == [MARKER]:
            marker.unlink()
            with contextlib.suppress(OSError):
                self.root.rmdir()


__all__ = ["WorkFolder", "MARKER"]
