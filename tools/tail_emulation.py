"""Emulate a tail layout inside the 4-bit format, to measure the accuracy of layouts packs cannot store.

(The 2-bit layouts ``2gG@F`` are stored for real by ``crisp_tools.tail_pack``; this tool covers the others,
e.g. ``m432``'s 3-bit rows, and is how their accuracy is measured.)

    python -m crisp_tools.tail_emulation --model models/tiny-mixtral --crisp models/tiny-mixtral-crisp \\
        --layout m432 --out /tmp/tiny-mixtral-m432 [--tier-widths 256,40,16]
    crisp-eval --model models/tiny-mixtral --crisp /tmp/tiny-mixtral-m432 --reference-crisp models/tiny-mixtral-crisp \\
        --data data/stdlib-heldout.txt --samples 128 --json m432.json

A layout (``crisp_kernels.tail_layout``) stores rows from a start fraction of I at 3 or 2 bits. Each
such row range of every expert is quantized here from the model's ORIGINAL weights (stored neuron
order from the pack) on a ``bits``-bit grid per group (asymmetric, an fp16 scale and an integer zero,
the clip ratio of each group chosen from 1.0 .. 0.6 by squared error), and written as 4-bit codes that
lie exactly on that grid: q4 = m q, z4 = m z, s4 = s / m with m = 5 (2-bit: codes 0, 5, 10, 15) or 2
(3-bit: 0, 2, .., 14); a low-bit group of 128 spans two 4-bit groups of 64 with the same scale and zero.
So every 4-bit path (kernels, runtime, crisp-eval) computes the layout's values exactly; only the bytes
are still 4-bit's (the layout's speed is ``crisp-bench simulate --tail-layout``). The 4-bit head rows
are the source pack's, bit for bit.

The result is a pack folder (written atomically, never over an existing path) whose pack.json records
``tail_layout`` and ``tail_emulation`` (the source pack; its experts file record when it has one):
``crisp-eval`` takes the source pack's full width as the reference of every loss (``--reference-crisp``)
and writes the layout
into its JSON, so that ``crisp-bench simulate --tail-layout`` attaches that accuracy to that layout only.
``--tier-widths`` stores the pack's plan with other tier widths (neurons of the non-dominant expert in
Hot / Warm / Cold pairs), e.g. to evaluate a Cold auxiliary kept at a few neurons.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

from crisp_kernels.format import PackedLayer, pack_nibbles, unpack_nibbles
from crisp_kernels.tail_layout import TailLayout, TailSegment, parse_tail_layout
from crisp_runtime import cli_args as ca
from crisp_runtime.planning.plan import TierWidths
from crisp_runtime.storage.outputs import OutputPathError, check_outputs

from .calibration import CliError, check_pack_of_model, load_model, load_pack_dir, log

# 4-bit codes per low-bit code step, so that a low-bit grid lies exactly in the 4-bit one (0..15).
CODE_STEP = {2: 5, 3: 2}
CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6)
_MIN_SCALE = 2.0**-24  # fp16's smallest subnormal, as crisp_kernels.format
INFO_LAYOUT, INFO_EMULATION = "tail_layout", "tail_emulation"


def quantize_on_grid(rows: torch.Tensor, bits: int, group_size: int, pack_group: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rows (..., H) float -> (4-bit codes (..., H) uint8, scales (..., H/pack_group) fp16, zeros uint8) whose
    dequantized values lie on a ``bits``-bit grid of groups ``group_size``: per group the clip ratio of
    ``CLIP_RATIOS`` with the least squared error."""
    hidden = rows.shape[-1]
    if group_size % pack_group or hidden % group_size:
        raise ValueError(f"group {group_size} must be a multiple of the pack's group {pack_group} and divide "
                         f"H={hidden}")
    step, qmax = CODE_STEP[bits], (1 << bits) - 1
    groups = rows.float().reshape(*rows.shape[:-1], hidden // group_size, group_size)
    lo_all = groups.amin(-1, keepdim=True).clamp(max=0)
    hi_all = groups.amax(-1, keepdim=True).clamp(min=0)
    best_err = best_q = best_z = best_s = None
    for ratio in CLIP_RATIOS:
        lo, hi = lo_all * ratio, hi_all * ratio
        scale4 = ((hi - lo) / (qmax * step)).clamp_min(_MIN_SCALE).to(torch.float16)  # the 4-bit scale, stored
        scale = scale4.float() * step  # the low-bit grid's step
        zero = torch.round(-lo / scale).clamp(0, qmax)
        q = torch.round(groups / scale + zero).clamp(0, qmax)
        err = ((q - zero) * scale - groups).square().sum(-1, keepdim=True)
        if best_err is None:
            best_err, best_q, best_z, best_s = err, q, zero, scale4
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_q, best_z = torch.where(better, q, best_q), torch.where(better, zero, best_z)
        best_s = torch.where(better, scale4, best_s)
    codes = (best_q * step).to(torch.uint8).reshape(rows.shape)
    per = group_size // pack_group
    scales = best_s.squeeze(-1).repeat_interleave(per, dim=-1)
    zeros = (best_z * step).squeeze(-1).to(torch.uint8).repeat_interleave(per, dim=-1)
    return codes, scales, zeros


def stored_order_rows(gate_up: torch.Tensor, down: torch.Tensor, neuron_order: torch.Tensor) -> torch.Tensor:
    """(E, I, 3, H) float32 rows (gate row, up row, down column) in the pack's stored neuron order, from the
    transformers layout gate_up (E, 2I, H) and down (E, H, I)."""
    inter = gate_up.shape[1] // 2
    rows = torch.stack((gate_up[:, :inter], gate_up[:, inter:], down.transpose(1, 2)), dim=2).float()
    return rows.gather(1, neuron_order.unsqueeze(-1).unsqueeze(-1).expand_as(rows))


def emulate_layer(layer: PackedLayer, gate_up: torch.Tensor, down: torch.Tensor, layout: TailLayout) -> PackedLayer:
    """The layer with every tail row range of ``layout`` on its low-bit grid (4-bit head rows unchanged)."""
    if layer.zeros is None:
        raise ValueError("a symmetric pack (fixed zero point 8) cannot hold a shifted low-bit grid; emulate an "
                         "asymmetric pack")
    if layer.bias is not None:
        raise ValueError("packs with biases (gpt-oss) are not emulated")
    rows = stored_order_rows(gate_up, down, layer.neuron_order)
    codes = unpack_nibbles(layer.qweight).clone()
    scales, zeros = layer.scales.clone(), layer.zeros.clone()
    if layout.is_plain:
        return layer
    for lo, hi, bits, group in layout.row_ranges(layer.intermediate_size):
        if bits == 4:
            continue
        codes[:, lo:hi], scales[:, lo:hi], zeros[:, lo:hi] = quantize_on_grid(rows[:, lo:hi], bits, group,
                                                                              layer.fmt.group_size)
    return PackedLayer(layer.fmt, pack_nibbles(codes), scales, zeros, layer.neuron_order, activation=layer.activation)


def emulation_of(info: dict) -> TailLayout | None:
    """The layout a pack's info says it emulates, or None for a plain pack."""
    spec = info.get(INFO_LAYOUT)
    if spec is None:
        return None
    if not isinstance(spec, dict) or not isinstance(spec.get("segments"), list):
        raise ValueError(f"pack.json {INFO_LAYOUT}: expected {{name, segments}}, got {spec!r}")
    return TailLayout(spec.get("name"), tuple(TailSegment(*s) for s in spec["segments"]))


def build_parser() -> argparse.ArgumentParser:
    return tail_tool_parser("python -m crisp_tools.tail_emulation", __doc__, "emulate from",
                            "m432, m42, q3 or BITSgGROUP@START,... (crisp_kernels.tail_layout); q4 (only with "
                            "--tier-widths): the 4-bit rows unchanged, only the plan's tier widths replaced")


def tail_tool_parser(prog: str, doc: str, source_verb: str, layout_help: str) -> argparse.ArgumentParser:
    """The options of the tools that derive a tail-layout pack from a 4-bit pack (this one and tail_pack)."""
    p = ca.Parser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, type=ca.nonempty_path, help="the transformers checkpoint of the pack")
    p.add_argument("--crisp", required=True, type=ca.nonempty_path,
                   help=f"the 4-bit CRISP pack folder to {source_verb}")
    p.add_argument("--layout", required=True, type=layout_arg, help=layout_help)
    p.add_argument("--out", required=True, type=ca.nonempty_path, help="new pack folder (must not exist)")
    p.add_argument("--tier-widths", default=None, type=tier_widths_arg, metavar="HOT,WARM,COLD",
                   help="store the plan with these tier widths (neurons of a pair's non-dominant expert); "
                   "default: the pack's")
    p.add_argument("--aux-full-weight", default=None, type=ca.float_in(0.0, 1.0), metavar="W",
                   help="store the plan with auxiliaries of routing weight >= W at the dominant width whatever their "
                   "tier (CrispPlan.aux_full_weight; default: the pack's plan as it is)")
    p.add_argument("--aux-skip-weight", default=None, type=ca.float_in(0.0, 1.0), metavar="S",
                   help="store the plan with auxiliaries of routing weight < S skipped whatever their tier "
                   "(CrispPlan.aux_skip_weight; at most --aux-full-weight; default: the pack's plan as it is)")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    return p


