"""``crisp-profile``'s calibration pass (resumable statistics) and the neuron permutation.

One pass over the statistics windows, checkpointed after every batch. For every MoE layer, expert
e and neuron j, with h = silu(gate_j·x) * (up_j·x) the neuron's activation and w the token's
routing weight for e, summed over the tokens routed to e:

    importance[e, j] = sum_t w_t * |h_tj| * ||down[:, j]||

This is the magnitude of neuron j's contribution to the layer output, w_t * h_tj * down[:, j]
(what dropping it removes), so weighting by the routing weight is not a heuristic: a neuron that
only fires for tokens that give the expert a small weight contributes little. (``--importance
mean-abs`` drops the weight, for comparison.) Also counted: the leading pair and the leading expert of
every token (the combination keys, ``crisp_runtime.planning.pairs``) and the routing weight each member gets
within its pair (the dominance proxy). The permutation sorts each expert's neurons by decreasing importance.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from crisp_kernels.io import atomic_write
from crisp_runtime.planning.pairs import CombinationKey, combination_counts, counts_by_combination, leading_pairs

from ..calibration import MaskedExperts

if TYPE_CHECKING:
    from .inputs import ProfileInputs

PROFILE_VERSION = 2  # 2: leading-expert counts beside the leading-pair counts


class ProfileInterrupted(RuntimeError):
    """Raised by the test hook ``interrupt_after`` to simulate a crash after some batches."""


class Stats:
    """Sums accumulated over calibration batches (float64 so that resuming reproduces them exactly)."""

    def __init__(self, num_layers: int, num_experts: int, inter: int):
        self.imp_weighted = torch.zeros(num_layers, num_experts, inter, dtype=torch.float64)
        self.imp_abs = torch.zeros(num_layers, num_experts, inter, dtype=torch.float64)
        self.expert_tokens = torch.zeros(num_layers, num_experts, dtype=torch.int64)
        self.pair_counts = torch.zeros(num_layers, num_experts, num_experts, dtype=torch.int64)  # [a, b], a < b
        self.lead_counts = torch.zeros(num_layers, num_experts, dtype=torch.int64)  # tokens led by each expert
        self.pair_weight = torch.zeros(num_layers, num_experts, num_experts, dtype=torch.float64)  # [m, other]
        self.dominance = torch.full((num_layers, num_experts, num_experts), float("nan"), dtype=torch.float64)
        self.next_batch = 0
        self.dominance_layers_done = 0

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in vars(self).items() if isinstance(v, torch.Tensor)}

    def save(self, path: Path, run_key: str) -> None:
        meta = {"run_key": run_key, "next_batch": str(self.next_batch),
                "dominance_layers_done": str(self.dominance_layers_done), "version": str(PROFILE_VERSION)}
        tensors = {k: v.contiguous() for k, v in self.tensors().items()}
        atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=meta))

    @classmethod
    def load(cls, path: Path, run_key: str, shape) -> Stats | None:
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                if meta.get("run_key") != run_key or meta.get("version") != str(PROFILE_VERSION):
                    return None
                stats = cls(*shape)
                for name in stats.tensors():
                    t = f.get_tensor(name)
                    if t.shape != getattr(stats, name).shape:
                        return None
                    setattr(stats, name, t)
        except Exception:  # a corrupt or foreign checkpoint: start over
            return None
        stats.next_batch = int(meta["next_batch"])
        stats.dominance_layers_done = int(meta["dominance_layers_done"])
        return stats


def resume_or_start(inputs: ProfileInputs, log: Callable[[str], None]) -> Stats:
    """The run's checkpointed statistics, or empty ones (no checkpoint, or one that cannot be read)."""
    ckpt = inputs.work.checkpoint
    shape = (len(inputs.layers), inputs.num_experts, inputs.inter)
    stats = Stats.load(ckpt, inputs.run_key, shape) if ckpt.exists() else None
    if stats is None:
        if ckpt.exists():  # truncated, corrupt or of another version: it is ours (run-keyed folder), redo it
            log(f"the checkpoint {ckpt} is unreadable or of another version; starting over")
        return Stats(*shape)
    log(f"resuming from {ckpt}: batch {stats.next_batch}, dominance layers {stats.dominance_layers_done}")
    return stats


