"""The ``crisp-profile`` command line: options, ``main`` (exit 2 with ``crisp-profile: error: ...`` on bad
input, 130 on Ctrl-C with the checkpoint kept for resuming)."""

from __future__ import annotations

import argparse
import json
import sys

from crisp_runtime import cli_args as ca
from crisp_runtime.storage.outputs import OutputPathError

from ..calibration import DTYPES, CliError
from ..placement import PLACEMENT_CHOICES
from .config import (
    COMBINATION_KEYS,
    DEFAULT_COLD_MASS,
    DEFAULT_HOT_MASS,
    DEFAULT_WARM_WIDTH,
    DOMINANCE_RULES,
    IMPORTANCE_KINDS,
    ProfileConfig,
)
from .pipeline import Profiler
from .throughput import add_budget_choice_options, add_search_options, gpu_budget_arg


def build_parser() -> argparse.ArgumentParser:
    p = ca.Parser(
        prog="crisp-profile",
        description="Profile an MoE model on calibration text and write a CRISP pack (experts reordered by "
        "importance, 4-bit, neuron-major) with its plan (Hot/Warm/Cold tiers; dominance measured by masking "
        "or per token by routing weight).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", required=True, type=ca.nonempty_path,
                   help="local transformers checkpoint folder (nothing is downloaded)")
    p.add_argument("--data", required=True, nargs="+", type=ca.nonempty_path,
                   help="calibration text: .txt, .jsonl/.jsonl.gz/.json.gz with a 'text' field, or a saved "
                        "`datasets` folder (byte-level tokens)")
    p.add_argument("--out", required=True, type=ca.nonempty_path,
                   help="output pack folder (written atomically; refused if it holds anything but a pack of this "
                        "model)")
    p.add_argument("--samples", type=ca.positive_int, default=2048,
                   help="calibration windows for the statistics (the paper: 2048)")
    p.add_argument("--seq-len", type=ca.int_in(2), default=256, help="tokens per window")
    p.add_argument("--batch-size", type=ca.positive_int, default=16,
                   help="windows per forward pass (and per checkpoint)")
    p.add_argument("--seed", type=ca.seed_int, default=0, help="seed of the window sampling")
    p.add_argument("--device", type=ca.device_name, default="cpu", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--dtype", default="auto", choices=tuple(DTYPES),
                   help="dtype the model is loaded in (auto: the checkpoint's); statistics are float32 either way")
    p.add_argument("--threads", type=ca.threads_int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--group-size", type=int, default=64, choices=(32, 64, 128), help="4-bit quantization group along H")
    p.add_argument("--symmetric", action="store_true", help="symmetric 4-bit (no zero points)")
    p.add_argument("--importance", default="weighted", choices=IMPORTANCE_KINDS,
                   help="neuron score: sum of routing_weight*|act|*||down col|| (weighted) or without the weight")
    p.add_argument("--hot-mass", type=ca.float_in(0.0, 1.0), default=DEFAULT_HOT_MASS,
                   help="Hot = most frequent combinations carrying this share of activations")
    p.add_argument("--cold-mass", type=ca.float_in(0.0, 1.0), default=DEFAULT_COLD_MASS,
                   help="Cold = least frequent combinations carrying at most this share")
    p.add_argument("--warm-width", type=ca.float_in(0.0, 1.0), default=DEFAULT_WARM_WIDTH,
                   help="width of the auxiliary expert in Warm combinations, as a fraction of full width")
    p.add_argument("--holdout-fraction", type=ca.float_in(0.0, 1.0, low_open=True, high_open=True), default=0.1,
                   help="last share of the calibration text kept out of the statistics, for --search-target-bytes")
    p.add_argument("--dominance-samples", type=ca.positive_int, default=64,
                   help="calibration windows for measuring dominance")
    p.add_argument("--dominance-min-tokens", type=ca.positive_int, default=32,
                   help="pairs seen on fewer tokens (in the dominance windows) use the routing-weight proxy")
    p.add_argument("--dominance-max-windows", type=ca.positive_int, default=8,
                   help="windows per pair in each masking run")
    p.add_argument("--dominance", default="auto", choices=DOMINANCE_RULES,
                   help="dominant expert of a combination: a per-pair label measured by masking (measured), the "
                        "heavier expert of each token (routing-weight), or whichever has the lower loss on held-out "
                        "calibration windows (auto, default)")
    p.add_argument("--combination-key", default="auto", choices=COMBINATION_KEYS,
                   help="what the tiers are keyed on: the two heaviest routed experts of a token (leading-pair, the "
                        "paper's key) or the heaviest alone (leading-expert); auto: at top-k > 2 both are searched "
                        "by --search-target-bytes (lowest held-out calibration loss) and --plan-for-throughput (the "
                        "plan's tiers over the other key too), else leading-pair")
    p.add_argument("--num-dominant", type=ca.positive_int, default=None, metavar="N",
                   help="routed experts per token at full width (1..top_k-1; default 1, or with "
                        "--search-target-bytes every N whose dominants alone fit the target is searched)")
    p.add_argument("--search-target-bytes", type=ca.float_in(0.0, 1.0, low_open=True), default=None, metavar="FRACTION",
                   help="search tier cut-offs and Warm width for <= FRACTION of full-width bytes per token "
                        "(lowest loss on held-out calibration windows); overrides --hot-mass/--cold-mass/--warm-width. "
                        "Skip-aux and uniform width at <= FRACTION are candidates too: when one has the lowest loss "
                        "the pack's plan is that baseline (pack.json search.chosen_kind)")
    p.add_argument("--search-samples", type=ca.positive_int, default=32,
                   help="held-out calibration windows for the search")
    p.add_argument("--search-cold-widths", type=_cold_widths, default=(0.0,), metavar="F[,F...]",
                   help="with --search-target-bytes: widths of a Cold pair's auxiliary expert to search, fractions "
                        "of full width in [0, 1) (default 0: the paper's rule, Cold runs the dominant only; e.g. "
                        "0,0.0625 also tries 1/16)")
    p.add_argument("--plan-for-throughput", dest="throughput_budget", type=ca.float_in(0.0, 1.0, low_open=True),
                   default=None, metavar="BUDGET",
                   help="also choose the serving policy / prefetch and the plan's auxiliary weight, skip weight and "
                        "width cap (or skip-aux / uniform at the plan's bytes in its place) with the most simulated "
                        "tokens/s at this GPU budget (fraction of all expert bytes) "
                        "on --hardware-profile, within --max-accuracy-loss measured on held-out calibration windows "
                        "(decoded through the runtime, or one batch forward where the serving follows the plan); "
                        "stored in pack.json 'serving' (crisp_runtime.storage.serving_record) and the pack's plan")
    p.add_argument("--gpu-budget", type=gpu_budget_arg, nargs="+", default=None, metavar="BUDGET",
                   help="profile and plan for throughput in one run: one serving choice per GPU budget (25%%, 0.25, "
                        "6GiB, or 'standard' for 10%% 25%% 50%%) from a short search of the default families on the "
                        "pack's own plan, stored in pack.json 'serving': what crisp_runtime.apply(model, pack, "
                        "gpu_budget=B) then runs by default (crisp_runtime.planning.defaults); --heldout-data also "
                        "measures each choice's loss on held-out text")
    add_budget_choice_options(p)
    add_search_options(p, "with --plan-for-throughput or --gpu-budget: ")
    p.add_argument("--placement", default="resident", choices=PLACEMENT_CHOICES,
                   help="resident: the whole model on --device; stream: the non-expert weights on --device, each "
                        "layer's experts read from the checkpoint (safetensors) per forward, one layer in memory")
    p.add_argument("--device-map", default=None, metavar="auto|JSON",
                   help="load with accelerate over GPUs, CPU and disk: auto / balanced / balanced_low_0 / sequential, "
                        "or a JSON object {module name: GPU index, 'cpu' or 'disk'}")
    p.add_argument("--max-memory", default=None, metavar="JSON",
                   help="with --device-map: a JSON object {GPU index, 'cpu': size like '20GiB'}; what does not fit "
                        "is offloaded further (CPU, then disk)")
    p.add_argument("--offload-folder", default=None, type=ca.nonempty_path,
                   help="with --device-map: a new folder for weights offloaded to disk (created for the run, removed "
                        "after it; default: a .crisp-offload-* folder beside --out)")
    p.add_argument("--work-dir", default=None, type=ca.nonempty_path,
                   help="checkpoint folder for resuming (default: .<out>.crisp-work next to --out); the run keeps "
                        "its files in a run-<key> folder inside it and deletes only those")
    p.add_argument("--keep-work", action="store_true", help="keep the run's checkpoint after success")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    return p


def _cold_widths(text: str) -> tuple[float, ...]:
    parse = ca.float_in(0.0, 1.0, high_open=True)
    parts = text.split(",")
    try:
        values = tuple(parse(p.strip()) for p in parts)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"{text!r}: a width is repeated")
    return tuple(sorted(values))


def config_from_args(args: argparse.Namespace) -> ProfileConfig:
    values = vars(args)
    return ProfileConfig(**{k: values[k] for k in ProfileConfig.__dataclass_fields__ if k in values})


def main(argv: list[str] | None = None, *, interrupt_after: int | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        info = Profiler(config_from_args(args)).run(interrupt_after=interrupt_after)
    except (CliError, OutputPathError) as exc:
        print(f"crisp-profile: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return ca.interrupted("crisp-profile", resumable=True)
    if not args.quiet:
        summary = {k: info[k] for k in ("dominance_measured_pairs", "dominance_proxy_agreement", "skew")}
        print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
