"""``crisp-bench simulate``: its options and the run (inputs, plans, configurations, the simulator of
``bench.simulate``, accuracy attached from evaluations, tables, headline, plot, JSON)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from crisp_tools.text import read_texts, sample_sequences

from crisp_kernels import PackFormatError
from crisp_kernels.tail_layout import PLAIN, TailLayout, TailSegment, parse_tail_layout
from crisp_runtime import cli_args as ca
from crisp_runtime.hf.moe_layers import max_positions
from crisp_runtime.planning.plan import CrispPlan
from crisp_runtime.planning.serving import SERVING_POLICIES, serving_by_name
from crisp_runtime.scheduling.prefetch import PrefetchWidth

from . import common, report
from . import simulate as sim
from . import traces as tr
from .common import ORDERS, POLICIES, REPO_ROOT, CliError, find_plan_file, load_model_for_bench
from .profiles import BUILTIN_PROFILES, MEASURED_PROFILE_FILE, PAPER_LAYER_MS, get_profile, profiles_with_cpu
from .shapes import TARGETS, ModelShape
from .sim_policies import (
    DEFAULT_POLICY,
    accuracy_for,
    configurations,
    default_accuracy,
    default_configuration,
    frontier,
    knobs,
    plot_configurations,
    plot_frontier,
    read_accuracy,
    with_prefetch_widths,
)
from .sim_policies import MATRICES as SIM_MATRICES
from .simulate import EVICTIONS as SIM_EVICTIONS
from .simulate import ONLINE_EVICTIONS, PIN_SHARE, SimPolicy, check_eviction
from .tail_sim import TailMapping

SERVING_NAMES = tuple(SERVING_POLICIES)
PREFETCH_WIDTHS = tuple(w.value for w in PrefetchWidth)
# evaluations whose accuracy_loss simulate attaches to its records (when of the traced model)
DEFAULT_ACCURACY = ("bench/results/eval-tiny-mixtral.json", "bench/results/eval-serving-tiny-mixtral.json")
DEFAULT_BUDGET = 0.25  # of the 4-bit expert bytes: the budget the paper's headline figures use
SWEEP = (0.10, 0.15, 0.20, 0.25, 0.30, 0.40, 0.50, 0.60, 0.75)

# the argument types and option groups of bench.common under the names this module uses
_csv, _fraction, _fractions, _int_list, _positive_int = (
    common.csv_choices, common.fraction, common.fractions, common.int_list, common.positive_int)
_outputs, _model_args, _rel, _emit = common.add_outputs, common.add_model_args, common.rel, common.emit


def _checked_list(check, what: str, choices: str = ""):
    """An argparse type: comma-separated names, each passed to ``check`` (a ValueError names what is wrong)."""
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected {what} names, got {text!r}{choices}")
        for item in items:
            try:
                check(item)
            except ValueError as exc:
                raise argparse.ArgumentTypeError(str(exc)) from None
        return items
    return parse


# --serving: names planning.serving.serving_by_name takes; --eviction: names bench.simulate.check_eviction takes
_serving_list = _checked_list(serving_by_name, "policy")
_eviction_list = _checked_list(check_eviction, "eviction", f"; choose from {', '.join(SIM_EVICTIONS)}")


SIMULATE_EPILOG = """\
how the simulator reads the paper (profile rtx4090-pcie4):
  The paper's per-expert figures (full-width Mixtral expert: 7.5 ms load, 0.8 ms compute;
  3.8 / 0.4 ms at 50%) and its layer breakdown (14.4 ms = 11.2 ms loading the two routed
  experts + 2.6 ms compute + 0.4 ms router) do not add up: two uncached loads take 15.0 ms
  and two computes 1.6 ms. The profile takes the per-expert figures as ground truth: load =
  0.1 ms + 7.4 ms x width fraction (affine fit of the two points), compute = 0.8 ms x width
  fraction, router 0.4 ms, plus 1.0 ms of other compute per layer (2.6 - 2 x 0.8) that does
  not shrink with width. The paper's 11.2 ms of loading is then ~1.5 full loads per layer,
  i.e. a ~25% hit rate; the simulator prints its own breakdown beside the paper's.

mapping a small model's traces onto --target mixtral-8x7b:
  target layer l replays traced layer (l mod L) for the same token; expert ids and router
  order are kept (needs 8 experts, top-2); widths are kept as fractions of I and scaled to
  I=14336; expert bytes are Mixtral's (H=4096, I=14336) in CRISP's 4-bit format (g64 with
  zero points: 6,720 B/neuron, 96.3 MB/expert, 24.7 GB for 256 experts). Attention, norms
  and the KV cache are resident outside the budget; the budget holds expert prefixes in one
  LRU cache shared by all layers. Batch 1, steady state (the first --warmup tokens fill the
  cache and are not counted).

policies (CrispPlan): full = every routed expert full width (full + LRU = the
  mixtral-offloading-style baseline); uniform = every expert at one width (default: the
  width giving CRISP's bytes per token); skip_aux = dominant expert full, the other skipped when
  its routing weight is under the threshold giving CRISP's bytes per token (always without a
  CRISP plan), as crisp-eval does; crisp = tiers over expert pairs from the committed plan
  (--plan auto derives one from the trace itself).