def layout_arg(text: str) -> TailLayout:
    try:
        layout = parse_tail_layout(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return layout


def tier_widths_arg(text: str) -> TierWidths:
    parts = text.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"expected three non-negative integers HOT,WARM,COLD, got {text!r}")
    return TierWidths(*(int(p) for p in parts))


def new_out(args) -> Path:
    """``--out``, refused when it exists or would overwrite an input (before any work)."""
    out = Path(args.out)
    if out.exists() or out.is_symlink():
        raise CliError(f"--out {out}: already exists; give a new folder (nothing is overwritten)")
    check_outputs({"--out": out}, {"--model": args.model, "--crisp": args.crisp})
    return out


def source_pack(args):
    """(layers, plan with ``--tier-widths`` applied, info) of ``--crisp``: a 4-bit pack with a plan."""
    layers, plan, info = load_pack_dir(args.crisp)
    if emulation_of(info) is not None or next(iter(layers.values())).tail_start is not None:
        raise CliError(f"--crisp {args.crisp}: already a tail layout (emulated or stored); start from the 4-bit pack")
    if plan is None:
        raise CliError(f"--crisp {args.crisp}: the pack has no plan (plan.json); run crisp-profile")
    if args.tier_widths is not None:
        try:
            plan = plan.with_tiers(args.tier_widths)
            plan.validate()
        except ValueError as exc:
            raise CliError(f"--tier-widths: {exc}") from None
    if args.aux_full_weight is not None:
        try:
            plan = plan.promoted(args.aux_full_weight)
        except ValueError as exc:
            raise CliError(f"--aux-full-weight: {exc}") from None
    if args.aux_skip_weight is not None:
        try:
            plan = plan.skipping(args.aux_skip_weight)
        except ValueError as exc:
            raise CliError(f"--aux-skip-weight: {exc}") from None
    said = [f"{opt} {value}" for opt, value in (
        ("--tier-widths", None if args.tier_widths is None else
         f"{args.tier_widths.hot},{args.tier_widths.warm},{args.tier_widths.cold}"),
        ("--aux-full-weight", args.aux_full_weight), ("--aux-skip-weight", args.aux_skip_weight)) if value is not None]
    if said:  # the source's description names its own widths: say what replaced them
        plan = dataclasses.replace(plan, description=f"{plan.description} Then {', '.join(said)} "
                                   "(crisp_tools.tail_pack / tail_emulation).".strip())
    return layers, plan, info


