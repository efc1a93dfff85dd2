"""Store a CRISP pack's less important neurons at 2 bits: a real 2-bit tail pack from a 4-bit pack.

    python -m crisp_tools.tail_pack --model models/tiny-mixtral --crisp models/tiny-mixtral-crisp \\
        --layout 2g128@0.25 --out /tmp/tiny-mixtral-2g128 [--tier-widths 256,64,32] [--aux-full-weight 0.3]
    crisp-eval --model models/tiny-mixtral --crisp /tmp/tiny-mixtral-2g128 \\
        --reference-crisp models/tiny-mixtral-crisp --data data/stdlib-heldout.txt --mode decode --json t.json

CRISP's neuron order says which neurons matter least. This tool keeps each expert's first neurons in
the pack's 4-bit rows, bit for bit, and quantizes the rest from the model's ORIGINAL weights (stored
order from the pack) to 2 bits with groups twice the pack's (``crisp_kernels.format.quantize_tail_rows``:
asymmetric, an fp16 scale and a zero point per group, a clip ratio per group by least squared error).
Two 2-bit neurons fill the bytes of one 4-bit row (``crisp_kernels.format``, "2-bit tail rows"), so the
runtime's budget, cache, copies and scheduler count storage rows as before and a tail row costs half a
neuron's 4-bit bytes. The layouts stored: ``2gG@F`` with G = 2 x the pack's group (2g128 for a g64 pack)
and F the fraction of neurons kept 4-bit; other layouts of ``crisp_kernels.tail_layout`` (3-bit rows,
several segments) are simulated and emulated only (``crisp_tools.tail_emulation``).

The result is a pack folder (written atomically, never over an existing path) whose pack.json records
``tail_layout`` and ``tail_pack`` (the source pack and its experts file record). Its plan is the source
pack's (in neurons: the runtime converts it to storage rows), or the source's with ``--tier-widths``,
``--aux-full-weight`` (auxiliaries of routing weight >= W at the dominant width) and / or ``--aux-skip-weight``
(auxiliaries of routing weight < S skipped).
``crisp-eval`` measures it against the source pack's full width (``--reference-crisp``), in batch or
decode mode (the runtime's cache then counts the tail pack's real bytes).
"""

from __future__ import annotations

import argparse
import sys
import time

from crisp_kernels.format import tail_group_size, with_tail
from crisp_kernels.tail_layout import TailLayout
from crisp_runtime import cli_args as ca
from crisp_runtime.storage.outputs import OutputPathError

from .calibration import CliError, log
from .tail_emulation import (
    INFO_EMULATION,
    INFO_LAYOUT,
    derived_info,
    new_out,
    source_model,
    source_pack,
    stored_order_rows,
    tail_tool_parser,
)

INFO_TAIL_PACK = "tail_pack"


def storable_tail_start(layout: TailLayout, group_size: int, intermediate_size: int) -> int:
    """The first 2-bit neuron of a layout a pack can store (one 2-bit segment, groups of 2 x ``group_size``);
    ValueError naming what is not storable."""
    want = f"2g{2 * group_size}@F (F: the fraction of neurons kept 4-bit, in [0, 1))"
    if layout.is_plain:
        raise ValueError(f"layout {layout.name} is the 4-bit pack itself; a tail pack stores {want}")
    if len(layout.segments) != 1 or layout.segments[0].bits != 2 or layout.segments[0].group_size != 2 * group_size:
        raise ValueError(f"layout {layout.name} ({layout.spec()}) is simulated and emulated only: a pack with groups "
                         f"of {group_size} stores {want}")
    # row_ranges drops empty ranges: a start fraction that rounds to I leaves only the 4-bit head (no tail pack)
    tail = [lo for lo, _, bits, _ in layout.row_ranges(intermediate_size) if bits == 2]
    if not tail:
        raise ValueError(f"layout {layout.name}: no neuron of I={intermediate_size} is left for the 2-bit tail at "
                         f"{layout.segments[0].start:g} (the 2-bit rows start at neuron "
                         f"{round(layout.segments[0].start * intermediate_size)}); give a smaller fraction")
    return tail[0]