"""

def add_parser(subparsers) -> None:
    """The ``crisp-bench simulate`` subcommand's options."""
    p = subparsers.add_parser(
        "simulate", help="predict decoding on another GPU from routing traces",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=SIMULATE_EPILOG,
        description="Discrete-event simulation of batch-1 decoding (router, copy engine, compute "
        "engine, other per-layer work) fed with routing traces and a hardware profile; tokens/s and "
        "bytes per token per policy at a GPU budget.")
    p.add_argument("--profile", default="rtx4090-pcie4", type=ca.nonempty_path,
                   help=f"hardware profile: {', '.join(BUILTIN_PROFILES)}, measured (see --profile-file), or PATH.json")
    p.add_argument("--profile-file", metavar="PATH", default=None, type=ca.nonempty_path,
                   help=f"file of the 'measured' profile (default {MEASURED_PROFILE_FILE})")
    p.add_argument("--trace", metavar="PATH.npz", type=ca.nonempty_path,
                   help="routing trace to replay (default: record one from --model)")
    p.add_argument("--record-trace", metavar="PATH.npz", type=ca.nonempty_path, help="save the recorded trace here")
    _model_args(p)
    p.add_argument("--sequences", type=_positive_int, default=8, help="sequences to record (default 8)")
    p.add_argument("--seq-len", type=_positive_int, default=256, help="tokens per recorded sequence (default 256)")
    p.add_argument("--tokens", type=_positive_int, default=None, help="replay only the first N traced tokens")
    p.add_argument("--plan", default=None, type=ca.nonempty_path,
                   help="CRISP plan: a plan JSON, a pack folder, or 'auto' (derive from the trace); "
                   "default: the pack's plan")
    p.add_argument("--target", default="mixtral-8x7b", choices=[*TARGETS, "native"],
                   help="model whose layer count and expert sizes the trace is mapped onto (default mixtral-8x7b)")
    p.add_argument("--budget", type=_fraction, default=None,
                   help=f"GPU budget as a fraction of the model's 4-bit expert bytes (default {DEFAULT_BUDGET}; with "
                   "--matrix stored the stored choice's budget)")
    p.add_argument("--budget-sweep", action="store_true", help="sweep the budget from 10%% to 75%%")
    p.add_argument("--policies", type=_csv(POLICIES), default=list(POLICIES), help="comma separated")
    p.add_argument("--orders", type=_csv(ORDERS), default=list(ORDERS), help="comma separated")
    p.add_argument("--uniform-width", type=_fraction, default=None,
                   help="width of the uniform policy (fraction of I; default: CRISP's bytes per token)")
    p.add_argument("--compare", metavar="E2E.json", type=ca.nonempty_path,
                   help="an `e2e --json` file measured on this machine: print the prediction error per policy "
                   "(widest-first order against a GPU run, serial against a CPU run)")
    p.add_argument("--cache-scope", choices=("global", "layer"), default="global",
                   help="global: one cache over all layers (CRISP's runtime, default); layer: the budget split into "
                   "one cache per layer (mixtral-offloading's per-layer slots; needs >= 1 expert per layer)")
    p.add_argument("--matrix", choices=SIM_MATRICES, default="product",
                   help="product (default): every --policies x --serving x --eviction x --prefetch; residency: "
                   "the residency comparison (full-width LRU / Belady, the paper's CRISP, residency-aware CRISP with "
                   "and without prefetch, Belady bound, uniform / skip_aux with the same machinery); frontier: each "
                   "family swept over its knob (for --plot: tokens/s against accuracy loss); hybrid: the "
                   "CPU placements (GPU-only full LRU, static_hybrid, cpu_only, CRISP GPU-only and hybrid; needs a "
                   "--profile with a CPU, e.g. rtx4090-pcie4-ddr5; docs/hybrid.md); stored: full-width LRU and the "
                   "serving choice (policy, eviction, prefetch width, budget) that crisp-profile --plan-for-throughput "
                   "stored in the --plan / --pack folder, with that pack's plan")
    p.add_argument("--serving", type=_serving_list, default=["plan"],
                   help=f"serving policies (planning.serving), comma separated: {', '.join(SERVING_NAMES)}, "
                   "or resident-floorP[-narrow-aux][-revive] (a missed dominant at P%% of the full width; "
                   "serving.serving_by_name) (default plan: the plan's widths whatever is resident)")
    p.add_argument("--eviction", type=_eviction_list, default=["lru"],
                   help=f"eviction policies, comma separated: {', '.join(SIM_EVICTIONS)} (tier: the plan's Hot "
                   f"experts kept over Warm over the rest; NAME+pinned for {', '.join(ONLINE_EVICTIONS)}: the "
                   f"trace's most used experts pinned, up to {100 * PIN_SHARE:g}%% of the budget; belady: offline "
                   "furthest next use, the reference, never pinned). The full-width LRU baseline is simulated whenever "
                   "--policies has full (the default), whatever the others use")
    p.add_argument("--prefetch", choices=("none", "trace"), default="none",
                   help="trace: also prefetch the next layer's experts the trace predicts (recorded by "
                   "crisp_runtime.scheduling.prefetch); none (default)")
    p.add_argument("--prefetch-width", type=_csv(PREFETCH_WIDTHS), default=["plan"],
                   help="with --prefetch trace: the width each predicted slot is prefetched at, comma separated "
                   "(each prefetching configuration once per width): plan (default: the plan's widths), serving "
                   "(what the serving policy loads on a miss: a dominant's floor, an auxiliary at the plan's width or "
                   "none if skipped), aux-none (dominants only, at the plan's width); scheduling.prefetch")
    p.add_argument("--accuracy", metavar="EVAL.json", action="append", default=None, type=ca.nonempty_path,
                   help="evaluation JSON(s) giving accuracy_loss per configuration (crisp-eval --json; the "
                   "runtime-in-the-loop serving evaluation); default: those under bench/results/ for the traced model")
    p.add_argument("--from-json", metavar="SIM.json", type=ca.nonempty_path, action="append", default=None,
                   help="re-report the records of earlier `simulate --json` runs of the same trace (repeatable: "
                   "their records are merged) with accuracy attached anew from --accuracy, without simulating")
    p.add_argument("--tail-layout", type=_tail_layout, default=PLAIN, metavar="LAYOUT",
                   help="precision layout of the simulated pack's rows (crisp_kernels.tail_layout): q4 (default, "
                   "every row 4-bit), m432, m42, q3, or BITSgGROUP@START,... (e.g. 3g64@0.25,2g128@0.5: rows from "
                   "25%% of I at 3 bits, from 50%% at 2 bits). Every configuration runs on the layout's bytes; the "
                   "full-width LRU baseline stays 4-bit; accuracy is attached only from evaluations of the same "
                   "layout (crisp-eval on a crisp_tools.tail_emulation pack)")
    p.add_argument("--no-default", dest="default", action="store_false",
                   help=f"leave out the {DEFAULT_POLICY} records (default matrix: what crisp_runtime.apply runs with "
                        "only a gpu_budget at each budget, from the --plan / --pack folder's pack.json: its stored "
                        "serving choice or the default rule, and cpu=auto's decision on the profile's bandwidths)")
    p.add_argument("--warmup", type=ca.nonnegative_int, default=None,
                   help="tokens that fill the cache first, not counted (default: min(32, a quarter of the trace))")
    _outputs(p)


