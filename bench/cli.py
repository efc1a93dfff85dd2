"""``crisp-bench``: how fast CRISP runs on this machine, against what you would use instead.

Subcommands: kernels, transfer, cpu, dense (the CPU default's dense layers on real shapes), layer, e2e, simulate,
and peer (against llama.cpp on the CPU).
With no subcommand a quick default suite runs the first five on the committed trained model (about a minute
on a 2-core CPU; it uses the GPU when there is one). Every subcommand prints tables, and takes ``--json PATH``
and ``--plot PATH.png``. Bad input exits with code 2 and a one-line message.

This module only dispatches: each subcommand is a module with ``add_parser(subparsers)`` and
``run(args) -> int`` (kernels, cpu, dense, transfer, layer, e2e, simulate_cmd, peer); what they share (paths,
the CliError base class, argument types, model loading, device sync, the JSON emit) is in
``common``, tables and plots in ``report``. No module of the package imports this one.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import torch

from crisp_kernels import PackFormatError
from crisp_runtime import cli_args as ca
from crisp_runtime.hf.moe_layers import UnsupportedModelError
from crisp_runtime.planning.plan import PlanError
from crisp_runtime.storage.outputs import check_outputs, plot_kind
from crisp_runtime.storage.pack import PackMismatchError

from . import cpu, dense, e2e, kernels, layer, peer, report, report_cmd, simulate_cmd, transfer
from .common import CliError, check_model_dir, pack_dir_for
from .profiles import PROFILE_FORMAT
from .traces import TRACE_FORMAT


def build_parser() -> argparse.ArgumentParser:
    parser = ca.Parser(
        prog="crisp-bench",
        description="Benchmarks for CRISP (kernels, transfers, layer steps, end to end) and a decoding simulator. "
        "Without a subcommand, runs a quick default suite (~1 minute on a 2-core CPU) on the committed model.",
    )
    parser.add_argument("--threads", type=ca.threads_int, default=None,
                        help="torch CPU threads for the default suite (default: 1 on machines with <= 2 cores)")
    parser.add_argument("--model", metavar="DIR", default=None, type=ca.nonempty_path,
                        help="checkpoint for the default suite (default: the committed models/tiny-mixtral)")
    sub = parser.add_subparsers(dest="command", metavar="{kernels,transfer,cpu,dense,layer,e2e,simulate,peer,report}")

    # the order of `crisp-bench --help`
    for module in (kernels, cpu, dense, transfer, layer, e2e, simulate_cmd, peer, report_cmd):
        module.add_parser(sub)
    return parser


# ---------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    previous = _interrupt_on_sigterm()
    try:
        if getattr(args, "plot", None) and not str(args.plot).lower().endswith(".png"):
            raise CliError(f"--plot {args.plot}: expected a .png path")
        _check_paths(args)
        if args.command is None:
            return _default_suite(args)
        if getattr(args, "threads", None):
            torch.set_num_threads(args.threads)
        handler = {"kernels": _cmd_kernels, "transfer": _cmd_transfer, "layer": _cmd_layer, "e2e": _cmd_e2e,
                   "simulate": _cmd_simulate, "cpu": _cmd_cpu, "dense": _cmd_dense, "peer": _cmd_peer,
                   "report": _cmd_report}[args.command]
        return handler(args)
    except KeyboardInterrupt:
        return ca.interrupted("crisp-bench", resumable=False)
    except Exception as exc:  # noqa: BLE001 - bad input must not end in a traceback
        if os.environ.get("CRISP_BENCH_DEBUG"):
            raise
        prog = " ".join(["crisp-bench", *([args.command] if args.command else [])])
        if isinstance(exc, _known_errors()):
            print(f"{prog}: error: {exc}", file=sys.stderr)
            return 2
        print(f"{prog}: internal error at {_where(exc)}: {type(exc).__name__}: {exc} "
              f"(set CRISP_BENCH_DEBUG=1 for the traceback)", file=sys.stderr)
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _interrupt_on_sigterm():
    """SIGTERM (kill, a job scheduler, a timeout) raises KeyboardInterrupt as Ctrl-C does, so that the
    ``finally`` blocks that remove partial build folders and temporary files run. Returns the handler to
    restore, or None where none can be installed (a thread other than the main one)."""
    try:
        return signal.signal(signal.SIGTERM, _raise_interrupt)
    except ValueError:
        return None


def _where(exc: BaseException) -> str:
    """file:line (function) of the innermost frame that raised ``exc``."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "?"
    f = frames[-1]
    return f"{Path(f.filename).name}:{f.lineno} ({f.name})"


