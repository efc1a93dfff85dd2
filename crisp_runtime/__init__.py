"""CRISP runtime: run a transformers MoE model with its experts in host memory and a GPU byte budget.

The public API (everything a user of the drop-in needs)::

    apply(model, pack, gpu_budget=...)        # patch a loaded model; returns a CrispHandle
    load_model(checkpoint, pack, gpu_budget=...)  # load a checkpoint streamed, experts never in full precision
    RuntimeConfig / ServingPolicy / PrefetchPolicy / eviction policies   # every expert knob, in one place
    CrispPack, load_pack / save_pack / verify_pack / pack_model; CrispPlan and its tiers

The engine's parts live in sub-packages named for the architecture: ``planning`` (the plan, serving policies,
the default serving choice), ``residency`` (budget ledger, eviction, device cache, host store), ``scheduling``
(what to copy, in which order, prefetch), ``execution`` (issuing a layer step, counters), ``cpu`` (the host CPU
as a second executor), ``hf`` (transformers integration), ``storage`` (packs and atomic outputs).

Importing this package touches no GPU and does not import transformers.
"""

from crisp_runtime.execution.runtime import RuntimeConfig
from crisp_runtime.hf.dropin import apply, load_model
from crisp_runtime.hf.handle import CrispHandle, parse_budget
from crisp_runtime.hf.moe_layers import UnsupportedModelError
from crisp_runtime.planning.plan import CrispPlan, PlanError, PolicyKind, Tier, TierCutoffs, TierWidths
from crisp_runtime.planning.serving import SERVING_POLICIES, ServingPolicy, make_serving
from crisp_runtime.residency.eviction import EvictionPolicy, FrequencyPolicy, LRUPolicy, TierAwarePolicy
from crisp_runtime.residency.ledger import CacheBudgetError
from crisp_runtime.scheduling.prefetch import PrefetchPolicy
from crisp_runtime.storage.pack import CrispPack, PackMismatchError, load_pack, pack_model, save_pack, verify_pack

__all__ = [
    "SERVING_POLICIES",
    "CacheBudgetError",
    "CrispHandle",
    "CrispPack",
    "CrispPlan",
    "EvictionPolicy",
    "FrequencyPolicy",
    "LRUPolicy",
    "PackMismatchError",
    "PlanError",
    "PolicyKind",
    "PrefetchPolicy",
    "RuntimeConfig",
    "ServingPolicy",
    "Tier",
    "TierAwarePolicy",
    "TierCutoffs",
    "TierWidths",
    "UnsupportedModelError",
    "apply",
    "load_model",
    "load_pack",
    "make_serving",
    "pack_model",
    "parse_budget",
    "save_pack",
    "verify_pack",
]
