"""The CRISP plan: which width each routed expert runs at, per MoE layer.

CRISP (see ``shared/seed/crisp-paper-summary.txt``) sorts routed expert combinations into
Hot / Warm / Cold tiers by frequency and names the dominant expert of each combination:

    Hot   every routed expert full width
    Warm  the dominant expert(s) full width, the others at ``TierWidths.warm`` neurons
    Cold  the dominant expert(s) full width, the others at ``TierWidths.cold`` (0 = skipped)

A CRISP plan may carry a ``width_cap``: no routed slot runs wider (the dominant at the cap, each tier at
``min(tier width, cap)``). Where a uniform width fits the GPU budget, that width as a cap keeps every
expert resident while the tiers still narrow the auxiliaries below it (at 50% of the
4-bit bytes a 2-bit tail pack at 3/4 of its neurons fits the whole cache).

A CRISP plan may also carry ``aux_full_weight``: an auxiliary whose routing weight is at least this runs at the
dominant width whatever its pair's tier (its role stays auxiliary: the serving policy ``resident`` may still serve
it narrower from what is resident, ``resident-narrow-aux`` never does). Why: on the trained tiny Mixtral the
routing weight picked the auxiliaries that matter better than the pair tiers below 1% loss
(skip-auxiliary at weight 0.239 lost 0.74% at 2.43x full-width LRU where CRISP's lowest loss was 0.92% at 2.36x);
with the threshold, the heavy auxiliaries run whole and the light ones keep the tiers' narrow widths instead of
being skipped.

And ``aux_skip_weight``: an auxiliary whose routing weight is below this is skipped (width 0) whatever its pair's
tier, so a plan has three bands by routing weight: light auxiliaries skipped, middle ones at the tiers' widths, heavy
ones whole (``aux_full_weight``; ``aux_skip_weight <= aux_full_weight``). Why: at 10% of the expert bytes skipping
a light auxiliary saved more time per point of loss than narrowing it (skip-auxiliary at
weight 0.3 ran 2.45x full-width LRU at 1.22% where CRISP's fastest at <= 1.23% was 2.37x); with both thresholds
equal the plan is skip-auxiliary at that threshold.

The same machinery expresses the baselines every comparison needs (``PolicyKind``): full
width everywhere, one uniform width, and skipping the auxiliary expert(s) (always, or when the
routing weight is under a threshold).

Routing wider than top-2 (DeepSeek top-6, Qwen top-4/8, OLMoE top-8): the combination key
(``combination_key``, :class:`~crisp_runtime.planning.pairs.CombinationKey`) is the *leading pair*, the two
experts with the highest routing weights of a token, or the *leading expert* alone. Top-2 is the
paper's case, where the pair is the whole combination; for wider routing the full k-sets are
too many to count densely (C(64, 6) = 75M), while pairs stay countable (C(64, 2) = 2,016) and
leading experts are 64. A plan keyed on the leading expert lists one-expert combinations ``(e,)``, stores no
dominant label (the leading expert is the heaviest, rank 0, by definition), and gives every token whose heaviest
expert is ``e`` the tier of ``e``. Ranks within a token: the pair's dominant expert is rank 0, the other pair
member rank 1, the remaining routed experts ranks 2..k-1 by decreasing routing weight. A combination's
dominant expert is either a fixed label (measured offline by masking each member) or, when the
plan stores none for it (``null`` in JSON), the heavier expert of each token by routing weight:
on the trained tiny Mixtral a fixed per-pair label lost to the per-token routing weight at
every setting measured (docs/profile-and-eval.md; ``crisp-profile --dominance`` chooses on
calibration text). Ranks below ``num_dominant`` run full width; the others take the tier's
width. Shared experts (Qwen2-MoE, DeepSeek) are dense MLPs outside this plan: they always run
full width and stay resident.

Planning is plain torch on small CPU tensors: ``token_widths`` looks combinations up in
(E, E) tables built once per layer, so a decode step costs a few tensor ops.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from crisp_kernels.format import rows_for_neurons

from .pairs import CombinationKey, codes_of_sorted, combination_code, combination_of

PLAN_FORMAT = "crisp-plan"
PLAN_VERSION = 1
# Steps with at most this many routed slots (T * k) take the plain-Python lookup.
_SMALL_STEP_SLOTS = 64
# dtypes whose tolist() gives the same Python values as after the lookup's int64 / float32 conversion
_LIST_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
_LIST_WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

Pair = tuple[int, int]
Combination = tuple[int, ...]  # a Pair under the leading-pair key, (e,) under the leading-expert key


class PlanError(ValueError):
    """A plan that is malformed or does not fit the model / pack it is used with."""


class Tier(enum.Enum):
    HOT = "hot"
    WARM = "warm"
    COLD = "cold"


_TIER_CODE = {Tier.HOT: 0, Tier.WARM: 1, Tier.COLD: 2}
_UNSEEN_CODE = -1


class PolicyKind(enum.Enum):
    FULL = "full"  # every routed expert at full width (the 4-bit full-width baseline)
    UNIFORM = "uniform"  # every routed expert at one width
    SKIP_AUX = "skip_aux"  # dominant (by routing weight) full, the others skipped
    CRISP = "crisp"  # tiers over combinations, measured dominance


@dataclass(frozen=True)
class TierWidths:
    """Width (neurons) of the non-dominant experts in each tier; dominant ones run full."""

    hot: int
    warm: int
    cold: int = 0

    def for_tier(self, tier: Tier) -> int:
        return {Tier.HOT: self.hot, Tier.WARM: self.warm, Tier.COLD: self.cold}[tier]


@dataclass(frozen=True)
class TierCutoffs:
    """Tier boundaries by share of token activations, most frequent combinations first.

    Hot: the most frequent combinations that together carry ``hot_mass`` of activations.
    Cold: the least frequent ones that together carry at most ``cold_mass``. Warm: the rest.
    """

    hot_mass: float = 0.5
    cold_mass: float = 0.1

    def __post_init__(self) -> None:
        if not (0.0 <= self.hot_mass <= 1.0 and 0.0 <= self.cold_mass <= 1.0):
            raise PlanError(f"TierCutoffs: masses must lie in [0, 1], got {self.hot_mass}, {self.cold_mass}")
        if self.hot_mass + self.cold_mass > 1.0 + 1e-9:
            raise PlanError(f"TierCutoffs: hot_mass + cold_mass must be <= 1, got {self.hot_mass + self.cold_mass}")


@dataclass(frozen=True)
class LayerPlan:
    """Tier and dominant expert of every combination (a leading pair, or a leading expert ``(e,)``: the plan's
    ``combination_key``) seen in one layer."""

    tiers: Mapping[Combination, Tier]
    dominant: Mapping[Combination, int]  # combinations absent here: the heavier expert of each token is dominant
    # Lookup tables built on first use; not part of equality.
    _tables: dict = field(default_factory=dict, compare=False, repr=False)

    def tables(self, num_experts: int, device: torch.device | None = None,
               key: CombinationKey = CombinationKey.LEADING_PAIR) -> tuple[torch.Tensor, torch.Tensor]:
        """(tier code, dominant expert), each (``key.code_count(E)``,) int64 indexed by the combination's code
        (``crisp_runtime.planning.pairs.codes_of_sorted``); -1 = unseen / no label. On the CPU, or a copy on
        ``device`` made once (the compiled all-resident path reads them on the GPU, no copy)."""
        if device is not None and device.type != "cpu":
            slot = (num_experts, key, device)
            if slot not in self._tables:
                self._tables[slot] = tuple(t.to(device) for t in self.tables(num_experts, key=key))
            return self._tables[slot]
        slot = (num_experts, key)
        if slot not in self._tables:
            tier = torch.full((key.code_count(num_experts),), _UNSEEN_CODE, dtype=torch.int64)
            dom = torch.full((key.code_count(num_experts),), -1, dtype=torch.int64)
            for combination, t in self.tiers.items():
                code = combination_code(key, combination, num_experts)
                tier[code] = _TIER_CODE[t]
                dom[code] = self.dominant.get(combination, -1)
            self._tables[slot] = (tier, dom)
        return self._tables[slot]


_NO_PAIRS = LayerPlan({}, {})  # a CRISP layer without profiled pairs: every pair unseen


def pair_key(a: int, b: int) -> Pair:
    return combination_of(CombinationKey.LEADING_PAIR, a, b)


@dataclass(frozen=True)
class CrispPlan:
    """Widths per routed expert, per layer, under one policy (see the module docstring)."""

    policy: PolicyKind
    num_experts: int
    top_k: int
    intermediate_size: int
    layer_ids: tuple[int, ...]
    tier_widths: TierWidths | None = None  # CRISP
    layers: Mapping[int, LayerPlan] = field(default_factory=dict)  # CRISP
    unseen_tier: Tier = Tier.WARM  # CRISP: what a combination never seen in profiling gets
    num_dominant: int = 1  # experts per token kept at full width (CRISP, SKIP_AUX)
    uniform_width: int | None = None  # UNIFORM
    skip_threshold: float | None = None  # SKIP_AUX: skip only when the routing weight is below this
    width_cap: int | None = None  # CRISP: the widest any routed slot runs (None = the full width)
    aux_full_weight: float | None = None  # CRISP: an auxiliary of routing weight >= this runs at the dominant width
    aux_skip_weight: float | None = None  # CRISP: an auxiliary of routing weight < this is skipped
    description: str = ""
    combination_key: CombinationKey = CombinationKey.LEADING_PAIR  # CRISP: what the tiers are keyed on

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ constructors

    @classmethod
    def full(cls, num_experts: int, top_k: int, intermediate_size: int, layer_ids) -> CrispPlan:
        return cls(PolicyKind.FULL, num_experts, top_k, intermediate_size, tuple(layer_ids))

    @classmethod
    def uniform(cls, num_experts: int, top_k: int, intermediate_size: int, layer_ids, width: int) -> CrispPlan:
        return cls(PolicyKind.UNIFORM, num_experts, top_k, intermediate_size, tuple(layer_ids), uniform_width=width)

    @classmethod
    def skip_aux(
        cls, num_experts: int, top_k: int, intermediate_size: int, layer_ids, *, threshold: float | None = None,
        num_dominant: int = 1,
    ) -> CrispPlan:
        return cls(
            PolicyKind.SKIP_AUX, num_experts, top_k, intermediate_size, tuple(layer_ids),
            skip_threshold=threshold, num_dominant=num_dominant,
        )

    @classmethod
    def crisp(
        cls,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        layers: Mapping[int, LayerPlan],
        tier_widths: TierWidths,
        *,
        unseen_tier: Tier = Tier.WARM,
        num_dominant: int = 1,
        width_cap: int | None = None,
        aux_full_weight: float | None = None,
        aux_skip_weight: float | None = None,
        description: str = "",
        combination_key: CombinationKey = CombinationKey.LEADING_PAIR,
    ) -> CrispPlan:
        return cls(
            PolicyKind.CRISP, num_experts, top_k, intermediate_size, tuple(sorted(layers)), tier_widths=tier_widths,
            layers=dict(layers), unseen_tier=unseen_tier, num_dominant=num_dominant, width_cap=width_cap,
            aux_full_weight=aux_full_weight, aux_skip_weight=aux_skip_weight, description=description,
            combination_key=combination_key,
        )

    def with_tiers(self, tier_widths: TierWidths | None = None, layers: Mapping[int, LayerPlan] | None = None,
                   unseen_tier: Tier | None = None, combination_key: CombinationKey | None = None) -> CrispPlan:
        """A copy of a CRISP plan with other widths, tiers (keyed on ``combination_key``, default the plan's) or
        unseen tier (for searches)."""
        return CrispPlan.crisp(
            self.num_experts, self.top_k, self.intermediate_size, self.layers if layers is None else layers,
            self.tier_widths if tier_widths is None else tier_widths,
            unseen_tier=self.unseen_tier if unseen_tier is None else unseen_tier,
            num_dominant=self.num_dominant, width_cap=self.width_cap, aux_full_weight=self.aux_full_weight,
            aux_skip_weight=self.aux_skip_weight, description=self.description,
            combination_key=self.combination_key if combination_key is None else combination_key,
        )

    def capped(self, width_cap: int | None) -> CrispPlan:
        """A copy of a CRISP plan under ``width_cap`` (neurons; None: uncapped); see the module docstring.
        ``validate`` refuses a cap on another policy or outside [1, I]."""
        return dataclasses.replace(self, width_cap=width_cap)

    def promoted(self, aux_full_weight: float | None) -> CrispPlan:
        """A copy of a CRISP plan whose auxiliaries of routing weight >= ``aux_full_weight`` run at the dominant
        width (None: the tiers only); see the module docstring. ``validate`` refuses it on another policy or
        outside [0, 1]."""
        return dataclasses.replace(self, aux_full_weight=aux_full_weight)

    def skipping(self, aux_skip_weight: float | None) -> CrispPlan:
        """A copy of a CRISP plan whose auxiliaries of routing weight < ``aux_skip_weight`` are skipped (None: none
        by weight); see the module docstring. ``validate`` refuses it on another policy, outside [0, 1] or above
        ``aux_full_weight``."""
        return dataclasses.replace(self, aux_skip_weight=aux_skip_weight)

    @property
    def dominant_width(self) -> int:
        """The width a dominant slot runs at: the full width, or the cap of a capped CRISP plan."""
        return self.intermediate_size if self.width_cap is None else self.width_cap

    def in_storage_rows(self, tail_start: int | None) -> CrispPlan:
        """This plan (widths in neurons) for a pack whose rows from ``tail_start`` hold two 2-bit neurons each
        (``crisp_kernels.format``): every width k becomes the rows holding the first k neurons
        (``rows_for_neurons``: an odd tail width also computes the neuron sharing its row), the full width the
        pack's rows. ``tail_start`` None: the plan itself."""
        if tail_start is None:
            return self
        rows = functools.partial(rows_for_neurons, tail_start=tail_start)
        if not 0 <= tail_start < self.intermediate_size:
            raise PlanError(f"plan: tail_start={tail_start} must lie in [0, {self.intermediate_size})")
        tiers = None if self.tier_widths is None else TierWidths(
            rows(self.tier_widths.hot), rows(self.tier_widths.warm), rows(self.tier_widths.cold))
        return dataclasses.replace(
            self, intermediate_size=rows(self.intermediate_size), tier_widths=tiers,
            uniform_width=None if self.uniform_width is None else rows(self.uniform_width),
            width_cap=None if self.width_cap is None else rows(self.width_cap),
            description=f"{self.description} [storage rows: 2-bit tail from row {tail_start}]".strip())

    # ------------------------------------------------------------------ validation

    def validate(self) -> None:
        self._check_types()
        full = self.intermediate_size
        if self.num_experts < 1 or self.top_k < 1 or self.top_k > self.num_experts:
            raise PlanError(f"plan: need 1 <= top_k <= num_experts, got top_k={self.top_k}, E={self.num_experts}")
        if full < 1:
            raise PlanError(f"plan: intermediate_size must be positive, got {full}")
        if not 1 <= self.num_dominant <= self.top_k:
            raise PlanError(f"plan: num_dominant must lie in [1, top_k={self.top_k}], got {self.num_dominant}")
        if self.policy is PolicyKind.UNIFORM and (self.uniform_width is None or not 0 <= self.uniform_width <= full):
            raise PlanError(f"plan: uniform_width must lie in [0, {full}], got {self.uniform_width}")
        if self.policy is PolicyKind.SKIP_AUX and self.skip_threshold is not None and not (
            0.0 <= self.skip_threshold <= 1.0
        ):
            raise PlanError(f"plan: skip_threshold must lie in [0, 1], got {self.skip_threshold}")
        if self.width_cap is not None:
            if self.policy is not PolicyKind.CRISP:
                raise PlanError(f"plan: width_cap applies to CRISP plans only, not {self.policy.value!r}")
            if not 1 <= self.width_cap <= full:
                raise PlanError(f"plan: width_cap must lie in [1, {full}] (or be None: uncapped), got {self.width_cap}")
        if self.combination_key is not CombinationKey.LEADING_PAIR and self.policy is not PolicyKind.CRISP:
            raise PlanError(f"plan: combination_key applies to CRISP plans only (their tiers), not "
                            f"{self.policy.value!r}")
        for name in ("aux_full_weight", "aux_skip_weight"):  # the CRISP plan's routing-weight bands
            v = getattr(self, name)
            if v is None:
                continue
            if self.policy is not PolicyKind.CRISP:
                raise PlanError(f"plan: {name} applies to CRISP plans only, not {self.policy.value!r}")
            if not 0.0 <= v <= 1.0:
                raise PlanError(f"plan: {name} must lie in [0, 1] (or be None: tiers only), got {v}")
        if None not in (self.aux_skip_weight, self.aux_full_weight) and self.aux_skip_weight > self.aux_full_weight:
            raise PlanError(f"plan: aux_skip_weight {self.aux_skip_weight} must not exceed aux_full_weight "
                            f"{self.aux_full_weight} (a weight cannot be skipped and whole)")
        if self.policy is PolicyKind.CRISP:
            if self.tier_widths is None:
                raise PlanError("plan: a CRISP plan needs tier_widths")
            for name in ("hot", "warm", "cold"):
                w = getattr(self.tier_widths, name)
                if not 0 <= w <= full:
                    raise PlanError(f"plan: width of tier {name!r} must lie in [0, {full}], got {w}")
            unknown = set(self.layers) - set(self.layer_ids)
            if unknown:
                raise PlanError(f"plan: layers {sorted(unknown)} are not among layer_ids {list(self.layer_ids)}")
            key = self.combination_key
            what = "a pair of expert ids" if key is CombinationKey.LEADING_PAIR else "one expert id (e,)"
            for layer_id, lp in self.layers.items():
                if not isinstance(lp, LayerPlan):
                    raise PlanError(f"plan: layer {layer_id} must be a LayerPlan, got {type(lp).__name__}")
                for combo, tier in lp.tiers.items():
                    if not isinstance(combo, tuple) or len(combo) != key.size or not all(_is_integer(e) for e in combo):
                        raise PlanError(f"plan: layer {layer_id} combination {combo!r} is not {what} "
                                        f"(combination_key {key.value!r})")
                    if not all(0 <= e < self.num_experts for e in combo) or list(combo) != sorted(combo):
                        raise PlanError(
                            f"plan: layer {layer_id} combination {combo} is not "
                            f"{'an ordered pair of expert ids' if key.size == 2 else 'an expert id'} "
                            f"in [0, {self.num_experts})"
                        )
                    if not isinstance(tier, Tier):
                        raise PlanError(f"plan: layer {layer_id} combination {combo} has tier {tier!r}")
                    d = lp.dominant.get(combo)
                    if d is not None and key is CombinationKey.LEADING_EXPERT:
                        raise PlanError(f"plan: layer {layer_id} combination {combo}: a leading-expert combination "
                                        f"has no dominant label (its expert is the heaviest), got {d}")
                    if d is not None and d not in combo:
                        raise PlanError(f"plan: layer {layer_id} combination {combo}: dominant {d} is not a or b")

    def _check_types(self) -> None:
        """Integers must be integers: bools, floats and strings are refused (``uniform_width=True`` would
        otherwise be width 1), numpy integers become Python ints (they would not serialize to JSON)."""
        integral = _is_integer
        if not isinstance(self.policy, PolicyKind):
            raise PlanError(f"plan: policy must be a PolicyKind ({', '.join(p.name for p in PolicyKind)}), "
                            f"got {self.policy!r}")
        for name in ("num_experts", "top_k", "intermediate_size", "num_dominant"):
            if not integral(getattr(self, name)):
                raise PlanError(f"plan: {name} must be an integer, got {getattr(self, name)!r}")
            object.__setattr__(self, name, int(getattr(self, name)))
        if not isinstance(self.layer_ids, (list, tuple)) or not all(integral(i) and i >= 0 for i in self.layer_ids):
            raise PlanError(f"plan: layer_ids must be non-negative integers, got {self.layer_ids!r}")
        object.__setattr__(self, "layer_ids", tuple(int(i) for i in self.layer_ids))
        if len(set(self.layer_ids)) != len(self.layer_ids):
            raise PlanError(f"plan: layer_ids repeat a layer: {list(self.layer_ids)}")
        if self.policy is PolicyKind.UNIFORM:
            if not integral(self.uniform_width):
                raise PlanError(f"plan: uniform_width must be an integer, got {self.uniform_width!r}")
            object.__setattr__(self, "uniform_width", int(self.uniform_width))
        if self.policy is PolicyKind.CRISP and self.tier_widths is not None:
            if not isinstance(self.tier_widths, TierWidths):
                raise PlanError(f"plan: tier_widths must be a TierWidths, got {type(self.tier_widths).__name__}")
            for name in ("hot", "warm", "cold"):
                w = getattr(self.tier_widths, name)
                if not integral(w):
                    raise PlanError(f"plan: width of tier {name!r} must be an integer, got {w!r}")
            object.__setattr__(self, "tier_widths", TierWidths(*(int(getattr(self.tier_widths, n))
                                                                 for n in ("hot", "warm", "cold"))))
        if self.width_cap is not None:
            if not integral(self.width_cap):
                raise PlanError(f"plan: width_cap must be an integer or None, got {self.width_cap!r}")
            object.__setattr__(self, "width_cap", int(self.width_cap))
        import math
        import numbers

        # routing-weight thresholds: real numbers, not bools
        for name in ("skip_threshold", "aux_full_weight", "aux_skip_weight"):
            v = getattr(self, name)
            if v is not None:
                if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
                    raise PlanError(f"plan: {name} must be a number in [0, 1] or None, got {v!r}")
                object.__setattr__(self, name, float(v))
        if not isinstance(self.combination_key, CombinationKey):
            raise PlanError(f"plan: combination_key must be a CombinationKey "
                            f"({', '.join(k.name for k in CombinationKey)}), got {self.combination_key!r}")
        if not isinstance(self.unseen_tier, Tier):
            raise PlanError(f"plan: unseen_tier must be a Tier ({', '.join(t.name for t in Tier)}), "
                            f"got {self.unseen_tier!r}")
        if isinstance(self.layers, Mapping) and not _plain_int_layers(self.layers):
            object.__setattr__(self, "layers", _int_layers(self.layers))


    def check_compatible(self, *, num_experts: int, top_k: int, intermediate_size: int, layer_ids) -> None:
        """Raise PlanError unless this plan fits a model/pack with these dimensions."""
        mismatches = []
        if self.num_experts != num_experts:
            mismatches.append(f"num_experts {self.num_experts} != {num_experts}")
        if self.top_k != top_k:
            mismatches.append(f"top_k {self.top_k} != {top_k}")
        if self.intermediate_size != intermediate_size:
            mismatches.append(f"intermediate_size {self.intermediate_size} != {intermediate_size}")
        missing = set(layer_ids) - set(self.layer_ids)
        extra = set(self.layer_ids) - set(layer_ids)
        if missing:
            mismatches.append(f"no entry for layers {sorted(missing)}")
        if extra:
            mismatches.append(f"unknown layers {sorted(extra)}")
        if mismatches:
            raise PlanError("plan does not fit this model/pack: " + "; ".join(mismatches))

    # ------------------------------------------------------------------ the lookup

    def token_widths(self, layer_id: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """Width each token needs from each of its routed experts: (T, k) int64 on the CPU.

        top_k_index (T, k) int, top_k_weights (T, k) float, as a transformers router returns
        them. Index values outside [0, E) (padding sentinels) get width 0.
        """
        return self.token_widths_and_roles(layer_id, top_k_index, top_k_weights, roles=False)[0]

    def _check_step(self, layer_id: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> None:
        """A layer this plan covers and equal (T, k) routing shapes, or a clear error."""
        if layer_id not in self.layer_ids:
            raise PlanError(f"plan has no layer {layer_id}; it covers layers {list(self.layer_ids)}")
        if top_k_index.dim() != 2 or top_k_index.shape != top_k_weights.shape:
            raise ValueError(
                f"top_k_index / top_k_weights: expected equal (T, k) shapes, "
                f"got {tuple(top_k_index.shape)} and {tuple(top_k_weights.shape)}"
            )

    def token_widths_and_roles(self, layer_id: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *,
                               roles: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``token_widths`` and, beside it, each slot's role: (T, k) bool, True = dominant.

        The dominant slots are the ranks below ``num_dominant`` (for every policy, FULL and
        UNIFORM included: the heaviest routed experts), the others auxiliary; invalid slots are
        False. Serving policies (``crisp_runtime.planning.serving``) treat the two roles differently.
        """
        self._check_step(layer_id, top_k_index, top_k_weights)
        if top_k_index.numel() <= _SMALL_STEP_SLOTS:
            _, wanted, dominant = self.widths_and_roles_lists(layer_id, top_k_index, top_k_weights, roles=roles,
                                                              checked=True)
            shape = top_k_index.shape
            return (torch.tensor(wanted, dtype=torch.int64).reshape(shape),
                    None if dominant is None else torch.tensor(dominant, dtype=torch.bool).reshape(shape))
        index = top_k_index.detach().to("cpu", torch.int64)
        weights = top_k_weights.detach().to("cpu", torch.float32)
        return self._token_widths_tensor(layer_id, index, weights, roles)

    def widths_and_roles_lists(self, layer_id: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *,
                               roles: bool = True, checked: bool = False
                               ) -> tuple[list[int], list[int], list[bool] | None]:
        """:meth:`token_widths_and_roles` of a small step as flat Python lists (token-major, like
        ``tensor.reshape(-1).tolist()``): (expert ids, widths, dominant flags or None).

        The routing is read once with ``tolist`` (no tensor op: each costs ~1-6 us on the project's
        2-core VM, a decode step's whole rule set in Python a few us). ``checked``: the caller already
        validated ``layer_id`` and the shapes (``token_widths_and_roles``).
        """
        if not checked:
            self._check_step(layer_id, top_k_index, top_k_weights)
        # Integer ids and float32/16 weights are read as they are (the same Python values as after the
        # int64 / float32 conversion); anything else is converted first, as the tensor path does.
        index = top_k_index if top_k_index.dtype in _LIST_INDEX_DTYPES else top_k_index.to(torch.int64)
        weights = top_k_weights if top_k_weights.dtype in _LIST_WEIGHT_DTYPES else top_k_weights.to(torch.float32)
        index_rows = index.tolist()
        role_flags = [] if roles else None
        widths = self._token_widths_small(layer_id, index_rows, weights.tolist(), role_flags)
        return [e for row in index_rows for e in row], widths, role_flags

    def device_token_widths(self, layer_id: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                            ) -> torch.Tensor:
        """:meth:`token_widths` computed where the routing is: (T, k) int64 on its device.

        The vectorized rules only (no copy to the host, no Python per token, no data-dependent
        control flow), so ``torch.compile(fullgraph=True)`` traces it: the all-resident step of
        ``crisp_runtime.execution.resident_path``. Same values as :meth:`token_widths`.
        """
        if layer_id not in self.layer_ids:
            raise PlanError(f"plan has no layer {layer_id}; it covers layers {list(self.layer_ids)}")
        return self._token_widths_tensor(layer_id, top_k_index.to(torch.int64), top_k_weights.to(torch.float32))[0]

    def _token_widths_small(self, layer_id: int, index: list[list[int]], weights: list[list[float]],
                            roles: list | None = None) -> list[int]:
        """The per-token rules in plain Python, flat (token-major) widths: a decode step is a handful
        of slots, and ~25 small tensor ops would cost ~100 us where this costs a few (measured:
        bench/runtime.py). ``roles``: a list to extend with each slot's dominant flag (None = not wanted)."""
        full = self.intermediate_size
        num_experts = self.num_experts
        num_dominant = self.num_dominant
        policy = self.policy
        out: list[int] = []
        if policy is PolicyKind.FULL or policy is PolicyKind.UNIFORM:
            width = full if policy is PolicyKind.FULL else self.uniform_width
            for experts, w in zip(index, weights, strict=True):
                out += [width if 0 <= e < num_experts else 0 for e in experts]
                if roles is not None:
                    k = len(experts)
                    valid = [pos for pos in range(k) if 0 <= experts[pos] < num_experts]
                    dom = set(sorted(valid, key=lambda pos: -w[pos])[:num_dominant])
                    roles += [pos in dom for pos in range(k)]
            return out
        tier_width = self._tier_width if policy is PolicyKind.CRISP else None
        dominant_width = self.dominant_width
        skip_thr, promote, light = self._weight_thresholds
        for experts, w in zip(index, weights, strict=True):
            k = len(experts)
            valid = [pos for pos in range(k) if 0 <= experts[pos] < num_experts]
            by_weight = sorted(valid, key=lambda pos: -w[pos])  # stable: ties keep router order
            ranks = {pos: r for r, pos in enumerate(by_weight)}
            if policy is PolicyKind.SKIP_AUX:
                aux = [full if skip_thr is not None and w[pos] >= skip_thr else 0 for pos in range(k)]
            else:
                tier, swap = self._combination_tier(layer_id, [experts[pos] for pos in by_weight[:2]])
                if swap:
                    ranks[by_weight[0]], ranks[by_weight[1]] = 1, 0
                aux = [tier_width[tier]] * k
                if promote is not None:
                    aux = [dominant_width if w[pos] >= promote else aux[pos] for pos in range(k)]
                if light is not None:
                    aux = [0 if w[pos] < light else aux[pos] for pos in range(k)]
            row = [0] * k
            for pos in valid:
                row[pos] = dominant_width if ranks[pos] < num_dominant else aux[pos]
            out += row
            if roles is not None:
                roles += [pos in ranks and ranks[pos] < num_dominant for pos in range(k)]
        return out

    @functools.cached_property
    def _weight_thresholds(self) -> tuple[float | None, float | None, float | None]:
        """(skip_threshold, aux_full_weight, aux_skip_weight) rounded to float32: the vectorized rules compare a
        float32 tensor with a Python number in float32 (0.239 becomes 0.23899999...), so the Python rules compare
        with the same value and both paths agree on a weight equal to the rounded threshold."""
        def f32(v):
            return None if v is None else torch.tensor(v, dtype=torch.float32).item()
        return f32(self.skip_threshold), f32(self.aux_full_weight), f32(self.aux_skip_weight)

    @functools.cached_property
    def _tier_width(self) -> dict[Tier, int]:
        """Aux width per tier of a CRISP plan, under its cap (``TierWidths.for_tier`` builds its dict per call)."""
        tw = self.tier_widths
        cap = self.dominant_width
        return {Tier.HOT: min(tw.hot, cap), Tier.WARM: min(tw.warm, cap), Tier.COLD: min(tw.cold, cap)}

    def _combination_tier(self, layer_id: int, pair: list[int]) -> tuple[Tier, bool]:
        """(tier of a token's combination, whether its second-heaviest expert is the dominant one), from its
        leading pair ``[heaviest, second]``."""
        if len(pair) < 2:
            return Tier.HOT, False
        key = combination_of(self.combination_key, pair[0], pair[1])
        lp = self.layers.get(layer_id)
        tier = lp.tiers.get(key) if lp is not None else None
        if tier is None:
            return self.unseen_tier, False
        return tier, lp.dominant.get(key) == pair[1] and pair[0] != pair[1]

    def _token_widths_tensor(self, layer_id: int, index: torch.Tensor, weights: torch.Tensor, roles: bool = False
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The same rules as :meth:`_token_widths_small`, vectorized for prefill-sized steps."""
        num_tokens, k = index.shape
        full = self.intermediate_size
        valid = (index >= 0) & (index < self.num_experts)
        flat = self.policy is PolicyKind.FULL or self.policy is PolicyKind.UNIFORM
        dominant = None
        if flat:
            widths = torch.full_like(index, full if self.policy is PolicyKind.FULL else self.uniform_width)
        if not flat or roles:
            # Sort each token's experts by routing weight; invalid slots sink to the end.
            key = torch.where(valid, weights, torch.full_like(weights, -float("inf")))
            order = key.argsort(dim=1, descending=True, stable=True)  # (T, k)
            sorted_index = index.gather(1, order)
            sorted_weights = weights.gather(1, order)
            rank = torch.arange(k, device=index.device).expand(num_tokens, k).clone()  # rank by routing weight
            if self.policy is PolicyKind.SKIP_AUX:
                aux_width = torch.zeros_like(sorted_index)
                if self.skip_threshold is not None:
                    aux_width = torch.where(sorted_weights >= self._weight_thresholds[0], full, 0)
            elif not flat:
                aux_width, rank = self._crisp_sorted(layer_id, sorted_index, rank)
                if self.aux_full_weight is not None:  # heavy auxiliaries at the dominant width
                    aux_width = torch.where(sorted_weights >= self._weight_thresholds[1], self.dominant_width,
                                            aux_width)
                if self.aux_skip_weight is not None:  # light auxiliaries skipped
                    aux_width = torch.where(sorted_weights < self._weight_thresholds[2], 0, aux_width)
            if not flat:
                sorted_widths = torch.where(rank < self.num_dominant, torch.full_like(aux_width, self.dominant_width),
                                            aux_width)
                widths = torch.empty_like(sorted_widths).scatter_(1, order, sorted_widths)
            if roles:
                dominant = torch.empty_like(valid).scatter_(1, order, rank < self.num_dominant) & valid
        return torch.where(valid, widths, torch.zeros_like(widths)), dominant

    def _crisp_sorted(self, layer_id: int, sorted_index: torch.Tensor, rank: torch.Tensor):
        num_tokens, k = sorted_index.shape
        tw = self._tier_width
        device = sorted_index.device
        tier_width = torch.tensor([tw[Tier.HOT], tw[Tier.WARM], tw[Tier.COLD]], dtype=torch.int64, device=device)
        if k < 2:
            code = torch.full((num_tokens,), _TIER_CODE[Tier.HOT], dtype=torch.int64, device=device)
            return tier_width[code].unsqueeze(1).expand(num_tokens, k), rank
        lp = self.layers.get(layer_id)
        tier_table, dom_table = (_NO_PAIRS if lp is None else lp).tables(self.num_experts, device,
                                                                         self.combination_key)
        a = sorted_index[:, 0].clamp(0, self.num_experts - 1)
        b = sorted_index[:, 1].clamp(0, self.num_experts - 1)
        combination = codes_of_sorted(self.combination_key, a, b, self.num_experts)
        code = tier_table[combination]
        code = torch.where(code == _UNSEEN_CODE, _TIER_CODE[self.unseen_tier], code)
        dom = dom_table[combination]
        # The second-heaviest expert is dominant: swap ranks 0 and 1.
        swap = (dom == sorted_index[:, 1]) & (sorted_index[:, 0] != sorted_index[:, 1])
        # (slice stores, not rank[swap, 0] = 1: a boolean index is data-dependent, a graph break under torch.compile)
        rank[:, 0] = swap.to(rank.dtype)
        rank[:, 1] = 1 - rank[:, 0]
        return tier_width[code].unsqueeze(1).expand(num_tokens, k), rank

    # ------------------------------------------------------------------ JSON

    def to_dict(self) -> dict:
        out = {
            "format": PLAN_FORMAT,
            "version": PLAN_VERSION,
            "policy": self.policy.value,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "intermediate_size": self.intermediate_size,
            "layer_ids": list(self.layer_ids),
            "num_dominant": self.num_dominant,
            "description": self.description,
        }
        if self.policy is PolicyKind.UNIFORM:
            out["uniform_width"] = self.uniform_width
        if self.policy is PolicyKind.SKIP_AUX:
            out["skip_threshold"] = self.skip_threshold
        if self.policy is PolicyKind.CRISP:
            out["combination_key"] = self.combination_key.value
            out["tier_widths"] = {"hot": self.tier_widths.hot, "warm": self.tier_widths.warm,
                                  "cold": self.tier_widths.cold}
            out["unseen_tier"] = self.unseen_tier.value
            if self.width_cap is not None:  # uncapped plans (and their digests) stay as they were
                out["width_cap"] = self.width_cap
            if self.aux_full_weight is not None:  # likewise plans without it
                out["aux_full_weight"] = self.aux_full_weight
            if self.aux_skip_weight is not None:
                out["aux_skip_weight"] = self.aux_skip_weight
            out["layers"] = {
                str(layer_id): [
                    {"experts": list(combo), "tier": tier.value, "dominant": lp.dominant.get(combo)}
                    for combo, tier in sorted(lp.tiers.items())
                ]
                for layer_id, lp in sorted(self.layers.items())
            }
        return out

    def widths_digest(self) -> str:
        """sha256 of everything in the plan that decides a width (its JSON without the description): two
        plans with one digest give every routed slot the same width. Evaluations record it so that an
        accuracy is attached only to the plan it was measured with."""
        data = {k: v for k, v in self.to_dict().items() if k != "description"}
        return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    @classmethod
    def from_dict(cls, data: Mapping) -> CrispPlan:
        """Parse a plan strictly: integers must be JSON integers (not ``true``, ``40.9`` or ``"40"``),
        no unknown fields, no duplicate combination, every CRISP layer present in ``layers``.
        Every defect is a PlanError naming the field."""
        if not isinstance(data, Mapping) or data.get("format") != PLAN_FORMAT:
            got = data.get("format") if isinstance(data, Mapping) else type(data).__name__
            raise PlanError(f"not a CRISP plan: format is {got!r}, expected {PLAN_FORMAT!r}")
        if type(data.get("version")) is not int or data["version"] != PLAN_VERSION:
            raise PlanError(f"plan version {data.get('version')!r} is not supported (this CRISP reads {PLAN_VERSION})")
        policy = _json_enum(data, "policy", PolicyKind)
        allowed = set(_PLAN_FIELDS) | set(_POLICY_FIELDS[policy])
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise PlanError(f"plan is malformed: unknown field(s) {unknown} for policy {policy.value!r} "
                            f"(allowed: {sorted(allowed)})")
        layer_ids = _json_list(data, "layer_ids")
        ids = tuple(_json_int(layer_ids, i, f"layer_ids[{i}]", minimum=0) for i in range(len(layer_ids)))
        if len(set(ids)) != len(ids):
            raise PlanError(f"plan is malformed: field layer_ids: duplicate layer ids in {list(ids)}")
        description = data.get("description", "")
        if not isinstance(description, str):
            raise PlanError(f"plan is malformed: field description: expected a string, "
                            f"got {type(description).__name__}")
        common = dict(
            num_experts=_json_int(data, "num_experts", minimum=1),
            top_k=_json_int(data, "top_k", minimum=1),
            intermediate_size=_json_int(data, "intermediate_size", minimum=1),
            layer_ids=ids,
            num_dominant=_json_int(data, "num_dominant", minimum=1) if "num_dominant" in data else 1,
            description=description,
        )
        if policy is PolicyKind.UNIFORM:
            return cls(policy, uniform_width=_json_int(data, "uniform_width", minimum=0), **common)
        if policy is PolicyKind.SKIP_AUX:
            if "skip_threshold" not in data:
                raise PlanError("plan is malformed: field skip_threshold: missing (null means: always skip)")
            threshold = data["skip_threshold"]
            if threshold is not None and (type(threshold) not in (int, float) or not 0.0 <= threshold <= 1.0):
                raise PlanError(f"plan is malformed: field skip_threshold: expected null or a number in [0, 1], "
                                f"got {threshold!r}")
            return cls(policy, skip_threshold=None if threshold is None else float(threshold), **common)
        if policy is PolicyKind.FULL:
            return cls(policy, **common)
        # a plan written before the key was a choice has no combination_key: it is keyed on the leading pair
        key = (_json_enum(data, "combination_key", CombinationKey) if "combination_key" in data
               else CombinationKey.LEADING_PAIR)
        tw = data.get("tier_widths")
        if not isinstance(tw, Mapping) or set(tw) != {"hot", "warm", "cold"}:
            raise PlanError(f"plan is malformed: field tier_widths: expected {{'hot': int, 'warm': int, "
                            f"'cold': int}}, got {tw!r}")
        tier_widths = TierWidths(*(_json_int(tw, name, f"tier_widths.{name}", minimum=0)
                                   for name in ("hot", "warm", "cold")))
        layers_data = data.get("layers")
        if not isinstance(layers_data, Mapping):
            raise PlanError(f"plan is malformed: field layers: expected an object {{layer id: [combinations]}}, got "
                            f"{type(layers_data).__name__}")
        layers = {}
        for layer_key, entries in layers_data.items():
            if not (isinstance(layer_key, str) and layer_key.isascii() and layer_key.isdigit()
                    and str(int(layer_key)) == layer_key):
                raise PlanError(f"plan is malformed: field layers: key {layer_key!r} is not a layer id "
                                f"(a decimal integer)")
            layers[int(layer_key)] = _json_layer_plan(entries, f"layers.{layer_key}", key)
        missing = sorted(set(ids) - set(layers))
        if missing:
            raise PlanError(f"plan is malformed: field layers: no entry for layers {missing} of layer_ids "
                            f"(a CRISP plan lists "
                            f"every layer, with [] for one whose combinations are all unseen)")
        cap = _json_int(data, "width_cap", minimum=1) if data.get("width_cap") is not None else None
        weights = {}
        for name in ("aux_full_weight", "aux_skip_weight"):
            v = data.get(name)
            if v is not None and (type(v) not in (int, float) or not 0.0 <= v <= 1.0):
                raise PlanError(f"plan is malformed: field {name}: expected null or a number in [0, 1], got {v!r}")
            weights[name] = None if v is None else float(v)
        return cls(policy, tier_widths=tier_widths, layers=layers,
                   unseen_tier=_json_enum(data, "unseen_tier", Tier), width_cap=cap, **weights, **common,
                   combination_key=key)

    def save(self, path: str | os.PathLike) -> None:
        """Write the plan as JSON, atomically."""
        from crisp_kernels.io import atomic_write

        text = json.dumps(self.to_dict(), indent=1)
        atomic_write(path, lambda tmp: Path(tmp).write_text(text))

    @classmethod
    def load(cls, path: str | os.PathLike) -> CrispPlan:
        """Read a plan file (strict, see :meth:`from_dict`). A missing file is FileNotFoundError;
        a folder, a dangling link or unreadable JSON is a PlanError: never silently no plan."""
        path = Path(path)
        if os.path.lexists(path) and not path.is_file():
            what = "a dangling symbolic link" if path.is_symlink() and not path.exists() else "not a regular file"
            raise PlanError(f"{path}: {what}; expected a JSON plan file")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise
        except (OSError, ValueError, RecursionError) as exc:  # ValueError: bad JSON or not UTF-8
            raise PlanError(f"{path}: not a readable JSON plan ({type(exc).__name__}: {exc})") from None
        try:
            return cls.from_dict(data)
        except PlanError as exc:
            raise PlanError(f"{path}: {exc}") from exc


# ---------------------------------------------------------------------- strict JSON fields

_PLAN_FIELDS = ("format", "version", "policy", "num_experts", "top_k", "intermediate_size", "layer_ids",
                "num_dominant", "description")
_POLICY_FIELDS = {
    PolicyKind.FULL: (),
    PolicyKind.UNIFORM: ("uniform_width",),
    PolicyKind.SKIP_AUX: ("skip_threshold",),
    PolicyKind.CRISP: ("combination_key", "tier_widths", "unseen_tier", "layers", "width_cap", "aux_full_weight",
                        "aux_skip_weight"),
}


def _is_integer(value) -> bool:
    """An int or a numpy integer, not a bool (``True`` is an int in Python, never a width here)."""
    import numbers  # here, not at the top: see tests/profile_helpers.py (it profiles this file's first 8000 chars)

    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _plain_int_layers(layers: Mapping) -> bool:
    """Whether every layer id, expert id and dominant expert is a plain int already."""
    for layer_id, lp in layers.items():
        if type(layer_id) is not int or not isinstance(lp, LayerPlan):
            return False
        pairs = list(lp.tiers) + list(lp.dominant) + list(lp.dominant.values())
        if not all(type(e) is int for p in pairs for e in (p if isinstance(p, tuple) else (p,))):
            return False
    return True


def _int_layers(layers: Mapping) -> dict:
    """The same layers with numpy integer ids as ints; anything else is left for validate() to refuse."""
    def as_int(v):
        return int(v) if _is_integer(v) else v

    def as_pair(p):
        return tuple(as_int(e) for e in p) if isinstance(p, tuple) else p

    out = {}
    for layer_id, lp in layers.items():
        if isinstance(lp, LayerPlan):
            lp = LayerPlan({as_pair(p): t for p, t in lp.tiers.items()},
                           {as_pair(p): as_int(d) for p, d in lp.dominant.items()})
        out[as_int(layer_id)] = lp
    return out


def _json_int(data, key, name: str | None = None, *, minimum: int) -> int:
    """``data[key]`` if it is a JSON integer >= minimum (``true`` and ``40.0`` are not)."""
    name = key if name is None else name
    try:
        value = data[key]
    except (KeyError, IndexError):
        raise PlanError(f"plan is malformed: field {name}: missing") from None
    if type(value) is not int:
        raise PlanError(f"plan is malformed: field {name}: expected an integer, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise PlanError(f"plan is malformed: field {name}: expected an integer >= {minimum}, got {value}")
    return value


def _json_list(data: Mapping, key: str) -> list:
    value = data.get(key)
    if not isinstance(value, list):
        raise PlanError(f"plan is malformed: field {key}: expected a list, got {type(value).__name__} {value!r}")
    return value


def _json_enum(data: Mapping, key: str, kind: type[enum.Enum], name: str | None = None):
    value = data.get(key)
    choices = [m.value for m in kind]
    if not isinstance(value, str) or value not in choices:
        raise PlanError(f"plan is malformed: field {key if name is None else name}: {value!r} is not one of {choices}")
    return kind(value)


def _json_layer_plan(entries, where: str, key: CombinationKey) -> LayerPlan:
    if not isinstance(entries, list):
        raise PlanError(f"plan is malformed: field {where}: expected a list of combinations, "
                        f"got {type(entries).__name__}")
    tiers, dominant = {}, {}
    for i, entry in enumerate(entries):
        at = f"{where}[{i}]"
        if not isinstance(entry, Mapping) or set(entry) != {"experts", "tier", "dominant"}:
            raise PlanError(f"plan is malformed: field {at}: expected {{'experts': [a, b], 'tier': ..., "
                            f"'dominant': int or null}}, "
                            f"got {entry!r}"[:300])
        experts = entry["experts"]
        if not isinstance(experts, list) or len(experts) != key.size:
            expected = "a pair [a, b]" if key.size == 2 else "one expert [e]"
            raise PlanError(f"plan is malformed: field {at}.experts: expected {expected} (combination_key "
                            f"{key.value!r}), got {experts!r}")
        pair = tuple(_json_int(experts, j, f"{at}.experts[{j}]", minimum=0) for j in range(key.size))
        if pair in tiers:
            raise PlanError(f"plan is malformed: field {at}.experts: combination {list(pair)} is listed twice")
        tiers[pair] = _json_enum(entry, "tier", Tier, f"{at}.tier")
        if entry["dominant"] is not None:
            dominant[pair] = _json_int(entry, "dominant", f"{at}.dominant", minimum=0)
    return LayerPlan(tiers, dominant)


# ---------------------------------------------------------------------- tiers from statistics


def assign_tiers(counts: Mapping[Combination, int], cutoffs: TierCutoffs) -> dict[Combination, Tier]:
    """Hot / Warm / Cold for each counted combination, by share of activations (see TierCutoffs).

    Ties in count are broken by the combination itself so the result is deterministic.
    """
    total = sum(counts.values())
    if total <= 0:
        return {}
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    tiers: dict[Combination, Tier] = {}
    carried = 0
    for pair, count in ranked:
        # Hot until the mass before this pair reaches hot_mass (so at least one pair is hot when hot_mass > 0).
        tiers[pair] = Tier.HOT if carried < cutoffs.hot_mass * total else Tier.WARM
        carried += count
    tail = 0
    for pair, count in reversed(ranked):
        if tiers[pair] is Tier.HOT or tail + count > cutoffs.cold_mass * total:
            break
        tiers[pair] = Tier.COLD
        tail += count
    return tiers