def checked_tail_start(layout: TailLayout, first) -> int:
    """:func:`storable_tail_start` for a pack whose first layer is ``first``, with what a 2-bit tail needs of the
    pack (asymmetric, no biases, groups dividing H); ValueError naming what is missing."""
    start = storable_tail_start(layout, first.fmt.group_size, first.intermediate_size)
    if first.zeros is None or first.bias is not None:
        raise ValueError("2-bit tails need an asymmetric pack without biases (this one is "
                         f"{'symmetric' if first.zeros is None else 'a model with biases'})")
    if first.hidden_size % tail_group_size(first.fmt):
        raise ValueError(f"the tail's groups of {tail_group_size(first.fmt)} must divide H={first.hidden_size}")
    return start


def tail_layers(layers, refs, start: int, log=lambda msg: None) -> dict:
    """The pack's ``layers`` with neurons from ``start`` (of :func:`checked_tail_start`) stored at 2 bits, quantized
    from the model's weights (``refs``: its MoE layers, the pack's source); ``log`` gets a line per layer."""
    new = {}
    for n, ref in enumerate(refs, 1):
        layer = layers[ref.layer_id]
        rows = stored_order_rows(ref.module.gate_up_proj.detach(), ref.module.down_proj.detach(), layer.neuron_order)
        new[ref.layer_id] = with_tail(layer, rows, start)
        log(f"layer {ref.layer_id}: {n}/{len(refs)}")
    return new


def tail_pack_info(info: dict, layout: TailLayout, start: int, source_pack, **plan_knobs) -> dict:
    """The pack.json info of a tail pack of ``info``'s 4-bit pack (from folder ``source_pack``): the source's info
    without what no longer holds, the layout record and the :data:`INFO_TAIL_PACK` record (``plan_knobs``: what the
    tool changed in the plan, recorded as given)."""
    # the layers' summary (rows, not neurons, for intermediate_size) is written by save_pack itself
    out, digest = derived_info(info, drop=(INFO_EMULATION, "intermediate_size", "tail_start", "num_neurons"))
    out[INFO_LAYOUT] = layout.to_dict()
    out[INFO_TAIL_PACK] = {"source_pack": str(source_pack), "source_experts_sha256": digest,
                           "tail_start_neuron": start, **plan_knobs,
                           "note": "neurons from tail_start_neuron stored at 2 bits (crisp_tools.tail_pack)"}
    return out


def build_parser() -> argparse.ArgumentParser:
    return tail_tool_parser("python -m crisp_tools.tail_pack", __doc__, "start from",
                            "2gG@F: neurons from fraction F of I stored at 2 bits, groups of G = 2 x the pack's "
                            "group (e.g. 2g128@0.25 for a g64 pack)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.time()
    try:
        out = new_out(args)
        layers, plan, info = source_pack(args)
        try:
            start = checked_tail_start(args.layout, next(iter(layers.values())))
        except ValueError as exc:
            raise CliError(f"--layout {args.layout.name}: {exc}") from None
        _, refs = source_model(args, layers, info)
        from crisp_runtime.storage.pack import save_pack

        new = tail_layers(layers, refs, start,
                          lambda msg: log(f"[tail-pack {time.time() - t0:5.1f}s] {msg}", quiet=args.quiet))
        info = tail_pack_info(info, args.layout, start, args.crisp,
                              tier_widths=None if args.tier_widths is None else vars(args.tier_widths),
                              aux_full_weight=args.aux_full_weight,
                              **({} if args.aux_skip_weight is None else {"aux_skip_weight": args.aux_skip_weight}))
        save_pack(out, new, plan=plan, info=info)
    except (CliError, OutputPathError) as exc:
        print(f"tail-pack: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return ca.interrupted("tail-pack", resumable=False)
    total = sum(layer.nbytes() for layer in new.values())
    was = sum(layer.nbytes() for layer in layers.values())
    log(f"[tail-pack {time.time() - t0:5.1f}s] wrote {out} ({args.layout.name}: {total:,} expert bytes, "
        f"{total / was:.1%} of the 4-bit pack's)", quiet=args.quiet)
    return 0


if __name__ == "__main__":
    sys.exit(main())
