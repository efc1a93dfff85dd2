"""What ``apply`` / ``load_model`` run when the user sets only a GPU budget: one rule, used by the runtime's
entry points (``hf.apply``, ``hf.load_model``, ``blocks.apply_blocks``) and by the simulator's
``crisp-default`` record (``crisp-bench simulate``), so that the benchmark times what the product runs.

The rule (:func:`choose_serving`), for a call with ``serving=None`` and ``config=None``:

1. **A choice stored in the pack for the budget.** ``crisp-profile --gpu-budget`` (and
   ``--plan-for-throughput``) store one serving choice per GPU budget in pack.json
   (``crisp_runtime.storage.serving_record``). A budget ``B`` (a fraction of the pack's expert bytes at full width in
   4-bit rows, ``serving_record.budget_base_bytes``) runs the choice stored for the largest budget ``<= B``: a
   choice made for less memory stays valid with more (its copies fit; the extra memory only raises the hit
   rate), while one made for more memory would plan copies the budget cannot hold. Without a budget (every
   expert resident) a choice stored for 100% applies, if any.
2. **Else the default rule**, from the pack's own statistics (its plan kind and top-k; a 2-bit tail is
   reported, the rule is the same), choosing the family that measured best on the committed packs:

   - the plan gives each token dominant and auxiliary slots (a CRISP plan, top-k >= 2): auxiliaries served from
     what is resident, wider for free and narrower without a copy, dominants whole (``resident``), next-layer
     prefetch at the plan's widths, next-use eviction (the throughput search's choice at 25% on the tiny
     Mixtral's calibration text, 0.86% loss on held-out text);
   - otherwise (full width, one expert per token): every slot at the plan's width (``plan``: nothing narrower to
     serve), next-layer prefetch at the plan's widths, next-use eviction;
   - without a budget: every expert resident, nothing copied: the plan's widths, no prefetch, LRU (unused).

   When the CPU pays (``cpu="auto"`` and the bandwidths say so, :func:`crisp_runtime.cpu.knob.cpu_pays`), the
   hybrid family instead: the neuron split (``hybrid_split``: a missed expert's prefix on the GPU, its other rows
   on the CPU) with a missed dominant at an 87.5% prefix when the plan has dominants, next-layer prefetch at the
   plan's widths, LRU (1.45% loss at 25% on the tiny Mixtral's held-out text, 3.02x GPU-only full-width LRU on
   the rtx4090-pcie4-ddr5 profile). A stored choice whose placement is the GPU's gets the neuron split as its
   hybrid form, its widths kept.
3. **Explicit arguments win.** ``serving=...`` or ``config=...`` run as given, with ``cpu="off"`` unless
   ``cpu`` is given too (the placement the configuration names: every expert knob in ``RuntimeConfig`` /
   ``ServingPolicy``); ``serving="paper"`` is the paper's configuration exactly: the plan's widths, no prefetch,
   LRU eviction, ``cpu="off"`` (the baseline every figure is compared with).

``cpu`` defaults to ``"auto"`` for the default and the stored choices: on a machine without a GPU the experts run
on the CPU already and ``auto`` decides nothing more (``stats()["cpu"]`` says no GPU was found).
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from crisp_runtime.cpu.knob import CpuMode, parse_cpu_mode
from crisp_runtime.execution.runtime import RuntimeConfig
from crisp_runtime.planning.plan import CrispPlan, PolicyKind
from crisp_runtime.planning.serving import SERVING_POLICIES, ServingPolicy, make_serving
from crisp_runtime.scheduling.prefetch import PrefetchPolicy
from crisp_runtime.scheduling.scheduler import Placement
from crisp_runtime.storage.serving_record import ServingRecord, serving_choices

LOG = logging.getLogger("crisp_runtime")

PAPER = "paper"  # serving="paper": the paper's configuration (plan widths, no prefetch, LRU, cpu off)
# The hybrid family's floor: a missed dominant loads its first 7/8 of neurons (the last eighth, the least important
# by the profile's order; docs/hybrid.md: 1.45% loss at 25% against 1.99% at 10%, 93.75% was no faster).
HYBRID_DOMINANT_FLOOR = 0.875
DEFAULT_EVICTION = "next_use"  # the runtime's best online policy on the committed trace (1.73x vs LRU's 1.60x)
HYBRID_EVICTION = "lru"  # what the hybrid family's loss was measured with (next-use: 3.03x at 1.52%, within noise)


class ChoiceSource(enum.Enum):
    """Where the configuration that runs came from."""

    STORED = "stored"  # the pack's stored choice for the budget
    DEFAULT_RULE = "default rule"  # no stored choice for the budget: the rule of this module
    PAPER = "paper"  # serving="paper"
    EXPLICIT = "explicit"  # serving= or config= given


@dataclass(frozen=True)
class PackFacts:
    """What the default rule reads of a pack: its plan kind, top-k, dominants per token and tail."""

    plan_kind: str  # a crisp_runtime.planning.plan.PolicyKind value ("full" without a plan)
    top_k: int
    num_dominant: int
    tail: bool = False  # the pack stores 2-bit tail rows (crisp_tools.tail_pack)

    @property
    def has_roles(self) -> bool:
        """Tokens have dominant and auxiliary slots for a serving policy to tell apart."""
        return self.plan_kind == PolicyKind.CRISP.value and self.top_k > self.num_dominant >= 1


def pack_facts(info: Mapping, plan: CrispPlan | None, top_k: int) -> PackFacts:
    """:class:`PackFacts` of a pack's info and plan (None: full width) for a model routing ``top_k`` experts."""
    if plan is None:
        return PackFacts(PolicyKind.FULL.value, top_k, top_k, info.get("tail_start") is not None)
    return PackFacts(plan.policy.value, top_k, plan.num_dominant, info.get("tail_start") is not None)


