"""``crisp-eval``: perplexity and next-token accuracy of CRISP against its baselines, at equal bytes.

Policies, all on the same windows of the given text (non-overlapping, spread evenly):

- ``dense``: the unquantized model as loaded (its bytes are those of its own expert dtype);
- ``full``: the pack at full width (4-bit);
- ``crisp``: the pack's plan (Hot / Warm / Cold tiers, measured dominance);
- ``uniform``: every routed expert at one width, the width whose bytes per token are closest to CRISP's;
- ``skip_aux``: the plan's ``num_dominant`` heaviest experts (by routing weight) at full width, the
  others run only when their routing weight is at least a threshold, the one whose bytes per token on
  the routing of the ``full`` run are closest to CRISP's (both matched by ``crisp_runtime.planning.baselines``);
- ``skip_aux_all``: the auxiliary expert always skipped (for reference).

``bytes_per_token`` = expert weight bytes read per token, summed over the MoE layers: for every
expert a token runs, the bytes of its prefix at the width it runs (widths x neuron bytes of the
pack). Independent of any cache: what a cache-less offload has to copy. The ``runtime`` engine
(default) runs the packed experts through ``crisp_runtime.apply`` and reads ``bytes_routed`` from
its counters; the ``reference`` engine dequantizes the pack and masks neurons (``MaskedExperts``),
counting the widths itself. Both must agree (tests check it).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

from crisp_kernels.format import rows_for_neurons
from crisp_kernels.tail_layout import PLAIN
from crisp_runtime import cli_args as ca
from crisp_runtime.execution.runtime import plan_for_layers
from crisp_runtime.planning.baselines import equal_bytes_plans, neurons_per_token
from crisp_runtime.planning.plan import CrispPlan, PolicyKind
from crisp_runtime.storage.outputs import OutputPathError, check_outputs

from . import serving_eval
from .calibration import (
    DTYPES,
    EVAL_SEQ_LEN,
    CliError,
    MaskedExperts,
    TokenScores,
    check_seq_len,
    check_vocab,
    contiguous_windows,
    dump_json,
    load_model,
    load_pack_dir,
    load_texts,
    log,
    model_fingerprint,
    resolve_device,
    score_windows,
    stored_weights,
    threads,
)
from .loss_estimate import finite_or_none, paired_advantage, relative_loss
from .tail_emulation import INFO_EMULATION, emulation_of, reference_pack

EVAL_FORMAT, EVAL_VERSION = "crisp-eval", 1  # the --json document
DECODE_BUDGETS = (0.1, 0.25, 0.5)  # --mode decode's default GPU budgets: the three of the results tables


class Evaluator:
    def __init__(self, model_dir, pack_dir, data, *, samples=None, seq_len=EVAL_SEQ_LEN, batch_size=16, device="cpu",
                 engine="runtime", quiet=False, dtype="auto", reference_dir=None, budgets=None):
        """``budgets``: the --mode decode budget fractions, checked against the pack before the model loads (against
        the reference pack, the base of the fractions, once it is read)."""
        self.t0 = time.time()
        self.quiet = quiet
        if engine not in ("runtime", "reference"):
            raise CliError(f"--engine must be 'runtime' or 'reference', got {engine!r}")
        self.engine = engine
        self.batch_size = batch_size
        texts = load_texts(data)
        self.layers, self.plan, self.info = load_pack_dir(pack_dir)
        self.pack_dir = Path(pack_dir)
        if budgets and reference_dir is None:
            self._check_budgets(budgets, self.layers)
        self.model, self.refs = load_model(model_dir, resolve_device(device), dtype)
        check_seq_len(self.model, seq_len)
        from crisp_runtime.storage.pack import PackMismatchError, check_layers_fit_model

        try:
            check_layers_fit_model(self.layers, self.model, info=self.info)
        except PackMismatchError as exc:
            raise CliError(f"--crisp {pack_dir}: {exc}") from exc
        recorded = (self.info.get("model") or {}).get("weights_sha256")
        if recorded and recorded != model_fingerprint(self.model, self.refs)["weights_sha256"]:
            raise CliError(f"--crisp {pack_dir}: the pack was made from other weights than --model {model_dir}")
        # A profiler search may store a baseline (skip_aux / uniform) when it beat every CRISP setting: evaluated
        # as the pack plan, its paired difference to the matched baseline of its own kind is then ~0.
        if self.plan is None or self.plan.policy is PolicyKind.FULL:
            raise CliError(f"--crisp {pack_dir}: the pack has no CRISP plan (plan.json); run crisp-profile")
        self.tail_layout, self.reference = self._reference(pack_dir, reference_dir)
        if budgets and self.reference is not None:
            self._check_budgets(budgets, self.reference[0])
        self.windows = contiguous_windows(texts, samples, seq_len)
        check_vocab(self.model, self.windows)
        first = next(iter(self.layers.values()))
        # A real 2-bit tail pack (crisp_tools.tail_pack) counts widths in storage rows: its plan is converted
        # once here, so every plan built below (full, matched baselines) is in rows too; records keep the
        # pack plan's digest (neurons), the plan the simulator's CRISP records are of.
        self.plan_digest = self.plan.widths_digest()
        self.real_tail = first.tail_start is not None
        if self.real_tail and engine == "reference":
            raise CliError(f"--crisp {pack_dir}: a 2-bit tail pack runs with --engine runtime (the reference engine "
                           f"masks 4-bit neurons)")
        self.pack_plan, self.plan = self.plan, plan_for_layers(self.plan, self.layers)
        self.inter = first.intermediate_size
        self.neuron_bytes = first.fmt.neuron_nbytes(first.hidden_size)
        self.layer_ids = sorted(self.layers)
        self.top_k = self.plan.top_k
        # bytes per token of the 4-bit full width: the reference pack's when there is one (a tail layout's share)
        full_layer = first if self.reference is None else next(iter(self.reference[0].values()))
        self.full_bpt = self.top_k * len(self.layer_ids) * full_layer.intermediate_size * self.neuron_bytes

    def _check_budgets(self, budgets, base_layers) -> None:
        """Each --budgets fraction of ``base_layers``' expert bytes must hold one token's experts at full width
        (what ``crisp_runtime.apply`` refuses), the rule of ``crisp-bench e2e --budget``."""
        from crisp_bench.simulate import budget_for_fraction

        if self.plan is None:  # refused once the model is loaded ("no CRISP plan")
            return
        total = serving_eval.total_expert_bytes(base_layers)
        for fraction in budgets:
            budget_for_fraction("--budgets", fraction, self.layers, self.plan.top_k, total)

    def log(self, msg):
        log(f"[crisp-eval {time.time() - self.t0:6.1f}s] {msg}", quiet=self.quiet)

    def _reference(self, pack_dir, reference_dir):
        """(the pack's tail layout name, reference (layers, info) or None). A tail-emulated pack
        (crisp_tools.tail_emulation) is measured against the 4-bit pack it came from, never against its
        own full width: without ``--reference-crisp`` that would be a silently wrong reference."""
        try:
            layout = emulation_of(self.info)
        except (TypeError, ValueError) as exc:
            raise CliError(f"--crisp {pack_dir}: {exc}") from None
        if reference_dir is None:
            if layout is not None:
                raise CliError(f"--crisp {pack_dir}: emulates tail layout {layout.name}; its accuracy is relative to "
                               f"the 4-bit pack it came from: pass --reference-crisp (e.g. "
                               f"{self.info.get(INFO_EMULATION, {}).get('source_pack', 'the source pack')})")
            return PLAIN.name, None
        ref_layers, ref_info = reference_pack(reference_dir, self.layers, self.model, pack_dir)
        return (PLAIN.name if layout is None else layout.name), (ref_layers, ref_info)

    def run_decode(self, budgets, window=None, cases=None) -> tuple[list[dict], dict]:
        """Runtime in the loop (``crisp_tools.serving_eval``): every case (default: ``default_cases()``) at every
        budget fraction; ``window`` (a ``PrefetchWindow``) on every prefetching case."""
        from crisp_runtime.storage.pack import CrispPack

        self.log(f"decode: {self.windows.shape[0]} windows x {self.windows.shape[1]} tokens, budgets {budgets}"
                 + ("" if window is None else f", prefetch window {window.name}"))
        pack = CrispPack(self.layers, self.plan, self.info)
        reference = None if self.reference is None else CrispPack(self.reference[0], None, self.reference[1])
        cases = serving_eval.default_cases() if cases is None else cases
        return serving_eval.serving_sweep(self.model, pack, self.windows, budgets, cases, log=self.log, window=window,
                                          reference=reference)

    def prefetch_window(self, profile, target: str):
        """The window of ``profile`` timing ``target``'s expert rows (``native``: this pack's own bytes per row)."""
        from crisp_bench.shapes import TARGETS
        from crisp_bench.simulate import target_window

        if target == "native":
            return profile.prefetch_window(self.neuron_bytes, f"{profile.name}/native")
        shape = TARGETS[target]
        if self.real_tail:  # the target's experts in the layout's rows, as the simulator maps them (exactly)
            from crisp_bench.tail_sim import mapped_target

            shape = mapped_target(emulation_of(self.info), shape)
        try:
            return target_window(profile, shape, self.inter)
        except ValueError as exc:
            raise CliError(f"--target {target}: {exc}") from None

    def neurons(self, width: int) -> int:
        """Neurons of a width of this pack (storage rows of a 2-bit tail pack; ``format.neurons_in_rows``)."""
        return next(iter(self.layers.values())).neurons(width)

    def _plan(self, kind, inter=None, **kw) -> CrispPlan:
        """A baseline plan over ``inter`` rows (default: this pack's; a reference pack's neurons)."""
        args = (self.plan.num_experts, self.top_k, self.inter if inter is None else inter, self.layer_ids)
        if kind == "full":
            return CrispPlan.full(*args)
        return CrispPlan.skip_aux(*args, threshold=kw.get("threshold"), num_dominant=self.plan.num_dominant)

    def run(self, frontier: bool = False) -> list[dict]:
        """The equal-bytes table; ``frontier`` adds uniform at every width and skip-aux at every threshold the
        simulator's frontier sweeps (``crisp_bench.sim_policies``), so its points carry a measured loss."""
        records = []
        n_tok = self.windows.numel()
        self.log(f"{self.windows.shape[0]} windows x {self.windows.shape[1]} tokens, engine={self.engine}")
        dense = score_windows(self.model, self.windows, self.batch_size)
        expert_dtype_bytes = self.refs[0].module.gate_up_proj.element_size()
        dense_bpt = self.top_k * len(self.layer_ids) * self.inter * 3 * self.refs[0].hidden_size * expert_dtype_bytes
        records.append(self._record("dense", "dense (unquantized)", dense_bpt, dense, n_tok))
        self.log(f"dense: ppl {dense.perplexity:.4f} acc {dense.accuracy:.4f}")

        make = self._runtime_runner if self.engine == "runtime" else self._reference_runner
        layout_full = None
        if self.reference is not None:  # the 4-bit reference's full width; then the layout's own
            with make(*self.reference) as run:
                ref_full = run(self._plan("full", next(iter(self.reference[0].values())).intermediate_size))
        with make() as run:
            from crisp_runtime.hf.moe_layers import record_routing

            with record_routing(self.model, self.refs) as trace:
                full = run(self._plan("full"))
            if self.reference is not None:
                full, layout_full = ref_full, full
                label = "4-bit full width (--reference-crisp)"
            else:
                label = "4-bit full width"
            records.append(self._record("full", label, full[1], full[0], n_tok))
            crisp = run(self.plan)
            # the pack plan's own knobs, so that a simulation of that plan matches this row (bench.sim_policies)
            knobs = {k: v for k, v in (("width_cap", None if self.plan.width_cap is None
                                        else self.neurons(self.plan.width_cap)),
                                       ("aux_full_weight", self.plan.aux_full_weight),
                                       ("aux_skip_weight", self.plan.aux_skip_weight)) if v is not None}
            what = "CRISP" if self.plan.policy is PolicyKind.CRISP else self.plan.policy.value
            records.append(self._record("crisp", f"{what} (pack plan)", crisp[1], crisp[0], n_tok, **knobs))
            # uniform and skip-aux matched to CRISP's measured bytes per token on the full-width run's routing
            routing = {i: trace.layer(i) for i in self.layer_ids}
            plans = equal_bytes_plans(self.plan, routing, target=crisp[1] / self.neuron_bytes)
            width = plans["uniform"].uniform_width
            uni = run(plans["uniform"])
            # uniform_width in neurons (what plans and the simulator mean); a tail pack's runs count storage rows
            neurons = self.neurons(width)
            label = f"uniform width {neurons}/{self.pack_plan.intermediate_size}" + (
                f" ({width}/{self.inter} storage rows)" if self.real_tail else "")
            records.append(self._record("uniform", label, uni[1], uni[0], n_tok, uniform_width=neurons))
            threshold = plans["skip_aux"].skip_threshold
            label = "skip auxiliary always" if threshold is None else f"skip auxiliary if weight < {threshold:.3f}"
            sk = run(plans["skip_aux"])
            records.append(self._record("skip_aux", label, sk[1], sk[0], n_tok, skip_threshold=threshold))
            ska = run(self._plan("skip_aux"))
            records.append(self._record("skip_aux_all", "skip auxiliary always", ska[1], ska[0], n_tok))
            crisp_record = next(r for r in records if r["policy"] == "crisp")
            # the standard error of each equal-bytes row's relative loss, paired by window with the full width
            for rec, got in zip(records[-4:], (crisp, uni, sk, ska), strict=True):
                rec["relative_accuracy_loss_vs_full_se"] = finite_or_none(
                    relative_loss(full[0].correct, got[0].correct).standard_error)
            by_policy = {r["policy"]: r for r in records}
            for name, base in (("uniform", uni), ("skip_aux", sk)):  # paired on the same windows
                # the matched run reads a little more or less than the plan (routing moves downstream): the
                # comparison at exactly the plan's bytes interpolates between two runs of the baseline that
                # bracket them (equal_bytes_baseline); the matched run's own difference is kept as _nearest
                nearest = paired_advantage(full[0].correct, crisp[0].correct, base[0].correct)
                crisp_record[f"advantage_vs_{name}_nearest"] = nearest.loss
                crisp_record[f"advantage_vs_{name}_nearest_se"] = finite_or_none(nearest.standard_error)
                exact, detail = self.equal_bytes_baseline(run, name, routing, plans[name], base, crisp[1])
                ahead = paired_advantage(full[0].correct, crisp[0].correct, exact.correct)
                crisp_record[f"advantage_vs_{name}"] = ahead.loss
                crisp_record[f"advantage_vs_{name}_se"] = finite_or_none(ahead.standard_error)
                loss = relative_loss(full[0].correct, exact.correct)
                by_policy[name].update({
                    "equal_bytes_accuracy": exact.accuracy, "equal_bytes_perplexity": exact.perplexity,
                    "equal_bytes_relative_accuracy_loss_vs_full": loss.loss,
                    "equal_bytes_relative_accuracy_loss_vs_full_se": finite_or_none(loss.standard_error),
                    "equal_bytes": detail})
                self.log(f"{what} vs {name} at equal bytes: {ahead.loss:+.2%} +- {ahead.standard_error:.2%} "
                         f"of the full width's accuracy (paired, {ahead.windows} windows)")
            if frontier:
                records += self._frontier(run, n_tok, matched_width=neurons, matched_threshold=threshold)
            if layout_full is not None:
                counted = "its own bytes" if self.real_tail else "4-bit bytes counted"
                records.append(self._record("full_layout", f"{self.tail_layout} full width ({counted})",
                                            layout_full[1], layout_full[0], n_tok))
        full_acc = records[1]["accuracy"]
        for r in records:
            r["relative_accuracy_loss_vs_full"] = (full_acc - r["accuracy"]) / full_acc if full_acc else None
            r["bytes_fraction_of_full"] = r["bytes_per_token"] / self.full_bpt
        return records

    def _frontier(self, run, n_tok, *, matched_width: int, matched_threshold) -> list[dict]:
        """Uniform, skip-aux, capped and weight-promoted CRISP at the simulator's frontier knobs (exact serving: batch =
        runtime in the loop)."""
        from crisp_bench.sim_policies import CRISP_CAPS, PROMOTE_WEIGHTS, SKIP_THRESHOLDS, UNIFORM_FRACTIONS

        first = next(iter(self.layers.values()))
        neurons = self.pack_plan.intermediate_size
        out = []
        for width in sorted({max(1, round(f * neurons)) for f in UNIFORM_FRACTIONS} - {matched_width}):
            rows = rows_for_neurons(width, first.tail_start)
            plan = CrispPlan.uniform(self.plan.num_experts, self.top_k, self.inter, self.layer_ids, rows)
            got = run(plan)
            out.append(self._record("uniform", f"uniform width {self.neurons(rows)}/{neurons} (frontier)", got[1],
                                    got[0], n_tok, uniform_width=self.neurons(rows)))
        for th in sorted(set(SKIP_THRESHOLDS) - {matched_threshold}):
            got = run(self._plan("skip_aux", threshold=th))
            out.append(self._record("skip_aux", f"skip auxiliary if weight < {th:g} (frontier)", got[1], got[0],
                                    n_tok, skip_threshold=th))
        if self.plan.policy is not PolicyKind.CRISP:  # a baseline pack plan has no cap or auxiliary weight
            return out
        for cap in sorted({max(1, round(f * neurons)) for f in CRISP_CAPS}):
            # the cap in the pack's rows, recorded in neurons (as uniform widths are)
            got = run(self.plan.capped(rows_for_neurons(cap, first.tail_start)))
            out.append(self._record("crisp", f"CRISP capped at {cap}/{neurons} (frontier)", got[1], got[0], n_tok,
                                    width_cap=cap))
        skip = self.plan.aux_skip_weight  # a three-band plan is promoted only at weights >= its skip weight
        for weight in (w for w in PROMOTE_WEIGHTS if skip is None or w >= skip):
            got = run(self.plan.promoted(weight))
            out.append(self._record("crisp", f"CRISP, auxiliaries of weight >= {weight:g} at full width (frontier)",
                                    got[1], got[0], n_tok, aux_full_weight=weight))
        return out

    #: extra runs of a baseline to bracket the plan's bytes (each a whole pass over the windows)
    BRACKET_RUNS = 3

    def equal_bytes_baseline(self, run, kind: str, routing, matched: CrispPlan, got: tuple, target_bpt: float
                             ) -> tuple[TokenScores, dict]:
        """``kind``'s scores at exactly ``target_bpt`` bytes per token: the matched run ``got`` (scores, bytes)
        and up to BRACKET_RUNS more of the same family (uniform widths, skip-aux thresholds, matched by
        ``equal_bytes_plans`` on the full-width ``routing`` to a target corrected by the last run's drift from
        its prediction), interpolated per position between the two runs that bracket ``target_bpt`` (weights
        in proportion to their bytes' distance): the paired comparison then gives the baseline neither more
        nor fewer bytes than the plan. Without a bracket (a family at its end, or drift the runs did not
        cross) the nearest run, said so in the detail."""
        def knob(plan):
            return plan.uniform_width if kind == "uniform" else plan.skip_threshold

        def predicted(plan):
            return neurons_per_token(plan, routing) * self.neuron_bytes

        points = [(matched, got[0], float(got[1]))]
        for attempt in range(self.BRACKET_RUNS):
            if any(b <= target_bpt for _, _, b in points) and any(b >= target_bpt for _, _, b in points):
                break
            plan, _, last = points[-1]
            aim = target_bpt - (last - predicted(plan)) + (target_bpt - last) * 2 ** attempt  # past it, other side
            candidate = equal_bytes_plans(self.plan, routing, target=max(aim, 0.0) / self.neuron_bytes)[kind]
            if any(knob(candidate) == knob(p) for p, _, _ in points):
                continue  # the family has no other point there: a farther aim next
            scores, bpt = run(candidate)
            points.append((candidate, scores, float(bpt)))
            self.log(f"{kind} at {knob(candidate)!r}: bytes/token {bpt:,.0f} ({bpt / self.full_bpt:.1%}), "
                     f"bracketing the plan's {target_bpt / self.full_bpt:.1%}")
        below = [p for p in points if p[2] <= target_bpt]
        above = [p for p in points if p[2] >= target_bpt]
        runs = [{"knob": knob(p), "bytes_per_token": b, "accuracy": s.accuracy} for p, s, b in points]
        if not below or not above:
            nearest = min(points, key=lambda p: abs(p[2] - target_bpt))
            return nearest[1], {"interpolated": False, "bytes_per_token": nearest[2], "runs": runs}
        lo, hi = max(below, key=lambda p: p[2]), min(above, key=lambda p: p[2])
        w_lo = 1.0 if hi[2] == lo[2] else (hi[2] - target_bpt) / (hi[2] - lo[2])
        scores = TokenScores(w_lo * lo[1].nll.double() + (1 - w_lo) * hi[1].nll.double(),
                             w_lo * lo[1].correct.double() + (1 - w_lo) * hi[1].correct.double())
        return scores, {"interpolated": True, "bytes_per_token": target_bpt, "weight_below": w_lo,
                        "below": {"knob": knob(lo[0]), "bytes_per_token": lo[2]},
                        "above": {"knob": knob(hi[0]), "bytes_per_token": hi[2]}, "runs": runs}

    def _record(self, policy, label, bpt, scores, n_tok, **extra):
        rec = {"policy": policy, "label": label, "bytes_per_token": float(bpt), "perplexity": scores.perplexity,
               "loss": scores.loss, "accuracy": scores.accuracy, "tokens_scored": int(scores.nll.numel())}
        rec.update(extra)
        if policy != "dense":
            self.log(f"{policy}: bytes/token {bpt:,.0f} ({bpt / self.full_bpt:.1%}) ppl {scores.perplexity:.4f} "
                     f"acc {scores.accuracy:.4f}")
        return rec

    # -- engines: a context manager yielding run(plan) -> (TokenScores, bytes_per_token)
    def _runtime_runner(self, layers=None, info=None):
        import contextlib

        from crisp_runtime.hf.dropin import apply
        from crisp_runtime.storage.pack import CrispPack

        layers = self.layers if layers is None else layers
        info = self.info if info is None else info

        @contextlib.contextmanager
        def runner():
            own = layers is self.layers
            # the device path (cpu="off"): the plans' accuracy with the experts computed exactly, on any machine
            handle = apply(self.model, CrispPack(layers, self.plan if own else self.pack_plan, info),
                           plan=self._plan("full", None if own else next(iter(layers.values())).intermediate_size),
                           cpu="off")
            try:
                def run(plan):
                    handle.set_plan(plan)
                    handle.reset_stats()
                    scores = score_windows(self.model, self.windows, self.batch_size)
                    st = handle.stats()
                    return scores, st["bytes_routed"] / st["tokens"]
                yield run
            finally:
                handle.restore()

        return runner()

    def _reference_runner(self, layers=None, info=None):
        import contextlib

        weights = {lid: stored_weights(layer) for lid, layer in (self.layers if layers is None else layers).items()}

        @contextlib.contextmanager
        def runner():
            def run(plan):
                with MaskedExperts(self.model, self.refs, weights=weights, widths_fn=plan.token_widths,
                                   record=True) as inst:
                    scores = score_windows(self.model, self.windows, self.batch_size)
                used = sum(int(torch.cat(inst.trace.widths[i]).sum()) for i in self.layer_ids)
                tokens = sum(t.shape[0] for t in inst.trace.widths[self.layer_ids[0]])
                return scores, used * self.neuron_bytes / tokens
            yield run

        return runner()


