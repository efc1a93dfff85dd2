"""Plan an existing CRISP pack for throughput at a GPU budget: ``crisp-profile --plan-for-throughput`` on a pack
folder, without profiling again (a 4-bit pack, or a 2-bit tail pack of ``crisp_tools.tail_pack``).

    python -m crisp_tools.tail_pack --model models/tiny-mixtral --crisp models/tiny-mixtral-crisp \\
        --layout 2g128@0.25 --tier-widths 256,64,32 --out /tmp/pack-64-32
    python -m crisp_tools.plan_throughput --model models/tiny-mixtral --crisp /tmp/pack-64-32 \\
        --reference-crisp models/tiny-mixtral-crisp --data data/stdlib-calib.txt --budget 0.25 \\
        --out /tmp/pack-64-32-at25
    crisp-eval --model models/tiny-mixtral --crisp /tmp/pack-64-32-at25 --reference-crisp models/tiny-mixtral-crisp \\
        --data data/stdlib-heldout.txt --mode decode --stored-serving --prefetch-window rtx4090-pcie4/mixtral-8x7b

The search (``crisp_tools.profiler.throughput``) chooses the serving policy, the prefetch and the plan's auxiliary
weight, skip weight and width cap (and its tier widths among ``--search-tier-widths``; or skip-aux / uniform at the
plan's bytes in its place, said in pack.json ``serving.search.chosen_kind``) with the most simulated
tokens/s at ``--budget`` (a fraction of the 4-bit expert bytes: on a tail pack the same GPU memory as on its 4-bit
source) on ``--hardware-profile``, within ``--max-accuracy-loss`` on windows of the held-out calibration part of
``--data`` (the last ``--holdout-fraction``, the profiler's split and draw: give the calibration text, never the
evaluation text), relative to the 4-bit full width (a tail pack's ``--reference-crisp``, as crisp-eval's).
With ``--tail-layouts`` on a 4-bit pack it also searches those 2-bit tail layouts of it (built in memory from
``--model``'s weights, as ``crisp_tools.tail_pack`` builds them), every candidate on each layout's own bytes, and
chooses the layout too.
The result is a new pack folder (written atomically, never over an existing path): the same experts (or the chosen
tail layout's, recorded as ``tail_pack`` records them), the chosen plan, and the choice in pack.json ``serving``
(``crisp_runtime.storage.serving_record``; a serving choice the source pack stored is replaced) with
``planned_for_throughput`` naming the source.
"""

from __future__ import annotations

import argparse
import sys
import time

from crisp_runtime import cli_args as ca
from crisp_runtime.storage.outputs import OutputPathError

from .calibration import (
    CliError,
    check_seq_len,
    check_vocab,
    load_pack_dir,
    load_texts,
    log,
    random_windows,
    split_texts,
    threads,
)
from .profiler.config import accuracy_window_count
from .profiler.throughput import (
    SERVING_KEY,
    PackVariant,
    ThroughputGoal,
    accuracy_windows_of,
    add_budget_choice_options,
    add_search_options,
    budget_fractions,
    check_hardware_profile,
    default_candidates,
    gpu_budget_arg,
    search_budgets,
    search_variants,
)
from .tail_emulation import (
    INFO_EMULATION,
    INFO_LAYOUT,
    derived_info,
    emulation_of,
    layout_arg,
    new_out,
    reference_pack,
    source_model,
)
from .tail_pack import checked_tail_start, tail_layers, tail_pack_info

INFO_PLANNED = "planned_for_throughput"