def _check_paths(args) -> None:
    """Every output option checked before any work (``crisp_runtime.storage.outputs``): writable, not a folder,
    not an input, not inside an input folder (model, pack) nor inside any CRISP pack."""
    outputs = {f"--{n.replace('_', '-')}": getattr(args, n, None)
               for n in ("json", "plot", "record_trace", "profile_out")}
    if not any(outputs.values()):
        return
    inputs: dict = {}
    for name in ("model", "pack", "text", "trace", "plan", "profile_file", "compare", "accuracy", "from_json"):
        value = getattr(args, name, None)
        if value is not None and value != "auto":
            inputs[f"--{name.replace('_', '-')}"] = value
    profile = getattr(args, "profile", None)
    if profile is not None and Path(profile).exists():
        inputs["--profile"] = profile
    implicit = _IMPLICIT_INPUTS.get(args.command)  # what the command reads when an option is left out
    if implicit is not None:
        inputs.update(implicit(args))
    if getattr(args, "model", None) is not None:
        pack = pack_dir_for(args.model, getattr(args, "pack", None))  # the pack the command will read
        if pack is not None:
            inputs["the model's pack"] = pack
    check_outputs(outputs, inputs, force=bool(getattr(args, "force", False)), kinds=_OUTPUT_KINDS)


# what each output option writes (crisp_runtime.storage.outputs.output_kind): a rerun replaces its own kind of file,
# not another tool's result (an evaluation record at --json, say) unless --force
_OUTPUT_KINDS = {"--json": {report.JSON_FORMAT}, "--plot": {plot_kind("crisp-bench")},
                 "--record-trace": {TRACE_FORMAT}, "--profile-out": {PROFILE_FORMAT}}

# {command: args -> {name: path(s)}}: files a command reads without an option naming them
_IMPLICIT_INPUTS = {"simulate": simulate_cmd.implicit_inputs, "peer": peer.implicit_inputs}


def _known_errors() -> tuple[type[BaseException], ...]:
    """Bad input from the runtime and the bench's modules (CliError: the bench's own errors, TraceError,
    ProfileError, ShapeError and BudgetTooSmall among them)."""
    return (CliError, PlanError, report.OutputPathError, ca.JsonInputError, UnsupportedModelError, PackMismatchError,
            PackFormatError)


# ---------------------------------------------------------------------------- subcommands

# The handlers main dispatches to, looked up when it runs (tests replace them on this module).
_cmd_kernels = kernels.run
_cmd_cpu = cpu.run
_cmd_dense = dense.run
_cmd_transfer = transfer.run
_cmd_layer = layer.run
_cmd_e2e = e2e.run
_cmd_simulate = simulate_cmd.run
_cmd_peer = peer.run
_cmd_report = report_cmd.run


def _default_suite(args) -> int:
    """kernels, transfer, layer, e2e and simulate, each small, on the committed model."""
    if args.model:  # layer, e2e and simulate load it and its pack: checked before the first step
        try:
            check_model_dir(args.model)
        except CliError as exc:
            raise CliError(f"--model {exc}") from None
    t0 = time.perf_counter()
    threads = args.threads or (1 if (os.cpu_count() or 1) <= 2 else None)
    common = ["--threads", str(threads)] if threads else []
    model = ["--model", args.model] if args.model else []
    steps = [
        ["transfer", "--shapes", "tiny,mixtral", "--widths", "0.25,0.5,1.0", "--repeats", "3"],
        ["kernels", "--quick"],
        ["layer", "--steps", "32", *model],
        ["e2e", "--tokens", "256", *model],
        # 512 tokens: the simulator plans every step with the runtime's code (~0.1 ms a step, 32 layers)
        ["simulate", "--sequences", "4", "--seq-len", "128", *model],
    ]
    status = 0
    for argv in steps:
        print(f"\n=== crisp-bench {' '.join(argv)}", flush=True)
        rc = main(argv + common)
        if rc == 130:  # Ctrl-C in a step stops the suite, not only that step
            return rc
        if rc != 0:
            print(f"=== crisp-bench {argv[0]} exited with {rc}; the suite goes on", flush=True)
        status = status or rc
    print(f"\ndefault suite: {time.perf_counter() - t0:.0f} s")
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