def format_table(records: list[dict]) -> str:
    head = (f"{'policy':<13} {'bytes/token':>12} {'of full':>8} {'perplexity':>11} {'accuracy':>9} "
            f"{'rel. loss':>9}  note")
    lines = [head, "-" * len(head)]
    for r in records:
        rel = r.get("relative_accuracy_loss_vs_full")
        lines.append(
            f"{r['policy']:<13} {r['bytes_per_token']:>12,.0f} {r['bytes_fraction_of_full']:>8.1%} "
            f"{r['perplexity']:>11.4f} {r['accuracy']:>9.4f} {'' if rel is None else f'{rel:>9.2%}'}  {r['label']}"
        )
    return "\n".join(lines)


def verdict(records: list[dict], max_bytes=0.55, max_loss=0.036) -> dict:
    by = {}
    for r in records:  # the first record of a policy: the equal-bytes one (--frontier adds others after it)
        by.setdefault(r["policy"], r)
    c = by["crisp"]
    loss = c["relative_accuracy_loss_vs_full"]
    return {
        "crisp_bytes_fraction": c["bytes_fraction_of_full"],
        "crisp_relative_accuracy_loss": c["relative_accuracy_loss_vs_full"],
        "crisp_relative_accuracy_loss_se": c.get("relative_accuracy_loss_vs_full_se"),
        "bytes_target_met": c["bytes_fraction_of_full"] <= max_bytes,
        # None when the full-width model scores 0 (the relative loss is undefined), never a silent pass.
        "accuracy_target_met": None if loss is None else loss <= max_loss,
        # against each baseline at exactly the plan's bytes (its equal_bytes interpolation) where measured
        "beats_uniform": c["accuracy"] > by["uniform"].get("equal_bytes_accuracy", by["uniform"]["accuracy"]),
        "beats_skip_aux": c["accuracy"] > by["skip_aux"].get("equal_bytes_accuracy", by["skip_aux"]["accuracy"]),
        # (acc_crisp - acc_baseline) / acc_full, paired per window, with its standard error (None: not measured)
        "advantage_vs_uniform": c.get("advantage_vs_uniform"),
        "advantage_vs_uniform_se": c.get("advantage_vs_uniform_se"),
        "advantage_vs_skip_aux": c.get("advantage_vs_skip_aux"),
        "advantage_vs_skip_aux_se": c.get("advantage_vs_skip_aux_se"),
        "bytes_gap_uniform": by["uniform"]["bytes_fraction_of_full"] - c["bytes_fraction_of_full"],
        "bytes_gap_skip_aux": by["skip_aux"]["bytes_fraction_of_full"] - c["bytes_fraction_of_full"],
    }