def build_parser() -> argparse.ArgumentParser:
    p = ca.Parser(prog="python -m crisp_tools.plan_throughput", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, type=ca.nonempty_path, help="the transformers checkpoint of the pack")
    p.add_argument("--crisp", required=True, type=ca.nonempty_path,
                   help="the CRISP pack folder to plan (4-bit, or a 2-bit tail pack of crisp_tools.tail_pack)")
    p.add_argument("--data", required=True, nargs="+", type=ca.nonempty_path,
                   help="calibration text (files, or a saved datasets folder): the search scores its held-out part")
    p.add_argument("--reference-crisp", default=None, metavar="PACK", type=ca.nonempty_path,
                   help="the 4-bit pack whose full width every loss is relative to (required for a tail pack: the "
                        "4-bit pack it was made from, same neuron order; default for a 4-bit pack: --crisp itself)")
    p.add_argument("--tail-layouts", nargs="+", type=layout_arg, default=(), metavar="LAYOUT",
                   help="also search these 2-bit tail layouts of a 4-bit --crisp (2gG@F, G = 2 x the pack's group, "
                        "e.g. 2g128@0.25 2g128@0.5), each built from --model's weights as crisp_tools.tail_pack "
                        "builds it; the pack written has the chosen layout's bytes")
    p.add_argument("--out", required=True, type=ca.nonempty_path, help="new pack folder (must not exist)")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--budget", type=ca.float_in(0.0, 1.0, low_open=True), metavar="FRACTION",
                       help="the GPU budget: a fraction of all expert bytes at full width in 4-bit rows (the whole "
                            "search space, one stored choice)")
    which.add_argument("--gpu-budget", type=gpu_budget_arg, nargs="+", metavar="BUDGET",
                       help="one stored choice per budget (25%%, 0.25, 6GiB or 'standard': 10%%, 25%%, 50%%) from a "
                            "short search of the default families on the pack's own plan (the plan and experts stay "
                            "the pack's); what apply runs by default at those budgets")
    add_budget_choice_options(p)
    add_search_options(p, "")
    p.add_argument("--holdout-fraction", type=ca.float_in(0.0, 1.0, low_open=True, high_open=True), default=0.1,
                   help="last share of --data the windows are drawn from (crisp-profile's split)")
    p.add_argument("--seed", type=ca.seed_int, default=0, help="seed of the window draw (crisp-profile's --seed)")
    p.add_argument("--threads", type=ca.threads_int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    return p


def stored_layout(info: dict, where: str):
    """The tail layout a pack stores (``crisp_kernels.tail_layout.PLAIN`` for a 4-bit pack); CliError for an
    emulated layout (4-bit bytes carrying another layout's values: simulated as what it emulates, it would put
    the wrong bytes on the accuracy) or an unreadable record."""
    from crisp_kernels.tail_layout import PLAIN

    if INFO_EMULATION in info:
        raise CliError(f"--crisp {where}: an emulated tail layout (crisp_tools.tail_emulation): its bytes are 4-bit "
                       "rows; plan the 4-bit pack, or a stored tail pack (crisp_tools.tail_pack)")
    if info.get("tail_start") is None:
        return PLAIN
    try:
        layout = emulation_of(info)  # the layout record a stored tail pack keeps too
    except (TypeError, ValueError) as exc:
        raise CliError(f"--crisp {where}: pack.json {INFO_LAYOUT!r} is not a readable tail layout ({exc})") from None
    if layout is None:
        raise CliError(f"--crisp {where}: pack.json has a 2-bit tail (tail_start) but no {INFO_LAYOUT!r} record")
    return layout


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.time()

    def progress(msg: str) -> None:
        log(f"[plan-throughput {time.time() - t0:6.1f}s] {msg}", quiet=args.quiet)

    try:
        out = new_out(args)
        if args.heldout_data is not None and args.gpu_budget is None:
            raise CliError("--heldout-data: only with --gpu-budget")
        check_hardware_profile(args.hardware_profile)
        try:
            goal = ThroughputGoal(args.budget or 0.25, args.max_accuracy_loss, args.hardware_profile,
                                  confidence=args.accuracy_confidence)
        except (ValueError, OSError) as exc:
            raise CliError(f"--budget: {exc}") from None
        try:
            count = accuracy_window_count(args.throughput_windows, args.throughput_accuracy_windows)
        except ValueError as exc:
            raise CliError(str(exc)) from None
        layers, plan, info = load_pack_dir(args.crisp)
        if plan is None:
            raise CliError(f"--crisp {args.crisp}: the pack has no plan (plan.json); run crisp-profile")
        layout = stored_layout(info, args.crisp)
        if args.gpu_budget is not None:
            return _plan_budgets(args, out, layers, plan, info, layout, count, progress)
        try:
            cands = default_candidates(plan, args.search_tier_widths)
        except ValueError as exc:
            raise CliError(str(exc)) from None
        tails = list(dict.fromkeys(t for t in args.tail_layouts if not t.is_plain))  # the pack's own is searched
        if tails and not layout.is_plain:
            raise CliError(f"--tail-layouts: --crisp {args.crisp} is a {layout.name} tail pack already; give the "
                           "4-bit pack it was made from")
        starts = {}
        for t in tails:
            try:
                starts[t.name] = checked_tail_start(t, next(iter(layers.values())))
            except ValueError as exc:
                raise CliError(f"--tail-layouts {t.name}: {exc}") from None
        if not layout.is_plain and args.reference_crisp is None:
            source = (info.get("tail_pack") or {}).get("source_pack") or "the 4-bit pack it was made from"
            raise CliError(f"--crisp {args.crisp}: a {layout.name} tail pack; its loss is relative to the 4-bit full "
                           f"width: pass --reference-crisp (e.g. {source})")
        texts = load_texts(args.data)
        _, holdout = split_texts(texts, args.holdout_fraction)
        windows = accuracy_windows_of(holdout, count, args.throughput_seq_len, args.seed, args.holdout_fraction)
        model, refs = source_model(args, layers, info)
        check_seq_len(model, args.throughput_seq_len, "--throughput-seq-len")
        reference = None if args.reference_crisp is None else \
            reference_pack(args.reference_crisp, layers, model, args.crisp)[0]
        check_vocab(model, windows)
        variants = [PackVariant(layers, layout)]
        for t in tails:
            progress(f"building the {t.name} tail layout from --model's weights")
            variants.append(PackVariant(tail_layers(layers, refs, starts[t.name]), t))
        if tails and reference is None:
            reference = layers  # the 4-bit pack itself
        source = (f"held-out calibration windows ({count} x {args.throughput_seq_len} tokens of the last "
                  f"{args.holdout_fraction:.0%} of --data; the first {args.throughput_windows} traced)")
        progress(f"{args.crisp} ({', '.join(v.layout.name for v in variants)}): searching at {args.budget:.0%} of "
                 f"the 4-bit expert bytes on {args.hardware_profile}, loss <= {args.max_accuracy_loss:.2%} at "
                 f"{args.accuracy_confidence:.0%}")
        with threads(args.threads):
            try:
                record, chosen, variant = search_variants(
                    model, variants, plan, windows[: args.throughput_windows], goal, accuracy_windows=windows,
                    cands=cands, source=source, workers=args.simulation_workers, reference_layers=reference,
                    log=progress)
            except ValueError as exc:
                raise CliError(f"--budget {args.budget:g}: {exc}") from None
        new_info, digest = derived_info(info, drop=(INFO_PLANNED,))
        if variant.layout != layout:  # a tail layout built here: the pack's bytes are its, recorded as tail_pack does
            new_info = tail_pack_info(info, variant.layout, starts[variant.layout.name], args.crisp, tier_widths=None,
                                      aux_full_weight=None)  # the plan's knobs are the search's, in its plan
        new_info[SERVING_KEY] = record.to_dict()
        new_info[INFO_PLANNED] = {"source_pack": str(args.crisp), "source_experts_sha256": digest,
                                  "reference_crisp": args.reference_crisp and str(args.reference_crisp),
                                  "source_plan_widths_sha256": plan.widths_digest(), "data": list(args.data),
                                  "holdout_fraction": args.holdout_fraction, "seed": args.seed}
        from crisp_runtime.storage.pack import save_pack

        save_pack(out, variant.layers, plan=chosen, info=new_info)
    except (CliError, OutputPathError) as exc:
        print(f"plan-throughput: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return ca.interrupted("plan-throughput", resumable=False)
    r = record.search["chosen"]
    progress(f"chose {r['candidate']} ({variant.layout.name}): {r['x_full_lru']:.2f}x full-width LRU, accuracy loss "
             f"{r['accuracy_loss']:.2%} +- {r['accuracy_loss_se'] or 0:.2%} ({r['accuracy_mode']}); wrote {out}")
    return 0


def _plan_budgets(args, out, layers, plan, info, layout, count: int, progress) -> int:
    """--gpu-budget: one stored choice per budget (``throughput.search_budgets``), the pack's experts and plan
    unchanged; writes the new pack folder."""
    from crisp_runtime.storage.pack import save_pack
    from crisp_runtime.storage.serving_record import budget_base_bytes

    if args.tail_layouts or args.search_tier_widths or args.reference_crisp is not None:
        raise CliError("--gpu-budget: a short search on the pack's own bytes and plan (no --tail-layouts, "
                       "--search-tier-widths or --reference-crisp; use --budget for those)")
    if not layout.is_plain:
        raise CliError(f"--gpu-budget: --crisp {args.crisp} is a {layout.name} tail pack; its loss is relative to the "
                       "4-bit pack: use --budget with --reference-crisp")
    try:
        fractions = budget_fractions(args.gpu_budget, budget_base_bytes(layers))
        goals = [ThroughputGoal(f, args.max_accuracy_loss, args.hardware_profile,
                                confidence=args.accuracy_confidence) for f in fractions]
    except (ValueError, OSError) as exc:
        raise CliError(f"--gpu-budget: {exc}") from None
    texts = load_texts(args.data)
    _, holdout = split_texts(texts, args.holdout_fraction)
    windows = accuracy_windows_of(holdout, count, args.throughput_seq_len, args.seed, args.holdout_fraction)
    heldout = heldout_source = None
    if args.heldout_data is not None:
        heldout = random_windows(load_texts(args.heldout_data), args.heldout_windows, args.throughput_seq_len,
                                 args.seed, "--heldout-data", seq_len_option="--throughput-seq-len")
        heldout_source = " ".join(map(str, args.heldout_data))
    model, _ = source_model(args, layers, info)
    check_seq_len(model, args.throughput_seq_len, "--throughput-seq-len")
    check_vocab(model, windows)
    source = (f"held-out calibration windows ({count} x {args.throughput_seq_len} tokens of the last "
              f"{args.holdout_fraction:.0%} of --data; the first {args.throughput_windows} traced)")
    with threads(args.threads):
        choices = search_budgets(model, layers, plan, windows[: args.throughput_windows], goals,
                                 accuracy_windows=windows, heldout_windows=heldout, heldout_source=heldout_source,
                                 source=source, workers=args.simulation_workers, search=args.budget_search,
                                 log=progress)
    if choices is None:
        raise CliError(f"--gpu-budget: no candidate within {args.max_accuracy_loss:.2%} at any budget; the pack "
                       "is left as it was (the default rule applies)")
    new_info, digest = derived_info(info, drop=(INFO_PLANNED,))
    new_info[SERVING_KEY] = choices.to_dict()
    new_info[INFO_PLANNED] = {"source_pack": str(args.crisp), "source_experts_sha256": digest,
                              "reference_crisp": None, "source_plan_widths_sha256": plan.widths_digest(),
                              "data": list(args.data), "holdout_fraction": args.holdout_fraction, "seed": args.seed,
                              "command": "python -m crisp_tools.plan_throughput " + " ".join(sys.argv[1:])}
    save_pack(out, layers, plan=plan, info=new_info)
    for c in choices.choices:
        r = c.search["chosen"]
        progress(f"{c.gpu_budget_fraction:.0%}: {r['candidate']}, {r['x_full_lru']:.2f}x full-width LRU, loss "
                 f"{r['accuracy_loss']:.2%} (calibration hold-out)"
                 + ("" if "accuracy_loss_heldout" not in c.search else
                    f", {c.search['accuracy_loss_heldout']:.2%} held out"))
    progress(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
