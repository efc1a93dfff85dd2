"""What every ``crisp-bench`` subcommand shares: paths, the error base class, argument types and
option groups, model loading, device sync and the ``--json`` emit (tables and plots: ``report``; model shapes:
``shapes``).

Imports nothing of the subcommand modules, so each of them (and ``cli``) can import it.
"""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable
from pathlib import Path

import torch

from crisp_runtime import cli_args as ca
from crisp_runtime.cli_args import CliError  # re-exported: the one error base of every CLI
from crisp_runtime.storage.pack import INFO_FILE, PLAN_FILE, load_pack

from . import report

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO_ROOT / "models" / "tiny-mixtral"
DEFAULT_TEXT = REPO_ROOT / "data" / "stdlib-heldout.txt"
POLICIES = ("full", "uniform", "skip_aux", "crisp")
ORDERS = ("serial", "router", "widest_first")




class ModelInputError(CliError):
    """A model path that is not a checkpoint, or has no CRISP pack."""


# ---------------------------------------------------------------------------- argument types


def csv_choices(choices):
    """An argparse type: a comma-separated subset of ``choices`` (a repeated item once, in its first place)."""

    def parse(text: str) -> list[str]:
        items = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
        bad = [t for t in items if t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"unknown {bad or text!r}; choose from {', '.join(choices)}")
        return items

    return parse


def fraction(text: str) -> float:
    try:
        v = float(text.rstrip("%")) / (100.0 if text.endswith("%") else 1.0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 < v <= 1.0:  # also refuses nan; inf is > 1
        raise argparse.ArgumentTypeError(f"must lie in (0, 1] (or 0-100%), got {text!r}")
    return v


positive_int = ca.positive_int


def items(text: str) -> list[str]:
    out = [t.strip() for t in str(text).split(",") if t.strip()]
    if not out:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
    return out


def fractions(text: str) -> list[float]:
    """Comma-separated fractions in (0, 1] (or percentages)."""
    return [fraction(v) for v in items(text)]


def int_list(text: str) -> list[int]:
    return [ca.positive_int(v) for v in items(text)]


def add_outputs(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="PATH", type=ca.nonempty_path,
                   help="write the records as JSON to PATH (atomically; never onto an input or into a pack, nor "
                        "onto a file no CRISP tool wrote unless --force)")
    p.add_argument("--plot", metavar="PATH.png", type=ca.nonempty_path,
                   help="write a plot to PATH.png (matplotlib; atomically)")
    ca.add_force(p)
    p.add_argument("--threads", type=ca.threads_int, default=None,
                   help="torch CPU threads (default: torch's choice; 1 is steadier on a busy shared CPU)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="DIR", default=str(DEFAULT_MODEL), type=ca.nonempty_path,
                   help="transformers checkpoint (default: the committed models/tiny-mixtral)")
    p.add_argument("--pack", metavar="DIR", default=None, type=ca.nonempty_path,
                   help="CRISP pack + plan of that model (default: DIR-crisp beside it, or DIR itself)")
    p.add_argument("--text", metavar="PATH", default=str(DEFAULT_TEXT), type=ca.nonempty_path,
                   help="held-out text (.txt/.jsonl) to decode (default: data/stdlib-heldout.txt)")


# ---------------------------------------------------------------------------- reports


def rel(path) -> str:
    """A path relative to the repository when it lies inside it (for reports and plots)."""
    try:
        return str(Path(path).resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def emit(args, command: str, records: list[dict], **extra) -> None:
    """The --json document, written atomically (``report.write_json``)."""
    if getattr(args, "json", None):
        report.write_json(args.json, command, records, **extra)
        print(f"wrote {args.json}")


# ---------------------------------------------------------------------------- models and devices


def pack_dir_for(model_dir: str | Path, pack_dir: str | Path | None) -> Path | None:
    """The CRISP pack folder of a model: ``pack_dir``, else ``<model_dir>-crisp``, else ``model_dir`` itself."""
    if pack_dir is not None:
        p = Path(pack_dir)
        if not (p / INFO_FILE).is_file():
            raise ModelInputError(f"--pack {pack_dir}: not a CRISP pack ({INFO_FILE} missing)")
        return p
    model_dir = Path(model_dir)
    for cand in (model_dir.parent / f"{model_dir.name}-crisp", model_dir):
        if (cand / INFO_FILE).is_file():
            return cand
    return None


def find_plan_file(pack_dir: str | Path) -> Path | None:
    p = Path(pack_dir) / PLAN_FILE
    return p if p.is_file() else None


def check_model_dir(model_dir, pack_dir=None, *, need_pack: bool = True) -> Path | None:
    """The pack folder of a checkpoint folder (``pack_dir_for``), or ModelInputError when ``model_dir`` is not a
    transformers checkpoint or, with ``need_pack``, has no pack: cheap, so a command checks it before any work."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ModelInputError(f"{model_dir}: not a transformers checkpoint (no config.json)")
    pack = pack_dir_for(model_dir, pack_dir)
    if need_pack and pack is None:
        raise ModelInputError(f"{model_dir}: no CRISP pack found (looked for {model_dir.name}-crisp/ beside it and "
                              f"in the folder itself); make one with `crisp-profile` or pass --pack DIR")
    return pack


def load_model_for_bench(model_dir, pack_dir=None, *, need_pack: bool = True, device="cpu"):
    """(unquantized model in eval mode on ``device``, pack folder or None)."""
    model_dir = Path(model_dir)
    pack = check_model_dir(model_dir, pack_dir, need_pack=need_pack)
    try:  # optional dependency (the [hf] extra), and slow to import: only when a model is loaded
        from transformers import AutoModelForCausalLM
    except ImportError as exc:  # pragma: no cover
        raise ModelInputError("transformers is not installed (pip install 'crisp-moe[hf]')") from exc
    try:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True)
    # transformers' errors for a broken checkpoint (RuntimeError: weights whose shapes its config.json contradicts)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelInputError(f"{model_dir}: cannot load the checkpoint ({type(exc).__name__}: {exc})") from exc
    model.eval().to(device)
    return model, pack


def load_pack_for_model(pack_dir, model):
    """The CRISP pack in ``pack_dir`` (``load_pack``), refused (PackMismatchError: "this CRISP pack was made for
    another model", as ``crisp_runtime.apply`` says) unless it was made for ``model``'s architecture."""
    pack = load_pack(pack_dir)
    pack.check_model(model)
    return pack


def pack_top_k(pack) -> int:
    """The experts a token routes to, as the pack records it (its plan's, else pack.json's ``top_k``, else 2)."""
    return pack.plan.top_k if pack.plan is not None else int(pack.info.get("top_k") or 2)


def bench_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def sync(device) -> None:
    """Wait for the device's queued work (a no-op on a CPU), so that wall-clock timers see it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cache_argument(model) -> Callable[[object], dict]:
    """``past -> forward keyword arguments`` for the KV cache, under its name in this transformers version
    (``cache`` in 5.x, else ``past_key_values``). The signature is inspected once, here: a decode loop
    calls the returned function per step (inspect.signature costs tens of us, inside timed loops)."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def kwargs(past) -> dict:
        return {} if past is None else {name: past}

    return kwargs


def cache_of(out):
    return getattr(out, "cache", None) if getattr(out, "cache", None) is not None else out.past_key_values
