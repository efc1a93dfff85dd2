"""Simulating a pack with a tail layout (``crisp_kernels.tail_layout``): rows in 4-bit-neuron byte units.

The simulator, the residency ledger, the scheduler and the copy window count an expert prefix's
bytes as ``width x bytes per neuron``. A tail layout's prefix bytes are piecewise linear in the
width, and monotone, so the simulation is mapped instead of rewritten: every width k (traced
neurons) becomes ``bytes(k) / bytes of one 4-bit target neuron`` rows, rounded up to one target
neuron (1/14,336 of a Mixtral expert), and the target shape's I becomes the full expert's rows in
that unit. For a layout a pack stores (``2gG@F``, G twice the pack's group: ``crisp_tools.tail_pack``)
these are the pack's own storage rows, ``crisp_kernels.format.rows_for_neurons``, exactly (a test
checks). Prefixes stay prefixes (a resident width-k expert serves every k' <= k), so hits, misses,
widenings, evictions, prefetches and bytes are what a runtime counting the layout's bytes would
see, through the runtime's own code. Dominant floors are fractions of the neurons and are mapped
the same way. The budget stays a fraction of the 4-bit model's expert bytes (equal GPU memory).

Not mapped: CPU placements (the CPU kernel reads 4-bit rows only) are refused.
"""

from __future__ import annotations

from dataclasses import replace

from crisp_kernels.tail_layout import TailLayout
from crisp_runtime.planning.plan import CrispPlan, PolicyKind, TierWidths
from crisp_runtime.planning.serving import ServingPolicy, floor_in_rows

from .shapes import ModelShape
from .simulate import SimPolicy, neuron_scale
from .traces import Trace


def mapped_target(layout: TailLayout, shape: ModelShape) -> ModelShape:
    """``shape`` with I replaced by a full expert's rows under ``layout`` (rows of one 4-bit neuron's bytes): the
    target a trace (or a tail pack's storage rows) is mapped onto."""
    nbytes = layout.prefix_nbytes(shape.intermediate_size, shape.intermediate_size, shape.hidden_size,
                                  shape.neuron_nbytes)
    return replace(shape, name=f"{shape.name}+{layout.name}", intermediate_size=-(-nbytes // shape.neuron_nbytes))


class TailMapping:
    """Widths of ``trace`` (traced neurons) in byte rows of ``shape``'s 4-bit neurons under ``layout``."""

    def __init__(self, layout: TailLayout, trace: Trace, shape: ModelShape):
        self.layout, self.trace, self.shape = layout, trace, shape
        self.scale = neuron_scale(trace.intermediate_size, shape)  # target neurons per traced neuron
        self.full = self.rows(trace.intermediate_size)

    def rows(self, width: int) -> int:
        """Byte rows of a width (traced neurons) prefix."""
        shape = self.shape
        nbytes = self.layout.prefix_nbytes(int(width) * self.scale, shape.intermediate_size, shape.hidden_size,
                                           shape.neuron_nbytes)
        return -(-nbytes // shape.neuron_nbytes)  # rounded up: a layout a pack stores holds whole rows

    def mapped_trace(self) -> Trace:
        t = self.trace
        return Trace(t.index, t.weights, list(t.layer_ids), dict(t.meta, intermediate_size=self.full),
                     list(t.seq_starts), t.predicted)

    def mapped_shape(self) -> ModelShape:
        return mapped_target(self.layout, self.shape)

    def mapped_plan(self, plan: CrispPlan) -> CrispPlan:
        if plan.intermediate_size != self.trace.intermediate_size:
            raise ValueError(f"plan of I={plan.intermediate_size}, trace of I={self.trace.intermediate_size}")
        out = replace(plan, intermediate_size=self.full)
        if plan.policy is PolicyKind.CRISP:
            tw = plan.tier_widths
            out = replace(out, tier_widths=TierWidths(self.rows(tw.hot), self.rows(tw.warm), self.rows(tw.cold)),
                          width_cap=None if plan.width_cap is None else self.rows(plan.width_cap))
        elif plan.policy is PolicyKind.UNIFORM:
            out = replace(out, uniform_width=self.rows(plan.uniform_width))
        out.validate()
        return out

    def mapped_serving(self, serving: ServingPolicy) -> ServingPolicy:
        """``serving`` with its dominant floor (a fraction of the neurons) as a fraction of the byte rows: the
        runtime's rule for a tail pack's storage rows (``crisp_runtime.planning.serving.floor_in_rows``)."""
        return floor_in_rows(serving, self.trace.intermediate_size, self.full, self.rows)

    def mapped_policy(self, policy: SimPolicy) -> SimPolicy:
        serving = policy.serving
        if serving.placement.uses_cpu:
            raise ValueError(f"serving {serving.name!r}: CPU placements are not simulated with a tail layout (the CPU "
                             "kernel reads 4-bit rows only)")
        return replace(policy, plan=self.mapped_plan(policy.plan), serving=self.mapped_serving(serving))

    def note(self) -> str:
        shape = self.shape
        frac = self.layout.full_fraction(shape.intermediate_size, shape.hidden_size, shape.neuron_nbytes)
        return (f"tail layout {self.layout.name} ({self.layout.spec()}): a full expert is {frac:.1%} of the 4-bit "
                f"bytes ({self.full:,} 4-bit-neuron rows of {self.shape.neuron_nbytes:,} B); widths mapped to those "
                "rows (exact to one neuron's bytes); the budget is a fraction of the 4-bit expert bytes")