@dataclass(frozen=True)
class ServingChoice:
    """The configuration ``apply`` runs and why (:func:`choose_serving`).

    config: what runs when the GPU computes alone; hybrid: what runs when ``cpu`` decides the CPU pays (None: the
    CPU knob's own rule, the configuration's placement made hybrid); cpu: the CPU mode.
    """

    config: RuntimeConfig
    hybrid: RuntimeConfig | None
    cpu: CpuMode
    source: ChoiceSource
    reason: str
    budget_fraction: float | None = None  # of serving_record.budget_base_bytes; None: every expert resident
    stored: ServingRecord | None = None

    def to_dict(self) -> dict:
        cfg = self.config
        out = {"source": self.source.value, "reason": self.reason, "budget_fraction": self.budget_fraction,
               "serving": cfg.serving.name, "prefetch": None if cfg.prefetch is None else cfg.prefetch.to_dict(),
               "eviction": cfg.eviction if isinstance(cfg.eviction, str) else type(cfg.eviction).__name__,
               "cpu": self.cpu.value}
        if self.hybrid is not None:
            out["hybrid"] = {"serving": self.hybrid.serving.name,
                             "prefetch": None if self.hybrid.prefetch is None else self.hybrid.prefetch.to_dict(),
                             "eviction": self.hybrid.eviction if isinstance(self.hybrid.eviction, str)
                             else type(self.hybrid.eviction).__name__}
        if self.stored is not None:
            out["stored_budget_fraction"] = self.stored.gpu_budget_fraction
            loss = self.stored.search.get("accuracy_loss_heldout")
            if loss is not None:
                out["stored_accuracy_loss_heldout"] = loss
        return out

    def log_line(self) -> str:
        where = ("every expert resident" if self.budget_fraction is None
                 else f"gpu_budget {self.budget_fraction:.1%} of the expert bytes")
        pf = "no prefetch" if self.config.prefetch is None else f"{self.config.prefetch.width.value}-width prefetch"
        hybrid = "" if self.hybrid is None else f"; if the CPU pays: {self.hybrid.serving.name}"
        return (f"CRISP serving ({self.source.value}, {where}): {self.config.serving.name}, {pf}, "
                f"{_eviction_name(self.config.eviction)} eviction, cpu={self.cpu.value}{hybrid} - {self.reason}")


