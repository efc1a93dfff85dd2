"""Terminal tables, JSON documents and plots for crisp-bench (files written atomically)."""

from __future__ import annotations

import datetime as _dt
import math
import os
import platform
import sys
from collections.abc import Sequence

from crisp_runtime.storage.outputs import (
    OutputPathError,  # noqa: F401 - re-exported: crisp_bench's callers catch it
    png_metadata,
    write_atomic,
)
from crisp_runtime.storage.outputs import write_json as _write_json

JSON_FORMAT = "crisp-bench"
JSON_VERSION = 1


def environment() -> dict:
    """Date, machine and library versions, for every report."""
    env = {
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
    }
    try:
        import torch

        env["torch"] = torch.__version__
        env["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 - reporting only
        env["device"] = "unknown"
    return env


def _fmt(v) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        a = abs(v)
        if a == 0:
            return "0"
        if a >= 1000:
            return f"{v:,.0f}"
        if a >= 100:
            return f"{v:.1f}"
        if a >= 1:
            return f"{v:.2f}"
        if a >= 0.01:
            return f"{v:.3f}"
        return f"{v:.2e}"
    return str(v)


def table(rows: Sequence[dict], columns: Sequence[tuple[str, str]], title: str | None = None) -> str:
    """A plain-text table of ``rows`` over ``columns`` = [(key, header)], numbers right-aligned."""
    cells = [[_fmt(r.get(k, "")) for k, _ in columns] for r in rows]
    heads = [h for _, h in columns]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(heads)]
    numeric = [all(isinstance(r.get(k), (int, float)) for r in rows) and rows for k, _ in columns]

    def line(vals):
        pairs = enumerate(zip(vals, widths, strict=True))
        return "  ".join(v.rjust(w) if numeric[i] else v.ljust(w) for i, (v, w) in pairs)

    out = []
    if title:
        out.append(title)
    out.append(line(heads))
    out.append("  ".join("-" * w for w in widths))
    out.extend(line(c) for c in cells)
    return "\n".join(out)


def _clean(obj):
    if isinstance(obj, float) and (math.isnan(obj) or math.isinf(obj)):
        return None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item):  # numpy / torch scalars
        return _clean(obj.item())
    return obj


def write_json(path: str | os.PathLike, command: str, records: list[dict], **extra) -> dict:
    """Write ``{"format", "version", "command", "environment", "records", ...extra}`` (strict JSON)."""
    doc = _clean({"format": JSON_FORMAT, "version": JSON_VERSION, "command": command,
                  "environment": environment(), **extra, "records": records})
    _write_json(path, doc, allow_nan=False)  # atomically: temp file beside it, then rename
    return doc


def plot_lines(path, series: dict[str, list[tuple[float, float]]], *, xlabel: str, ylabel: str, title: str,
               note: str | None = None) -> None:
    """One line per series (name -> [(x, y)]) into a PNG (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for name, pts in series.items():
        xs, ys = zip(*pts, strict=True) if pts else ((), ())
        ax.plot(xs, ys, marker="o", label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    if note:
        fig.text(0.01, 0.01, note, fontsize=6, color="0.35")
    fig.tight_layout(rect=(0, 0.04 if note else 0, 1, 1))
    write_atomic(path, lambda tmp: fig.savefig(tmp, format="png", metadata=png_metadata("crisp-bench")))
    plt.close(fig)


def plot_bars(path, groups: dict[str, dict[str, float]], *, ylabel: str, title: str, note: str | None = None) -> None:
    """Grouped bars: groups name -> {bar name -> value}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(groups)
    bars = sorted({b for g in groups.values() for b in g}, key=lambda b: list(next(iter(groups.values()))).index(b)
                  if b in next(iter(groups.values())) else 99)
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    width = 0.8 / max(1, len(bars))
    for i, b in enumerate(bars):
        ax.bar([x + i * width for x in range(len(names))], [groups[n].get(b, 0.0) for n in names], width, label=b)
    ax.set_xticks([x + width * (len(bars) - 1) / 2 for x in range(len(names))], names)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    if note:
        fig.text(0.01, 0.01, note, fontsize=6, color="0.35")
    fig.tight_layout(rect=(0, 0.04 if note else 0, 1, 1))
    write_atomic(path, lambda tmp: fig.savefig(tmp, format="png", metadata=png_metadata("crisp-bench")))
    plt.close(fig)


class Progress:
    """A one-line progress counter on stderr (only when stderr is a terminal, or forced)."""

    def __init__(self, label: str, enabled: bool | None = None):
        self.label = label
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._last = -1

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or total <= 0:
            return
        pct = int(100 * done / total)
        if pct != self._last or done == total:
            self._last = pct
            end = "\n" if done >= total else ""
            print(f"\r{self.label}: {done}/{total} ({pct}%)", end=end, file=sys.stderr, flush=True)
