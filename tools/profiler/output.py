"""``crisp-profile``'s output: the pack and its pack.json record (the checks on ``--out``: ``out_folder``).

The experts are packed 4-bit, group-wise, neuron-major and reordered (``crisp_kernels.pack_layer``)
and written with the plan and pack.json by ``crisp_runtime.storage.pack.save_pack`` (a staging folder
beside ``--out``, swapped in). crisp-profile is stricter than ``save_pack`` about ``--out``: it
replaces only an older pack of the same model, and refuses a folder holding anything else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from crisp_runtime.hf.checkpoint import pack_layers as pack_expert_by_expert
from crisp_runtime.planning.pairs import pair_skew
from crisp_runtime.planning.plan import CrispPlan
from crisp_runtime.storage.pack import save_pack

from .out_folder import check_out_dir
from .statistics import PROFILE_VERSION, Stats

if TYPE_CHECKING:
    from .inputs import ProfileInputs

def pack_layers(inputs: ProfileInputs, order: dict[int, torch.Tensor]) -> dict:
    """{layer_id: PackedLayer} of the model's experts, neurons in ``order`` (most important first)."""
    # one expert of full-precision weights at a time (the checkpoint's when the model is not resident)
    return pack_expert_by_expert(inputs.layers, inputs.experts.read, inputs.fmt, neuron_order=order)


def profile_info(inputs: ProfileInputs, stats: Stats, plan_info: dict, search: dict | None,
                 elapsed_s: float) -> dict:
    """What pack.json records about the run: model, calibration, skew, expert use, search, plan choice."""
    cfg = inputs.cfg
    skew = {}
    for i, layer_id in enumerate(inputs.layer_ids):
        s = pair_skew(stats.pair_counts[i], 0.25, 0.29)
        skew[str(layer_id)] = {"top25_share": s.top_share, "bottom29_share": s.bottom_share,
                               "seen_pairs": s.seen, "possible_pairs": s.possible}
    return {
        "tool": "crisp-profile",
        "profile_version": PROFILE_VERSION,
        "model": inputs.fingerprint,
        "model_path": str(cfg.model),
        "model_type": inputs.fingerprint["model_type"],
        "num_hidden_layers": getattr(inputs.model.config.get_text_config(), "num_hidden_layers", None),
        "top_k": inputs.top_k,
        "neuron_bytes": inputs.fmt.neuron_nbytes(inputs.hidden),
        "importance": ("sum over routed tokens of routing_weight * |silu(gate x) * (up x)| * ||down column||"
                       if cfg.importance == "weighted" else
                       "sum over routed tokens of |silu(gate x) * (up x)| * ||down column||"),
        "calibration": {"data": [str(p) for p in cfg.data], "samples": cfg.samples, "seq_len": cfg.seq_len,
                        "seed": cfg.seed, "holdout_fraction": cfg.holdout_fraction,
                        "dominance_samples": cfg.dominance_samples},
        "tier_cutoffs": {"hot_mass": inputs.cutoffs.hot_mass, "cold_mass": inputs.cutoffs.cold_mass},
        "skew": skew,
        "expert_tokens": stats.expert_tokens.tolist(),
        "search": search,
        "elapsed_s": round(elapsed_s, 1),
        **plan_info,
    }


def write_pack(inputs: ProfileInputs, packed, plan: CrispPlan, info: dict) -> None:
    """The pack into --out as one change (see the module docstring)."""
    check_out_dir(inputs.out, inputs.fingerprint)  # again: something may have appeared meanwhile
    save_pack(inputs.out, packed, plan=plan, info=info)