def _eviction_name(eviction) -> str:
    return eviction if isinstance(eviction, str) else getattr(eviction, "name", type(eviction).__name__)


def default_family(facts: PackFacts, base: RuntimeConfig | None = None) -> tuple[RuntimeConfig, RuntimeConfig, str]:
    """The default rule's (GPU-only configuration, hybrid configuration, reason) for a pack with an offloaded
    budget (module docstring, rule 2); ``base``: the other fields (default ``RuntimeConfig()``)."""
    base = RuntimeConfig() if base is None else base
    prefetch = PrefetchPolicy()
    tail = ", 2-bit tail" if facts.tail else ""
    if facts.has_roles:
        gpu = replace(base, serving=SERVING_POLICIES["resident"], prefetch=prefetch, eviction=DEFAULT_EVICTION)
        split = ServingPolicy(f"hybrid_split-floor{100 * HYBRID_DOMINANT_FLOOR:g}",
                              dominant_floor=HYBRID_DOMINANT_FLOOR, placement=Placement.SPLIT)
        why = (f"{facts.plan_kind} plan, top-{facts.top_k} with {facts.num_dominant} dominant{tail}: auxiliaries "
               "served from what is resident, dominants whole, next-layer prefetch, next-use eviction")
    else:
        gpu = replace(base, serving=SERVING_POLICIES["plan"], prefetch=prefetch, eviction=DEFAULT_EVICTION)
        split = SERVING_POLICIES["hybrid_split"]
        why = (f"{facts.plan_kind} plan, top-{facts.top_k}{tail}: no auxiliary to serve narrower; the plan's widths, "
               "next-layer prefetch, next-use eviction")
    hybrid = replace(base, serving=split, prefetch=prefetch, eviction=HYBRID_EVICTION)
    floor = f", a missed dominant at {100 * HYBRID_DOMINANT_FLOOR:g}%" if facts.has_roles else ""
    return gpu, hybrid, f"{why}; where the CPU pays: the neuron split{floor}, next-layer prefetch, LRU eviction"


def budget_fraction_of(budget_bytes: int | None, base_bytes: int) -> float | None:
    """A budget in bytes as the fraction of ``base_bytes`` (``serving_record.budget_base_bytes``) stored choices
    are keyed by; None stays None (every expert resident)."""
    if budget_bytes is None:
        return None
    if base_bytes <= 0:
        raise ValueError(f"budget_fraction_of: the expert bytes must be positive, got {base_bytes}")
    return budget_bytes / base_bytes


def check_given(serving, config: RuntimeConfig | None) -> None:
    """Refuse (ValueError) ``serving`` and ``config`` given together where they contradict each other:
    ``serving="paper"`` with a config whose serving policy, prefetch or eviction is not the paper's, or a ``serving``
    policy other than the one ``config.serving`` names (a config's default policy, ``plan``, stands for not
    given)."""
    if serving is None or config is None:
        return
    plan = SERVING_POLICIES["plan"]
    if isinstance(serving, str) and serving == PAPER:
        conflicts = [what for what, differs in (
            (f"serving={config.serving.name!r}", config.serving != plan),
            (f"prefetch={config.prefetch!r}", config.prefetch is not None),
            (f"eviction={_eviction_name(config.eviction)!r}", _eviction_name(config.eviction) != "lru")) if differs]
        if conflicts:
            raise ValueError(f"serving='paper' runs the plan's widths, no prefetch and LRU eviction, but config sets "
                             f"{', '.join(conflicts)}: pass that config without serving='paper' to run it as given, "
                             "or leave those fields at their defaults")
        return
    policy = make_serving(serving)
    if config.serving != plan and config.serving != policy:
        raise ValueError(f"serving={policy.name!r} and config.serving={config.serving.name!r} disagree: give the "
                         "serving policy once (serving= or config's serving field)")