def implicit_inputs(args) -> dict:
    """The files simulate reads when their option is left out (``cli`` refuses an output onto any of them)."""
    inputs: dict = {}
    if args.accuracy is None:
        inputs["--accuracy (default)"] = [REPO_ROOT / f for f in DEFAULT_ACCURACY]
    if args.profile == "measured" and args.profile_file is None:
        inputs["--profile-file (default)"] = MEASURED_PROFILE_FILE
    return inputs


def _tail_layout(value: str) -> TailLayout:
    try:
        return parse_tail_layout(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _check_pack_layout(args) -> None:
    """A --plan pack folder that stores a 2-bit tail (crisp_tools.tail_pack) is simulated with its own layout:
    its widths mean rows of that layout, and its accuracy is that layout's (simulating it as 4-bit rows would
    put a tail pack's loss on 4-bit bytes without a word)."""
    option, folder = ("--plan", args.plan) if args.plan is not None else ("--pack", getattr(args, "pack", None))
    if folder is None or not Path(folder).is_dir() or not (Path(folder) / "pack.json").is_file():
        return
    from crisp_runtime.cli_args import read_json

    try:
        info = read_json(Path(folder) / "pack.json", option)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if not isinstance(info, dict) or info.get("tail_start") is None:
        return
    spec = info.get("tail_layout") or {}
    stored = tuple(tuple(seg) for seg in spec.get("segments", ())) if isinstance(spec, dict) else ()
    given = tuple((seg.start, seg.bits, seg.group_size) for seg in args.tail_layout.segments)
    if stored != given:
        try:
            want = f"--tail-layout {TailLayout('stored', tuple(TailSegment(*seg) for seg in stored)).spec()}"
        except (TypeError, ValueError):
            want = f"its layout ({spec!r} in pack.json)"
        raise CliError(f"{option} {folder}: a 2-bit tail pack; simulate it with {want} (got --tail-layout "
                       f"{args.tail_layout.spec()})")


def run(args) -> int:
    t0 = time.perf_counter()
    if args.trace and args.record_trace:
        raise CliError("--record-trace saves a trace recorded from --model; with --trace nothing is recorded "
                       "(leave out one of them)")
    _check_pack_layout(args)
    profile, shape, trace, plans, notes, stored, pack_info = _simulation_inputs(args)
    layout = args.tail_layout
    print(f"simulate: profile {profile.name} ({profile.description or profile.source})")
    if args.budget is None:  # the stored choice's budget with --matrix stored, else 25%
        args.budget = stored.gpu_budget_fraction if stored is not None else DEFAULT_BUDGET
    budgets = list(SWEEP) if args.budget_sweep else [args.budget]
    if args.warmup is None:
        args.warmup = min(32, trace.num_tokens // 4)
    if args.warmup >= trace.num_tokens:
        raise CliError(f"--warmup must lie in [0, {trace.num_tokens}) for a trace of {trace.num_tokens} tokens")
    predicted = getattr(trace, "predicted", None)
    if stored is not None and stored.prefetch is not None and predicted is None:
        raise CliError("--matrix stored: the stored choice prefetches, and the trace holds no next-layer predictions "
                       "(use bench/traces/heldout-predicted.npz or record one with this version)")
    if args.prefetch == "trace" and predicted is None:
        raise CliError("--prefetch trace: the trace holds no next-layer predictions (record one with this version: "
                       "`crisp-bench simulate --record-trace`, or use bench/traces/heldout-predicted.npz)")
    accuracy_files = args.accuracy if args.accuracy is not None else [
        str(REPO_ROOT / f) for f in DEFAULT_ACCURACY if (REPO_ROOT / f).is_file()]
    try:
        evaluated, acc_notes = read_accuracy(accuracy_files, trace.meta.get("model"), plans.get("crisp"))
    except ValueError as exc:
        raise CliError(str(exc)) from None
    notes += acc_notes
    # an evaluation applies to records of its own tail layout only (accuracy_for matches them per record)
    of_layout = [r for r in evaluated if r["tail_layout"] == layout.name]
    if len(of_layout) < len(evaluated):
        notes.append(f"accuracy: {len(evaluated) - len(of_layout)} evaluated configurations of other tail layouts "
                     f"than {layout.name}: attached to records of their own layout only")
    _adopt_evaluated_knobs(plans, of_layout, args, notes)  # before the configurations are built from the plans
    prefetch = [False, True] if args.prefetch == "trace" else [False]
    try:
        configs = configurations(plans, args.matrix, serving=args.serving, evictions=args.eviction,
                                 prefetch=prefetch if args.matrix != "product" else
                                 ([True] if args.prefetch == "trace" else [False]), stored=stored)
    except KeyError as exc:
        raise CliError(f"--matrix {args.matrix} needs policy {exc} in --policies") from None
    defaults = _default_configurations(args, plans, pack_info, trace, profile, budgets, notes)
    if profile.cpu_bytes_per_s is not None and defaults and args.matrix == "product" and "full" in plans:
        configs.append(SimPolicy("full", plans["full"], SERVING_POLICIES["static_hybrid"]))  # the hybrid's baseline
    if args.prefetch_width != ["plan"]:
        if args.matrix == "frontier":
            raise CliError("--prefetch-width: the frontier matrix prefetches at the plan's widths only (plan)")
        if not any(c.prefetch for c in configs):
            raise CliError(f"--prefetch-width {','.join(args.prefetch_width)}: no configuration of this run "
                           "prefetches; add --prefetch trace")
        configs = with_prefetch_widths(configs, args.prefetch_width)
    meta = {c.label: m for c, m in frontier(plans, prefetch[-1])} if args.matrix == "frontier" else {}
    mapping = None
    if not layout.is_plain:
        mapping = TailMapping(layout, trace, shape)
        try:
            mapped = [mapping.mapped_policy(c) for c in configs]
        except ValueError as exc:
            raise CliError(f"--tail-layout {layout.name}: {exc}") from None
        notes.append(mapping.note())
    for n in notes:
        print(f"  {n}")
    if args.from_json:
        this_run = {"profile": profile.name, "target": shape.name, "tokens": trace.num_tokens - args.warmup,
                    "budget_fraction": budgets}
        records = [r for path in args.from_json for r in _previous_records(path, this_run, _trace_digest(trace))]
        budgets = sorted({r["budget_fraction"] for r in records})
        print(f"  records of {', '.join(args.from_json)} re-reported (not simulated again); accuracy attached anew")
    else:
        records = []
        for b in budgets:
            prog = report.Progress(f"simulating budget {b:.0%}")

            def step(config, done, n, prog=prog, run=configs if mapping is None else mapped):
                prog(run.index(config) * n + done, len(run) * n)

            if mapping is None:
                records += sim.simulate_policies(trace, configs, profile, shape, b, orders=args.orders,
                                                 warmup=args.warmup, cache_scope=args.cache_scope,
                                                 predicted=predicted, progress=step)
                if b in defaults:  # the product's default at this budget (crisp_runtime.planning.defaults)
                    records += _default_records(trace, defaults[b], profile, shape, b, args, predicted)
                continue
            # the baseline (mixtral-offloading's 4-bit full-width LRU) unmapped, then every configuration on the
            # layout's bytes at the same GPU budget in bytes
            base = [c for c in configs if c.label == BASELINE][:1]
            records += sim.simulate_policies(trace, base, profile, shape, b, orders=args.orders, warmup=args.warmup,
                                             cache_scope=args.cache_scope, predicted=predicted)
            layout_records = sim.simulate_policies(
                mapping.mapped_trace(), mapped, profile, mapping.mapped_shape(), b, orders=args.orders,
                warmup=args.warmup, cache_scope=args.cache_scope, predicted=predicted, progress=step,
                budget_bytes=int(b * shape.total_expert_nbytes))
            for r in layout_records:
                r["tail_layout"] = layout.name
            records += layout_records
        by_label = {c.label: c for c in configs}
        for r in records:
            r["profile"] = profile.name
            r["target"] = shape.name
            if r["policy"] == DEFAULT_POLICY:
                continue  # its knobs and choice were set with it (_default_records)
            r.update(knobs(by_label[r["label"]]))
            r.update(meta.get(r["label"], {}))
            r.setdefault("tail_layout", PLAIN.name)
            if r["tail_layout"] != PLAIN.name:
                r["label"] = f"{r['label']}@{r['tail_layout']}"
    for r in records:
        if r["policy"] == DEFAULT_POLICY and r["budget_fraction"] in defaults:
            r["accuracy_loss"], r["accuracy_source"] = default_accuracy(r, defaults[r["budget_fraction"]][1],
                                                                        evaluated)
        else:
            r["accuracy_loss"], r["accuracy_source"] = accuracy_for(r, evaluated)
    _print_simulation(records, budgets, args, shape)
    headline = _headline(records, budgets)
    for line in headline["lines"]:
        print(line)
    if profile.name == "rtx4090-pcie4" and shape.name == "mixtral-8x7b":
        print(_paper_comparison(records, args.budget if not args.budget_sweep else 0.25))
    comparison = _compare_e2e(args.compare, records, budgets[0]) if args.compare else None
    if args.plot:
        _plot_simulation(args.plot, records, budgets, profile, shape, trace, args.matrix)
        print(f"wrote {args.plot}")
    _emit(args, "simulate", records, profile=profile.to_dict(), target=shape.__dict__, mapping=notes,
          trace={"digest": _trace_digest(trace), "tokens": trace.num_tokens, "warmup": args.warmup},
          plans={k: v.to_dict() if k != "crisp" else {"description": v.description, "tier_widths": vars(v.tier_widths),
                                                      **({} if v.width_cap is None else {"width_cap": v.width_cap}),
                                                      **({} if v.aux_full_weight is None
                                                         else {"aux_full_weight": v.aux_full_weight}),
                                                      **({} if v.aux_skip_weight is None
                                                         else {"aux_skip_weight": v.aux_skip_weight})}
                 for k, v in plans.items()},
          headline={k: v for k, v in headline.items() if k != "lines"}, comparison=comparison)
    print(f"simulate: {time.perf_counter() - t0:.1f} s")
    return 0


def _simulation_inputs(args):
    """(profile, target shape, trace, plans, notes, stored serving choice or None) for ``simulate``."""
    profile = get_profile(args.profile, args.profile_file)
    _check_profile_has_cpu(args, profile)
    notes: list[str] = []
    pack_dir = None
    if args.trace:
        trace = tr.Trace.load(args.trace)
        notes.append(f"trace {args.trace}: {trace.num_layers} layers x {trace.num_tokens} tokens, "
                     f"E={trace.num_experts}, top-{trace.top_k}, I={trace.intermediate_size} "
                     f"({trace.meta.get('model', '?')}, {trace.meta.get('source', '')})")
    else:
        model, pack_dir = load_model_for_bench(args.model, args.pack, need_pack=args.plan is None)
        trace = _record(model, args)
        notes.append(f"trace recorded from {_rel(args.model)} on {_rel(args.text)}: {trace.num_layers} layers x "
                     f"{trace.num_tokens} tokens ({args.sequences} x {args.seq_len}, teacher-forced = decode routing)")
        if args.record_trace:
            trace.save(args.record_trace)  # atomically
            notes.append(f"trace saved to {args.record_trace}")
    if args.tokens:
        if args.tokens > trace.num_tokens:
            raise CliError(f"--tokens {args.tokens}: the trace holds {trace.num_tokens} tokens; give at most that "
                           "(or leave --tokens out to replay them all)")
        trace = trace.head(args.tokens)
    # The CRISP plan.
    crisp_plan = None
    if "crisp" in args.policies or args.uniform_width is None:
        crisp_plan = _load_crisp_plan(args.plan, pack_dir, trace, notes)
    uniform = None if args.uniform_width is None else max(1, round(args.uniform_width * trace.intermediate_size))
    plans = tr.policy_plans(trace, crisp_plan, uniform)
    plans = {k: v for k, v in plans.items() if k in args.policies}
    if args.target == "native":
        hidden = trace.meta.get("hidden_size")  # the trace checked it is a positive integer when present
        if hidden is None or hidden % ModelShape.group_size:
            raise CliError(f"--target native: the trace's hidden_size {hidden!r} must be a multiple of the 4-bit "
                           f"format's group size {ModelShape.group_size} (record the trace with this version)")
        shape = ModelShape(f"native ({trace.meta.get('model', 'traced model')})", trace.num_layers,
                           trace.num_experts, trace.top_k, hidden, trace.intermediate_size)
        notes.append(f"target native: {shape.num_layers} layers, expert {shape.expert_nbytes / 1e3:.1f} kB")
    else:
        shape = TARGETS[args.target]
        if (trace.num_experts, trace.top_k) != (shape.num_experts, shape.top_k):
            raise CliError(f"trace has E={trace.num_experts}, top-{trace.top_k}; target {shape.name} needs "
                           f"E={shape.num_experts}, top-{shape.top_k} (use --target native)")
        notes.append(f"target {shape.name}: {shape.num_layers} layers cycle the {trace.num_layers} traced layers; "
                     f"a traced neuron is {shape.intermediate_size // max(1, trace.intermediate_size)} target neurons "
                     f"(fractions of I kept); expert {shape.expert_nbytes / 1e6:.1f} MB "
                     f"(H={shape.hidden_size}, I={shape.intermediate_size}, 4-bit g{shape.group_size} + zeros), "
                     f"all experts {shape.total_expert_nbytes / 1e9:.2f} GB")
    if "uniform" in plans:
        how = "given" if args.uniform_width is not None else ("matched to CRISP's bytes/token" if crisp_plan
                                                                  else "default 50%")
        notes.append(f"uniform width {plans['uniform'].uniform_width}/{trace.intermediate_size} ({how})")
    if "skip_aux" in plans:
        th = plans["skip_aux"].skip_threshold
        notes.append("skip_aux: the auxiliary expert always skipped" if th is None else
                     f"skip_aux: auxiliary expert skipped when its routing weight < {th:.3f} "
                     f"(matched to CRISP's bytes/token, as crisp-eval does)")
    if shape.intermediate_size % trace.intermediate_size:
        raise CliError(f"the traced model's I={trace.intermediate_size} does not divide {shape.name}'s "
                       f"I={shape.intermediate_size}: widths cannot be mapped exactly (use --target native)")
    stored = _stored_serving(args, pack_dir, plans, notes) if args.matrix == "stored" else None
    return profile, shape, trace, plans, notes, stored, _pack_info(args, pack_dir)


def _check_profile_has_cpu(args, profile) -> None:
    """--matrix hybrid and the CPU placements of --serving simulate the host CPU: refused, before any work, with a
    profile that has none."""
    if profile.has_cpu:
        return
    on_cpu = [name for name in args.serving if serving_by_name(name).placement.uses_cpu]  # the product matrix's
    if args.matrix == "hybrid":
        what = "--matrix hybrid simulates CPU placements"
    elif on_cpu and args.matrix == "product":
        what = f"--serving {','.join(on_cpu)} runs experts on the host CPU"
    else:
        return
    raise CliError(f"{what}, and --profile {args.profile} has no CPU (no cpu_bytes_per_s); give a --profile with "
                   f"one: {', '.join(profiles_with_cpu())}, or a measured / PATH.json profile with cpu_bytes_per_s")


def _default_configurations(args, plans, pack_info, trace, profile, budgets, notes) -> dict:
    """{budget: (SimPolicy, ServingChoice, CPU used)} of the product's default (``crisp-default``: what
    ``crisp_runtime.apply(model, pack, gpu_budget=B)`` runs with no other argument) in the default matrix
    (``product``) with a CRISP plan and its pack.json; {} otherwise (a note says why when it is left out)."""
    if args.matrix != "product" or "crisp" not in plans or args.tail_layout != PLAIN or args.from_json:
        return {}
    if not args.default:
        return {}
    if pack_info is None:
        notes.append(f"{DEFAULT_POLICY}: left out (no pack.json beside the CRISP plan: give --plan PACK_FOLDER)")
        return {}
    out = {}
    for b in budgets:
        try:
            sim_policy, choice, uses_cpu = default_configuration(plans["crisp"], pack_info, trace.top_k, b, profile)
        except ValueError as exc:
            notes.append(f"{DEFAULT_POLICY}: left out ({exc})")
            return {}
        if sim_policy.prefetch and getattr(trace, "predicted", None) is None:
            notes.append(f"{DEFAULT_POLICY}: left out (it prefetches, and the trace holds no next-layer predictions)")
            return {}
        out[b] = (sim_policy, choice, uses_cpu)
        cpu = "CPU used (cpu=auto: the profile's CPU pays)" if uses_cpu else "GPU only (cpu=auto)"
        notes.append(f"{DEFAULT_POLICY} at {b:.0%}: {sim_policy.label}, {cpu}; {choice.source.value}: {choice.reason}")
    return out


def _default_records(trace, default, profile, shape, budget, args, predicted) -> list[dict]:
    """The records of the product's default at one budget, with its knobs and where its choice came from."""
    sim_policy, choice, uses_cpu = default
    records = sim.simulate_policies(trace, [sim_policy], profile, shape, budget, orders=args.orders,
                                    warmup=args.warmup, cache_scope=args.cache_scope, predicted=predicted)
    for r in records:
        r.update(knobs(sim_policy))
        r["default_choice"] = {**choice.to_dict(), "cpu_used": uses_cpu}
    return records


def _pack_info(args, pack_dir) -> dict | None:
    """pack.json of the --plan folder (else the --pack folder): what the product's default reads; None without one."""
    from crisp_runtime.cli_args import read_json

    folder = args.plan if args.plan not in (None, "auto") and Path(args.plan).is_dir() else pack_dir
    if folder is None or not (Path(folder) / "pack.json").is_file():
        return None
    try:
        info = read_json(Path(folder) / "pack.json", "--plan" if folder == args.plan else "--pack")
    except ValueError as exc:
        raise CliError(str(exc)) from None
    return info if isinstance(info, dict) else None


def _stored_serving(args, pack_dir, plans, notes):
    """--matrix stored: the serving choice stored in the --plan folder (else the --pack folder); refused when
    there is none, when it cannot be simulated, or without the full and crisp policies."""
    from crisp_runtime.cli_args import read_json
    from crisp_runtime.storage.serving_record import serving_record

    option, folder = ("--plan", args.plan) if args.plan is not None else ("--pack", pack_dir)
    if folder is None or folder == "auto" or not Path(folder).is_dir():
        raise CliError(f"--matrix stored: give --plan PACK_FOLDER (a pack crisp-profile --plan-for-throughput wrote; "
                       f"got {option} {folder})")
    where = Path(folder) / "pack.json"
    try:
        # several stored budgets: the choice for --budget (crisp_runtime.planning.defaults' rule for budgets in between)
        record = serving_record(read_json(where, option), where=str(where), budget_fraction=args.budget)
    except (ValueError, PackFormatError) as exc:
        raise CliError(f"--matrix stored: {exc}" + ("; give --budget" if args.budget is None else "")) from None
    if record is None:
        raise CliError(f"--matrix stored: {where} stores no serving choice" + (
            "" if args.budget is None else f" for a budget at or below {args.budget:g}")
            + " (crisp-profile --gpu-budget / --plan-for-throughput stores them)")
    if record.prefetch is not None and record.prefetch.extra_experts:
        raise CliError(f"--matrix stored: {where} prefetches {record.prefetch.extra_experts} extra experts per token, "
                       "which the simulator does not model (the trace holds the predicted top-k only)")
    defaults = (("--serving", args.serving, ["plan"]), ("--eviction", args.eviction, ["lru"]),
                ("--prefetch-width", args.prefetch_width, ["plan"]))
    given = [opt for opt, value, default in defaults if value != default]
    if given:
        raise CliError(f"--matrix stored: {', '.join(given)} would change the stored choice (it names its own "
                       "serving policy, eviction and prefetch width)")
    missing = [k for k in ("full", "crisp") if k not in plans]
    if missing:
        raise CliError(f"--matrix stored needs policies {', '.join(missing)} in --policies")
    pf = "none" if record.prefetch is None else f"{record.prefetch.width.value}-width prefetch"
    notes.append(f"stored serving choice of {_rel(where)}: {record.policy.name}, {record.eviction} eviction, {pf}, "
                 f"budget {record.gpu_budget_fraction:.0%}")
    return record


def _record(model, args):
    limit = max_positions(model)
    if limit is not None and args.seq_len > limit:
        raise CliError(f"--seq-len {args.seq_len} is beyond the model's max_position_embeddings ({limit})")
    try:
        texts = read_texts(args.text)
        seqs = sample_sequences(texts, args.sequences, args.seq_len, seed=0)
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    print(f"recording routing of {args.sequences} x {args.seq_len} tokens ...", file=sys.stderr)
    trace = tr.record_trace(model, seqs, source=_rel(args.text), progress=report.Progress("recording"))
    trace.meta["model"] = _rel(args.model)
    return trace


def _load_crisp_plan(spec, pack_dir, trace, notes):
    if spec == "auto":
        notes.append("crisp plan: derived from the trace itself (tiers by pair frequency, warm aux at 50%)")
        return tr.plan_from_trace(trace)
    path = None
    if spec is not None:
        p = Path(spec)
        if p.is_dir():
            path = find_plan_file(p)
            if path is None:
                raise CliError(f"--plan {spec}: no CRISP plan in that folder")
        elif p.is_file():
            path = p
        else:
            raise CliError(f"--plan {spec}: no such file or folder (or use --plan auto)")
    elif pack_dir is not None:
        path = find_plan_file(pack_dir)
    if path is None:
        raise CliError("no CRISP plan: give --plan PATH (a plan JSON or pack folder) or --plan auto")
    plan = CrispPlan.load(path)
    if plan.policy.value != "crisp":
        raise CliError(f"{path}: is a {plan.policy.value!r} plan, not a CRISP plan")
    tw = plan.tier_widths
    cap = "" if plan.width_cap is None else f", every width capped at {plan.width_cap}"
    if plan.aux_full_weight is not None:
        cap += f", auxiliaries of routing weight >= {plan.aux_full_weight:g} at the dominant width"
    if plan.aux_skip_weight is not None:
        cap += f", auxiliaries of routing weight < {plan.aux_skip_weight:g} skipped"
    notes.append(f"crisp plan: {_rel(path)} (hot/warm/cold aux widths {tw.hot}/{tw.warm}/{tw.cold} of "
                 f"{plan.intermediate_size}{cap}, unseen pairs -> {plan.unseen_tier.value})")
    return plan


def _print_simulation(records, budgets, args, shape) -> None:
    cols = [("label", "policy/serving/eviction"), ("order", "order"), ("tokens_per_s", "tok/s"),
            ("x_lru", "x full LRU"), ("mb_per_token", "MB copied/tok"), ("hit_rate", "hit rate"),
            ("fallbacks_per_token", "narrower/tok"), ("skips_per_token", "skips/tok"), ("loss_pct", "acc. loss %"),
            ("layer_ms", "layer ms"), ("load_ms", "load ms"), ("compute_ms", "compute ms"),
            ("flow_shop_bound_ms", "bound ms")]
    for b in budgets:
        base = _pick(records, BASELINE, "router", b)
        rows = [dict(r, mb_per_token=r["bytes_per_token"] / 1e6,
                     x_lru=r["tokens_per_s"] / base["tokens_per_s"] if base else "",
                     loss_pct="" if r["accuracy_loss"] is None else 100 * r["accuracy_loss"])
                for r in records if r["budget_fraction"] == b]
        print()
        print(report.table(rows, cols, title=f"budget {b:.0%} of expert bytes ({rows[0]['budget_bytes'] / 1e9:.2f} GB)"
                                             f", {shape.name}, {rows[0]['tokens']} tokens; x vs full-width LRU in "
                                             "router order"))


def _previous_records(path, this_run: dict, digest: str) -> list[dict]:
    """The records of an earlier ``simulate --json`` document of the same trace, each simulated with this run's
    profile, target, replayed tokens and one of its budgets (``this_run``: {field: value, budget_fraction: the
    budgets}): records of another run would be re-reported under this run's header."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CliError(f"--from-json {path}: not a readable JSON file ({exc})") from None
    records = doc.get("records") if isinstance(doc, dict) and doc.get("command") == "simulate" else None
    if not records or not all(isinstance(r, dict) and "serving_policy" in r and "label" in r for r in records):
        raise CliError(f"--from-json {path}: not the --json output of this version's `crisp-bench simulate`")
    trace = doc.get("trace")
    if not isinstance(trace, dict) or trace.get("digest") != digest:
        what = "names no trace digest (written by an older version)" if not isinstance(trace, dict) else \
            "simulated another trace (or other --tokens)"
        raise CliError(f"--from-json {path}: {what}; expected a simulation of this run's --trace and --tokens")
    for field, want in this_run.items():
        got = sorted({r.get(field) for r in records}, key=str)
        ok = all(g in want for g in got) if field == "budget_fraction" else got == [want]
        if not ok:
            option = {"profile": "--profile", "target": "--target", "tokens": "--tokens / --warmup",
                      "budget_fraction": "--budget"}[field]
            raise CliError(f"--from-json {path}: its records have {field} {', '.join(map(str, got))}; this run's "
                           f"{option} gives {want if field != 'budget_fraction' else ', '.join(map(str, want))}")
    return records


def _trace_digest(trace) -> str:
    """What identifies a replayed trace in a --json document: a digest of its routing, layers and predictions."""
    import hashlib

    h = hashlib.sha256()
    for a in (trace.index.astype(np.int64), trace.weights.astype(np.float32), np.asarray(trace.layer_ids),
              np.asarray(trace.seq_starts), *(() if trace.predicted is None else (trace.predicted.astype(np.int64),))):
        h.update(str(a.shape).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


def _adopt_evaluated_knobs(plans, evaluated, args, notes) -> None:
    """Simulate uniform / skip_aux at the width / threshold their accuracy was evaluated at (matched to
    CRISP's bytes on the evaluation's text; the trace's own matching differs by a neuron or a few
    thousandths), so that their records carry a measured accuracy_loss."""
    full = plans.get("full") or next(iter(plans.values()))
    e, k, inter, ids = full.num_experts, full.top_k, full.intermediate_size, full.layer_ids
    if "uniform" in plans and args.uniform_width is None:
        ev = next((r for r in evaluated if r["family"] == "uniform" and r["exact"] and r["uniform_width"]), None)
        if ev and ev["uniform_width"] != plans["uniform"].uniform_width:
            plans["uniform"] = CrispPlan.uniform(e, k, inter, ids, int(ev["uniform_width"]))
            notes.append(f"uniform width {ev['uniform_width']}/{inter}: as evaluated in {_rel(ev['source'])}")
    if "skip_aux" in plans:
        ev = next((r for r in evaluated if r["family"] == "skip_aux" and r["exact"] and r["skip_threshold"]), None)
        if ev and ev["skip_threshold"] != plans["skip_aux"].skip_threshold:
            plans["skip_aux"] = CrispPlan.skip_aux(e, k, inter, ids, threshold=float(ev["skip_threshold"]),
                                                   num_dominant=plans["skip_aux"].num_dominant)
            notes.append(f"skip_aux threshold {ev['skip_threshold']:.3f}: as evaluated in {_rel(ev['source'])}")


# the mixtral-offloading-style baseline: full-width experts, LRU, widths independent of the cache
BASELINE = "full/plan/lru"
TARGET_LOSS = 0.02  # the accuracy bound of the speed target: at most 2% relative accuracy loss


def _pick(records, label, order, budget):
    for r in records:
        if r["label"] == label and r["order"] == order and r["budget_fraction"] == budget:
            return r
    return None


def _headline(records, budgets) -> dict:
    """Per budget: the paper's CRISP and the fastest configuration within the accuracy target, against full LRU."""
    out: dict = {"lines": []}
    for b in budgets:
        base = _pick(records, BASELINE, "router", b)
        if base is None:
            continue
        entry: dict = {"full_lru_tokens_per_s": base["tokens_per_s"]}
        today = _pick(records, "crisp/plan/lru", "widest_first", b)
        parts = []
        if today:
            entry["crisp_today_x"] = today["tokens_per_s"] / base["tokens_per_s"]
            parts.append(f"the paper's CRISP (widest-first) {entry['crisp_today_x']:.2f}x")
        ok = [r for r in records if r["budget_fraction"] == b and r["policy"] == "crisp" and r["order"] ==
              "widest_first" and r["eviction"] != "belady" and r["accuracy_loss"] is not None
              and r["accuracy_loss"] <= TARGET_LOSS]
        if ok:
            best = max(ok, key=lambda r: r["tokens_per_s"])
            entry.update(best_label=best["label"], best_x=best["tokens_per_s"] / base["tokens_per_s"],
                         best_accuracy_loss=best["accuracy_loss"])
            parts.append(f"best CRISP within {TARGET_LOSS:.0%} loss: {best['label']} {entry['best_x']:.2f}x at "
                         f"{100 * best['accuracy_loss']:.2f}% loss")
        unknown = [r for r in records if r["budget_fraction"] == b and r["policy"] == "crisp"
                   and r["serving"] != "plan" and r["accuracy_loss"] is None and r["order"] == "widest_first"
                   and r["eviction"] != "belady"]
        if unknown:
            fastest = max(unknown, key=lambda r: r["tokens_per_s"])
            parts.append(f"fastest residency-aware CRISP {fastest['label']} "
                         f"{fastest['tokens_per_s'] / base['tokens_per_s']:.2f}x (accuracy not evaluated)")
        out[f"{b:g}"] = entry
        out["lines"].append(f"budget {b:.0%}: full-width LRU {base['tokens_per_s']:.2f} tok/s; " + "; ".join(parts))
    return out


def _compare_e2e(path, records, budget) -> list[dict]:
    """Predicted vs measured tokens/s per policy, from an ``e2e --json`` document."""
    doc = ca.read_json(path, "--compare")
    if not isinstance(doc, dict) or doc.get("command") != "e2e":
        raise CliError(f"--compare {path}: not the --json output of `crisp-bench e2e`")
    measured = doc.get("records")
    if not isinstance(measured, list):
        raise CliError(f"--compare {path}: field 'records' must be a list, got {type(measured).__name__}")
    for i, m in enumerate(measured):
        if not isinstance(m, dict) or not isinstance(m.get("policy"), str):
            raise CliError(f"--compare {path}: records[{i}] must be an object with a string 'policy'")
        for key in ("tokens_per_s", "bytes_per_token"):
            v = m.get(key)
            # the default may copy nothing (everything it serves resident, or computed on the CPU)
            zero_ok = m["policy"] == DEFAULT_POLICY and key == "bytes_per_token"
            numeric = not isinstance(v, bool) and isinstance(v, (int, float)) and (v >= 0 if zero_ok else v > 0)
            if m["policy"] in (*POLICIES, DEFAULT_POLICY) and not numeric:
                raise CliError(f"--compare {path}: records[{i}].{key} must be a "
                               f"{'non-negative' if zero_ok else 'positive'} number, got {v!r}")
    rows = []
    for m in measured:
        order = "widest_first" if str(m.get("device", "cpu")).startswith("cuda") else "serial"
        if m["policy"] == DEFAULT_POLICY:  # what apply runs given only the budget: the record of the same name
            p = next((r for r in records if r["policy"] == DEFAULT_POLICY and r["budget_fraction"] == budget), None)
        else:
            p = _pick(records, f"{m['policy']}/plan/lru", order, budget)
        if p is None:
            continue
        err = p["tokens_per_s"] / m["tokens_per_s"] - 1.0
        rows.append({"policy": m["policy"], "order": order, "predicted_tokens_per_s": p["tokens_per_s"],
                     "measured_tokens_per_s": m["tokens_per_s"], "error": err,
                     "predicted_bytes_per_token": p["bytes_per_token"],
                     "measured_bytes_per_token": m["bytes_per_token"]})
    if not rows:
        raise CliError(f"--compare {path}: no policy in common with this simulation")
    print(report.table(rows, [("policy", "policy"), ("order", "order"), ("predicted_tokens_per_s", "predicted tok/s"),
                              ("measured_tokens_per_s", "e2e tok/s"), ("error", "rel. error"),
                              ("predicted_bytes_per_token", "predicted B/tok"),
                              ("measured_bytes_per_token", "e2e B/tok")],
                       title=f"prediction vs e2e ({path}); target: within 15%"))
    return rows


def _paper_comparison(records, budget) -> str:
    r = _pick(records, BASELINE, "serial", budget)
    if r is None:
        return ""
    p = PAPER_LAYER_MS
    return (f"paper's MoE layer (RTX 4090, full width, serial): {p['total']} ms = load {p['load']} + compute "
            f"{p['compute']} + router {p['router']}\n"
            f"simulated full/serial at {budget:.0%}:              {r['layer_ms']:.1f} ms = load {r['load_ms']:.1f} "
            f"+ compute {r['compute_ms'] + r['other_ms']:.1f} (experts {r['compute_ms']:.1f} + other "
            f"{r['other_ms']:.1f}) + router {r['router_ms']:.1f}; hit rate {r['hit_rate']:.0%}")


def _plot_simulation(path, records, budgets, profile, shape, trace, matrix) -> None:
    stamp = report.environment()["date"]
    note = (f"{profile.name} profile, traces of {trace.meta.get('model', '?')} mapped onto {shape.name}, "
            f"{records[0]['tokens']} tokens, {stamp}")
    if matrix == "frontier":
        plot_frontier(path, [r for r in records if r["budget_fraction"] == budgets[0]],
                      title=f"Simulated tokens/s against accuracy loss at {budgets[0]:.0%} budget ({profile.name}, "
                      f"{shape.name})", note=note)
    elif len(budgets) > 1:
        series: dict = {}
        for r in records:
            if r["order"] == "widest_first" or (r["label"] == BASELINE and r["order"] == "router"):
                label = f"{r['label']} ({r['order'].replace('_', '-')})"
                series.setdefault(label, []).append((100 * r["budget_fraction"], r["tokens_per_s"]))
        report.plot_lines(path, series, xlabel="GPU budget (% of 4-bit expert bytes)", ylabel="decode tokens/s",
                          title=f"Simulated decode throughput vs GPU budget ({profile.name}, {shape.name})", note=note)
    else:
        plot_configurations(path, records, note=note,
                            title=f"Simulated tokens/s at {budgets[0]:.0%} budget ({profile.name}, {shape.name})")
