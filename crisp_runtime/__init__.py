"""CRISP runtime: plans, the prefix device cache, widest-first loading, and the transformers drop-in.

Importing this package touches no GPU and does not import transformers.
"""

from .device_cache import PrefixCache, ResidentExperts
from .eviction import EvictionPolicy, FrequencyPolicy, LRUPolicy, TierAwarePolicy, make_policy
from .hf import CrispHandle, apply, load_model, parse_budget
from .host_store import HostStore
from .moe_layers import UnsupportedModelError
from .pack import (
    CrispPack,
    PackMismatchError,
    check_weights_fingerprint,
    load_pack,
    model_info,
    pack_model,
    save_pack,
    verify_pack,
)
from .plan import CrispPlan, LayerPlan, PlanError, PolicyKind, Tier, TierCutoffs, TierWidths, assign_tiers
from .residency import CacheBudgetError, Decision, LedgerCounters, ResidencyLedger
from .runtime import CrispRuntime, RuntimeConfig, min_budget_bytes
from .scheduler import CostModel, ExpertTask, StepPlan, TaskOrder, flow_shop_makespan, johnson_order, plan_step
from .serving import SERVING_POLICIES, ServedSlots, ServingPolicy, make_serving, plan_served_step
from .stats import LayerStats, RuntimeStats

__all__ = [
    "CacheBudgetError",
    "CostModel",
    "CrispHandle",
    "CrispPack",
    "CrispPlan",
    "CrispRuntime",
    "Decision",
    "EvictionPolicy",
    "ExpertTask",
    "FrequencyPolicy",
    "HostStore",
    "LRUPolicy",
    "LayerPlan",
    "LayerStats",
    "LedgerCounters",
    "PackMismatchError",
    "PlanError",
    "PolicyKind",
    "PrefixCache",
    "ResidencyLedger",
    "ResidentExperts",
    "RuntimeConfig",
    "RuntimeStats",
    "SERVING_POLICIES",
    "ServedSlots",
    "ServingPolicy",
    "StepPlan",
    "TaskOrder",
    "Tier",
    "TierAwarePolicy",
    "TierCutoffs",
    "TierWidths",
    "UnsupportedModelError",
    "apply",
    "assign_tiers",
    "check_weights_fingerprint",
    "flow_shop_makespan",
    "johnson_order",
    "load_model",
    "load_pack",
    "make_policy",
    "make_serving",
    "min_budget_bytes",
    "model_info",
    "pack_model",
    "parse_budget",
    "plan_served_step",
    "plan_step",
    "save_pack",
    "verify_pack",
]