def choose_serving(info: Mapping, facts: PackFacts, budget_fraction: float | None, *, serving=None,
                   config: RuntimeConfig | None = None, cpu=None) -> ServingChoice:
    """What runs for one call (module docstring): pure, deterministic, no measurement.

    info: the pack's pack.json fields (``{}`` for the model's own weights); facts: :func:`pack_facts`;
    budget_fraction: the GPU budget as a fraction of the pack's expert bytes (:func:`budget_fraction_of`), None
    when every expert is resident; serving / config / cpu: the call's arguments (None: not given).
    """
    if config is not None and not isinstance(config, RuntimeConfig):
        raise TypeError(f"config: expected RuntimeConfig, got {type(config).__name__}")
    check_given(serving, config)
    b = budget_fraction
    if b is not None and (isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) or b <= 0):
        raise ValueError(f"budget_fraction: expected a positive fraction or None, got {budget_fraction!r}")
    if isinstance(serving, str) and serving == PAPER:
        mode = CpuMode.OFF if cpu is None else parse_cpu_mode(cpu)
        cfg = RuntimeConfig() if config is None else config
        cfg = replace(cfg, serving=SERVING_POLICIES["plan"])
        return ServingChoice(cfg, None, mode, ChoiceSource.PAPER, "serving='paper': the plan's widths, no prefetch, "
                             "LRU eviction, cpu off unless given (the paper's configuration)", budget_fraction)
    if serving is not None or config is not None:
        mode = CpuMode.OFF if cpu is None else parse_cpu_mode(cpu)  # as given: the placement the config names
        cfg = RuntimeConfig() if config is None else config
        if serving is not None:
            cfg = replace(cfg, serving=make_serving(serving))
        given = " and ".join(n for n, v in (("serving", serving), ("config", config)) if v is not None)
        return ServingChoice(cfg, None, mode, ChoiceSource.EXPLICIT, f"{given} given: run as given", budget_fraction)
    mode = CpuMode.AUTO if cpu is None else parse_cpu_mode(cpu)
    choices = serving_choices(info)
    stored = None
    if choices is not None:
        stored = choices.for_fraction(1.0 if budget_fraction is None else budget_fraction)
        if budget_fraction is None and stored is not None and stored.gpu_budget_fraction < 1.0:
            stored = None  # every expert resident: only a choice made for all of them applies
    if stored is not None:
        cfg = stored.runtime_config()
        hybrid = None
        if cfg.serving.placement is Placement.GPU:
            hybrid = replace(cfg, serving=replace(cfg.serving, name=f"{cfg.serving.name}+hybrid_split",
                                                  placement=Placement.SPLIT))
        at = "every expert resident" if budget_fraction is None else f"{budget_fraction:.1%}"
        how = stored.search.get("profile")
        return ServingChoice(cfg, hybrid, mode, ChoiceSource.STORED,
                             f"the pack's choice stored for {stored.gpu_budget_fraction:.0%} (the largest stored "
                             f"budget <= {at}{'' if how is None else f'; searched on {how}'})", budget_fraction, stored)
    stored_note = "" if choices is None else (
        f" (the pack stores choices for {', '.join(f'{f:.0%}' for f in choices.fractions)}, none at or below this "
        "budget)")
    if budget_fraction is None:
        cfg = RuntimeConfig()
        return ServingChoice(cfg, None, mode, ChoiceSource.DEFAULT_RULE, "no gpu_budget: every expert resident, "
                             f"nothing copied; the plan's widths{stored_note}", None)
    gpu, hybrid, why = default_family(facts)
    return ServingChoice(gpu, hybrid, mode, ChoiceSource.DEFAULT_RULE, why + stored_note, budget_fraction)