def calibration_pass(inputs: ProfileInputs, stats: Stats, log: Callable[[str], None],
                     interrupt_after: int | None = None) -> None:
    """Accumulate importance and pair statistics over the windows not yet done, saving after every batch."""
    cfg = inputs.cfg
    ckpt = inputs.work.checkpoint
    num_batches = math.ceil(inputs.windows.shape[0] / cfg.batch_size)
    slot = {lid: i for i, lid in enumerate(inputs.layer_ids)}
    E = inputs.num_experts

    def observer(layer_id, expert, h, routing):
        i = slot[layer_id]
        a = h.detach().abs().double()
        stats.imp_weighted[i, expert] += (a * routing.double().unsqueeze(1)).sum(0).cpu()
        stats.imp_abs[i, expert] += a.sum(0).cpu()
        stats.expert_tokens[i, expert] += h.shape[0]

    done_now = 0
    start = time.time()
    with MaskedExperts(inputs.model, inputs.layers, weights=inputs.experts.forward_weights, observer=observer,
                       record=True) as inst:
        for b in range(stats.next_batch, num_batches):
            inst.reset_trace()
            batch = inputs.windows[b * cfg.batch_size : (b + 1) * cfg.batch_size].to(inputs.device)
            with torch.no_grad():
                inputs.model(input_ids=batch, use_cache=False)
            for layer_id in inputs.layer_ids:
                i = slot[layer_id]
                index = torch.cat(inst.trace.index[layer_id]).long()
                weights = torch.cat(inst.trace.weights[layer_id])
                for key, counts in ((CombinationKey.LEADING_PAIR, stats.pair_counts[i]),
                                    (CombinationKey.LEADING_EXPERT, stats.lead_counts[i])):
                    counts.view(-1).add_(combination_counts(key, index, weights, E))
                first, second = leading_pairs(index, weights)
                w_first = (weights * (index == first.unsqueeze(1))).sum(1).double()
                w_second = (weights * (index == second.unsqueeze(1))).sum(1).double()
                stats.pair_weight[i].view(-1).index_add_(0, first * E + second, w_first)
                stats.pair_weight[i].view(-1).index_add_(0, second * E + first, w_second)
            stats.next_batch = b + 1
            stats.save(ckpt, inputs.run_key)
            done_now += 1
            elapsed = time.time() - start
            eta = elapsed / done_now * (num_batches - b - 1)
            log(f"statistics: batch {b + 1}/{num_batches} ({elapsed:.1f} s, ~{eta:.0f} s left)")
            if interrupt_after is not None and done_now >= interrupt_after and b + 1 < num_batches:
                raise ProfileInterrupted(f"interrupted after {done_now} batches (test hook)")


def key_counts(stats: Stats, i: int, key: CombinationKey, num_experts: int) -> dict[tuple[int, ...], int]:
    """{combination: calibration tokens} of layer slot ``i`` under ``key``, those seen at least once."""
    counts = stats.pair_counts[i] if key is CombinationKey.LEADING_PAIR else stats.lead_counts[i]
    return counts_by_combination(key, counts, num_experts)


def importance_scores(inputs: ProfileInputs, stats: Stats) -> torch.Tensor:
    """Importance per (layer slot, expert, neuron), see the module docstring."""
    base = stats.imp_weighted if inputs.cfg.importance == "weighted" else stats.imp_abs
    norms = inputs.experts.down_norms()  # (L, E, I), one expert read at a time
    return base * norms  # (L, E, I) * (L, E, I)


def neuron_order(inputs: ProfileInputs, stats: Stats) -> dict[int, torch.Tensor]:
    """{layer_id: (E, I) permutation}, most important neuron first (``pack_layer``'s neuron_order)."""
    scores = importance_scores(inputs, stats)
    # stable sort: ties (e.g. neurons never activated) keep their original order
    return {layer_id: torch.sort(-scores[i], dim=1, stable=True).indices
            for i, layer_id in enumerate(inputs.layer_ids)}