def build_parser() -> argparse.ArgumentParser:
    p = ca.Parser(
        prog="crisp-eval",
        description="Perplexity and next-token accuracy of a CRISP pack against dense, 4-bit full width, uniform "
        "width and skip-auxiliary at equal expert bytes per token.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", required=True, type=ca.nonempty_path, help="local transformers checkpoint folder")
    p.add_argument("--crisp", required=True, type=ca.nonempty_path,
                   help="CRISP pack folder (from crisp-profile) with its plan")
    p.add_argument("--data", required=True, nargs="+", type=ca.nonempty_path,
                   help="evaluation text (.txt, .jsonl, .jsonl.gz, .json.gz)")
    p.add_argument("--samples", type=ca.positive_int, default=None,
                   help="non-overlapping windows spread over the text (default: all that fit)")
    p.add_argument("--seq-len", type=ca.int_in(2), default=EVAL_SEQ_LEN, help="tokens per window")
    p.add_argument("--batch-size", type=ca.positive_int, default=16, help="windows per forward pass")
    p.add_argument("--device", type=ca.device_name, default="cpu", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--dtype", default="auto", choices=tuple(DTYPES),
                   help="dtype the dense model is loaded in (auto: the checkpoint's)")
    p.add_argument("--threads", type=ca.threads_int, default=None, help="torch CPU threads")
    p.add_argument("--mode", default="batch", choices=("batch", "decode"),
                   help="batch: whole windows per forward, no cache budget (equal-bytes table); decode: teacher-forced "
                        "decode through the runtime's expert cache at each --budgets fraction, one token per forward "
                        "(runtime in the loop; serving policies and prefetch)")
    p.add_argument("--budgets", nargs="+", type=ca.float_in(0.0, 1.0, low_open=True), default=None,
                   metavar="F",
                   help="--mode decode: GPU expert-cache budgets as fractions of all expert bytes of the pack "
                        f"(default: {' '.join(map(str, DECODE_BUDGETS))}; with --stored-serving the stored budget)")
    p.add_argument("--stored-serving", action="store_true",
                   help="--mode decode: evaluate only the serving choice stored in --crisp's pack.json by "
                        "crisp-profile --plan-for-throughput (its policy, prefetch, eviction and budget, with the "
                        "pack's plan), on this text: the held-out check of the throughput search's choice")
    p.add_argument("--default-serving", action="store_true",
                   help="--mode decode: evaluate, at each --budgets fraction, what crisp_runtime.apply(model, pack, "
                        "gpu_budget=B) runs with no other argument on a machine whose CPU does not pay (the pack's "
                        "stored choice for B, else the default rule: crisp_runtime.planning.defaults)")
    p.add_argument("--prefetch-window", default=None, metavar="PROFILE", type=_window_profile,
                   help="--mode decode: admit only the prefetch rows a GPU of this hardware profile copies before the "
                        "next layer's demand (the simulator's timeline, scheduling.copy_window), so the decode "
                        "serves the widths crisp-bench simulate times; a built-in crisp-bench profile ("
                        + ", ".join(_builtin_profiles()) + "), 'measured' or a profile PATH.json; default: none "
                        "(on the CPU every prefetch completes)")
    p.add_argument("--target", default="mixtral-8x7b", choices=(*_targets(), "native"),
                   help="with --prefetch-window: the model whose expert bytes each neuron row of the pack stands for "
                        "(as crisp-bench simulate --target maps a trace; native: the pack's own bytes)")
    p.add_argument("--engine", default="runtime", choices=("runtime", "reference"),
                   help="runtime: crisp_runtime.apply with the packed 4-bit experts; reference: dequantize + mask")
    p.add_argument("--reference-crisp", default=None, metavar="PACK", type=ca.nonempty_path,
                   help="the 4-bit pack whose full width is the reference of every relative loss (required for a "
                        "tail-emulated --crisp from crisp_tools.tail_emulation: its source pack); batch mode only")
    p.add_argument("--frontier", action="store_true",
                   help="batch mode: also uniform at every width and skip-aux at every threshold that crisp-bench "
                        "simulate --matrix frontier sweeps, so that its frontier points carry a measured loss")
    p.add_argument("--json", default=None, metavar="PATH", type=ca.nonempty_path,
                   help="also write the records as JSON (atomically; never onto an input or into the pack or model "
                        "folder, nor onto a file no CRISP tool wrote unless --force)")
    ca.add_force(p)
    p.add_argument("--quiet", action="store_true", help="no progress output")
    return p


