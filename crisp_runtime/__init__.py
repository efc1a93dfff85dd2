"""CRISP runtime: plans, the prefix device cache, widest-first loading, and the transformers drop-in.

Importing this package touches no GPU and does not import transformers.
"""

from crisp_runtime.execution.runtime import CrispRuntime, RuntimeConfig, min_budget_bytes
from crisp_runtime.execution.stats import LayerStats, RuntimeStats
from crisp_runtime.hf.dropin import apply, load_model
from crisp_runtime.hf.handle import CrispHandle, parse_budget
from crisp_runtime.hf.moe_layers import UnsupportedModelError
from crisp_runtime.planning.plan import (
    CrispPlan,
    LayerPlan,
    PlanError,
    PolicyKind,
    Tier,
    TierCutoffs,
    TierWidths,
    assign_tiers,
)
from crisp_runtime.planning.serving import SERVING_POLICIES, ServedSlots, ServingPolicy, make_serving, plan_served_step
from crisp_runtime.residency.device_cache import PrefixCache, ResidentExperts
from crisp_runtime.residency.eviction import EvictionPolicy, FrequencyPolicy, LRUPolicy, TierAwarePolicy, make_policy
from crisp_runtime.residency.host_store import HostStore
from crisp_runtime.residency.ledger import CacheBudgetError, Decision, LedgerCounters, ResidencyLedger
from crisp_runtime.scheduling.scheduler import (
    CostModel,
    ExpertTask,
    StepPlan,
    TaskOrder,
    flow_shop_makespan,
    johnson_order,
    plan_step,
)
from crisp_runtime.storage.pack import (
    CrispPack,
    PackMismatchError,
    check_weights_fingerprint,
    load_pack,
    model_info,
    pack_model,
    save_pack,
    verify_pack,
)

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