def source_model(args, layers, info):
    """(model, MoE layer refs) of ``--model``, refused unless the pack was made from these weights."""
    model, refs = load_model(args.model)
    check_pack_of_model(layers, info, model, f"--crisp {args.crisp}")
    return model, refs


def reference_pack(reference_dir, layers, model, pack_dir) -> tuple[dict, dict]:
    """(layers, info) of ``--reference-crisp``: the 4-bit pack whose full width is the reference of every relative
    loss of ``--crisp`` ``pack_dir`` (its ``layers``). CliError for a tail layout (emulated or stored), a pack of
    other weights than ``model``, or another neuron order than ``layers`` (another profile of the model)."""
    ref_layers, _, ref_info = load_pack_dir(reference_dir)
    if emulation_of(ref_info) is not None or next(iter(ref_layers.values())).tail_start is not None:
        raise CliError(f"--reference-crisp {reference_dir}: a tail layout itself; give a 4-bit pack")
    check_pack_of_model(ref_layers, ref_info, model, f"--reference-crisp {reference_dir}")
    for lid, lay in layers.items():
        if lid not in ref_layers or not torch.equal(ref_layers[lid].neuron_order, lay.neuron_order):
            raise CliError(f"--reference-crisp {reference_dir}: layer {lid}'s neuron order differs from --crisp "
                           f"{pack_dir}'s (another profile of the model)")
    return ref_layers, ref_info