def _builtin_profiles() -> list[str]:
    from crisp_bench.profiles import BUILTIN_PROFILES

    return list(BUILTIN_PROFILES)


def _targets() -> list[str]:
    from crisp_bench.shapes import TARGETS

    return list(TARGETS)


def _window_profile(value: str) -> str:
    """--prefetch-window: a built-in profile name, 'measured' or a .json path (read after parsing)."""
    if value in _builtin_profiles() or value == "measured" or (value.endswith(".json") and len(value) > 5):
        return value
    raise argparse.ArgumentTypeError(f"unknown hardware profile {value!r}: choose one of "
                                     f"{', '.join(_builtin_profiles())}, measured or PATH.json")


def _load_window_profile(args):
    """The hardware profile of --prefetch-window (None without it); only with --mode decode."""
    if args.prefetch_window is None:
        return None
    if args.mode != "decode":
        raise CliError("--prefetch-window: only with --mode decode (it times the prefetches of the runtime in the "
                       "loop)")
    from crisp_bench.profiles import ProfileError, get_profile

    try:
        return get_profile(args.prefetch_window)
    except ProfileError as exc:
        raise CliError(f"--prefetch-window {args.prefetch_window}: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        profile = _load_window_profile(args)
        check_outputs({"--json": args.json}, {"--model": args.model, "--crisp": args.crisp, "--data": args.data,
                                              "--reference-crisp": args.reference_crisp}, force=args.force,
                      kinds={"--json": {EVAL_FORMAT, serving_eval.SERVING_EVAL_FORMAT}})
        if args.stored_serving and args.mode != "decode":
            raise CliError("--stored-serving: only with --mode decode (a serving choice depends on the cache)")
        if args.default_serving and (args.mode != "decode" or args.stored_serving):
            raise CliError("--default-serving: only with --mode decode, and not with --stored-serving (the default "
                           "runs a stored choice itself where the pack has one for the budget)")
        info = _pack_info_or_none(args.crisp) if args.stored_serving else None
        if info is not None:  # before loading the model: a pack that stores none fails at once
            stored_cases(info, str(Path(args.crisp) / "pack.json"))
        if args.budgets is not None and args.mode != "decode":
            raise CliError("--budgets: only with --mode decode (batch mode has no cache budget)")
        if args.frontier and args.mode == "decode":
            raise CliError("--frontier: batch mode only (its families are served at their plans' widths, whose outputs "
                           "do not depend on the cache)")
        with threads(args.threads):
            ev = Evaluator(args.model, args.crisp, args.data, samples=args.samples, seq_len=args.seq_len,
                           batch_size=args.batch_size, device=args.device, engine=args.engine, quiet=args.quiet,
                           dtype=args.dtype, reference_dir=args.reference_crisp,
                           budgets=_checked_budgets(args))
            if args.reference_crisp is not None and args.mode == "decode" and not ev.real_tail:
                raise CliError("--reference-crisp with --mode decode: only for a 2-bit tail pack "
                               "(crisp_tools.tail_pack); the runtime's cache on a tail emulation counts 4-bit bytes, "
                               "not the layout's")
            if args.mode == "decode":
                return _decode_main(ev, args, None if profile is None else ev.prefetch_window(profile, args.target))
            records = ev.run(frontier=args.frontier)
    except (CliError, OutputPathError) as exc:
        print(f"crisp-eval: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return ca.interrupted("crisp-eval", resumable=False)
    print(format_table(records))
    v = verdict(records)
    what = "CRISP" if ev.pack_plan.policy is PolicyKind.CRISP else f"The pack plan ({ev.pack_plan.policy.value})"
    loss = v["crisp_relative_accuracy_loss"]
    met = {True: "met", False: "NOT met", None: "unknown: full width scores 0"}[
        None if v["accuracy_target_met"] is None else v["bytes_target_met"] and v["accuracy_target_met"]]
    print(
        f"\n{what} at {v['crisp_bytes_fraction']:.1%} of full-width bytes: relative accuracy loss "
        f"{'undefined' if loss is None else f'{loss:.2%}'} (target <= 3.6% at <= 55%: {met}); "
        f"beats uniform: {v['beats_uniform']}, beats skip-aux: {v['beats_skip_aux']}"
    )
    for name in ("uniform", "skip_aux"):
        ahead, se = v[f"advantage_vs_{name}"], v[f"advantage_vs_{name}_se"]
        if ahead is not None:
            print(f"{what} ahead of {name} at equal bytes: {ahead:+.2%}"
                  f"{'' if se is None else f' +- {se:.2%}'} of the full width's accuracy (paired by window)")
    if args.json:
        dump_json(args.json, {"format": EVAL_FORMAT, "version": EVAL_VERSION,
                              "model": args.model, "crisp": args.crisp, "data": args.data,
                              "tail_layout": ev.tail_layout, "reference_crisp": args.reference_crisp,
                              "windows": list(ev.windows.shape), "engine": args.engine,
                              "full_width_bytes_per_token": ev.full_bpt, "records": records, "verdict": v,
                              "plan_description": ev.plan.description,
                              "plan_widths_sha256": ev.plan_digest,
                              "elapsed_s": round(time.time() - ev.t0, 1)})
    return 0 if all(math.isfinite(r["perplexity"]) for r in records) else 1


def _checked_budgets(args) -> list[float] | None:
    """The --mode decode budget fractions the Evaluator checks before the work (--budgets, else the defaults; with
    --stored-serving and no --budgets each stored choice's own budget: None)."""
    if args.mode != "decode":
        return None
    if args.budgets:
        return list(args.budgets)
    return None if args.stored_serving else list(DECODE_BUDGETS)


def stored_cases(info, where: str) -> list:
    """[(the decode case of a stored serving choice, the stored ``ServingRecord``)], one per stored budget; a
    CliError when the pack stores none (``crisp_runtime.storage.serving_record``)."""
    from crisp_kernels import PackFormatError
    from crisp_runtime.storage.serving_record import serving_choices

    try:
        choices = serving_choices(info, where=where)
    except PackFormatError as exc:
        raise CliError(f"--stored-serving: {exc}") from None
    if choices is None:
        raise CliError(f"--stored-serving: {where} stores no serving choice (crisp-profile --gpu-budget / "
                       "--plan-for-throughput stores them)")
    return [(_case_of(rec), rec) for rec in choices.choices]


def stored_case(info, where: str):
    """(the decode case, the ``ServingRecord``) of a pack's only stored serving choice (:func:`stored_cases`)."""
    cases = stored_cases(info, where)
    if len(cases) > 1:
        raise CliError(f"--stored-serving: {where} stores choices for "
                       f"{', '.join(f'{r.gpu_budget_fraction:g}' for _, r in cases)}")
    return cases[0]


def default_case(ev: Evaluator, budget_fraction: float):
    """The decode case of what ``apply(model, pack, gpu_budget=B)`` runs with no other argument at this budget
    fraction (``crisp_runtime.planning.defaults.choose_serving``; its GPU-only configuration: the decode runs on
    this machine's CPU, where no CPU placement pays)."""
    from crisp_runtime.planning.defaults import choose_serving, pack_facts

    choice = choose_serving(ev.info, pack_facts(ev.info, ev.pack_plan, ev.top_k), budget_fraction)
    cfg = choice.config
    eviction = cfg.eviction if isinstance(cfg.eviction, str) else type(cfg.eviction).__name__
    name = f"crisp-default-{cfg.serving.name}" + ("" if cfg.prefetch is None else "+prefetch")
    ev.log(f"--default-serving at {budget_fraction:g}: {choice.log_line()}")
    return serving_eval.ServingCase(name, "crisp", cfg.serving, cfg.prefetch, eviction=eviction)


def _case_of(rec):
    name = f"crisp-stored-{rec.policy.name}" + ("" if rec.prefetch is None else "+prefetch")
    return serving_eval.ServingCase(name, "crisp", rec.policy, rec.prefetch, eviction=rec.eviction)


def _pack_info_or_none(pack_dir) -> dict | None:
    """pack.json of a pack folder as a dict, or None when it cannot be read (the pack's loader then says why)."""
    try:
        info = ca.read_json(Path(pack_dir) / "pack.json", "--crisp")
    except ValueError:  # JsonInputError
        return None
    return info if isinstance(info, dict) else None


def _decode_main(ev: Evaluator, args, window=None) -> int:
    cases, budgets = None, args.budgets or list(DECODE_BUDGETS)
    if args.stored_serving:  # each stored choice at its own budget (with --budgets: the choice for each)
        from crisp_runtime.storage.serving_record import serving_choices

        stored = stored_cases(ev.info, str(Path(args.crisp) / "pack.json"))
        choices = serving_choices(ev.info)
        runs = [(b, choices.for_fraction(b)) for b in args.budgets] if args.budgets else [
            (rec.gpu_budget_fraction, rec) for _, rec in stored]
        missing = [b for b, rec in runs if rec is None]
        if missing:
            raise CliError(f"--budgets {' '.join(map(str, missing))}: below every stored budget "
                           f"({', '.join(f'{f:g}' for f in choices.fractions)})")
        searched = stored[0][1].search.get("accuracy_prefetch_window")
        if searched and window is None:
            ev.log(f"note: the search measured its accuracy with the prefetch window {searched}; without "
                   "--prefetch-window every prefetch completes here")
        records, meta = [], {}
        for b, rec in runs:
            got, meta = ev.run_decode([b], window, [_case_of(rec)])
            records += got
    elif args.default_serving:  # one record per budget: what apply runs there with only the budget
        records, meta = [], {}
        for b in budgets:
            got, meta = ev.run_decode([b], window, [default_case(ev, b)])
            records += got
    else:
        records, meta = ev.run_decode(budgets, window, cases)
    print(serving_eval.format_table(records))
    if args.json:
        serving_eval.write_serving_json(args.json, records, {"model": args.model, "crisp": args.crisp,
                                                             "plan_widths_sha256": ev.plan_digest,
                                                             "tail_layout": ev.tail_layout,
                                                             "reference_crisp": args.reference_crisp,
                                                             "data": args.data, **meta})
    return 0 if all(math.isfinite(r["perplexity"]) for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
