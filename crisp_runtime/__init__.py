"""CRISP runtime: plans, the prefix device cache, widest-first loading, and the transformers drop-in.

Importing this package touches no GPU and does not import transformers.
"""

from .plan import CrispPlan, LayerPlan, PlanError, PolicyKind, Tier, TierCutoffs, TierWidths, assign_tiers

__all__ = [
    "CrispPlan",
    "LayerPlan",
    "PlanError",
    "PolicyKind",
    "Tier",
    "TierCutoffs",
    "TierWidths",
    "assign_tiers",
]