def derived_info(info: dict, drop=()) -> tuple[dict, object]:
    """(the source pack's info without what save_pack writes itself and without its stored serving choice, its
    experts file record). A serving choice (``storage.serving_record``) belongs to the plan and bytes it was
    searched on: a derived pack has other bytes or another plan (a tail pack must not keep its source's choice,
    searched on 4-bit rows)."""
    from crisp_runtime.storage.serving_record import SERVING_KEY

    files = info.get("files")
    digest = files.get("experts.safetensors") if isinstance(files, dict) else None
    return {k: v for k, v in info.items() if k not in ("format", "version", "quant", "files", SERVING_KEY, *drop)}, \
        digest


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.time()
    try:
        out = new_out(args)
        if (args.layout.is_plain and args.tier_widths is None and args.aux_full_weight is None
                and args.aux_skip_weight is None):
            raise CliError("--layout q4 is the pack itself: nothing to emulate (give --tier-widths, "
                           "--aux-full-weight or --aux-skip-weight to store another plan)")
        layers, plan, info = source_pack(args)
        _, refs = source_model(args, layers, info)
        from crisp_runtime.storage.pack import save_pack

        new = {}
        for n, ref in enumerate(refs, 1):
            try:
                new[ref.layer_id] = emulate_layer(layers[ref.layer_id], ref.module.gate_up_proj.detach(),
                                                  ref.module.down_proj.detach(), args.layout)
            except ValueError as exc:
                raise CliError(f"--crisp {args.crisp}: {exc}") from None
            log(f"[tail-emulation {time.time() - t0:5.1f}s] layer {ref.layer_id}: {n}/{len(refs)}", quiet=args.quiet)
        info, digest = derived_info(info)
        if not args.layout.is_plain:
            info[INFO_LAYOUT] = args.layout.to_dict()
        info[INFO_EMULATION] = {"source_pack": str(args.crisp), "source_experts_sha256": digest,
                                "tier_widths": None if args.tier_widths is None else vars(args.tier_widths),
                                "aux_full_weight": args.aux_full_weight,
                                **({} if args.aux_skip_weight is None else {"aux_skip_weight": args.aux_skip_weight}),
                                "note": "4-bit format; tail rows on low-bit grids (crisp_tools.tail_emulation)"}
        save_pack(out, new, plan=plan, info=info)
    except (CliError, OutputPathError) as exc:
        print(f"tail-emulation: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return ca.interrupted("tail-emulation", resumable=False)
    log(f"[tail-emulation {time.time() - t0:5.1f}s] wrote {out} ({args.layout.name})", quiet=args.quiet)
    return 0


if __name__ == "__main__":
    sys.exit(main())
