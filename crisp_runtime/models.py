"""Finding the MoE experts modules of a transformers (v5) model, and recording their routing.

transformers v5 routes every MoE family decorated with ``@use_experts_implementation``
through one interface: the experts module gets ``(hidden_states (T, H), top_k_index (T, k),
top_k_weights (T, k))`` and holds ``gate_up_proj (E, 2I, H)`` (gate half first) and
``down_proj (E, H, I)``. We support exactly that layout with SiLU gating; everything else
(transposed, interleaved, biased, post-expert norms, other activations: e.g. gpt-oss) is
refused with the reason. Nothing here imports transformers: we only read attributes that
the decorator sets on each experts module.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


class UnsupportedModelError(ValueError):
    """The model has no MoE layers CRISP can run, or one of them has an unsupported layout."""


@dataclass(frozen=True)
class MoeLayerRef:
    """One supported experts module of a model."""

    layer_id: int  # index of the decoder layer that holds it (plan and pack keys)
    name: str  # module path, e.g. "model.layers.3.mlp.experts"
    module: nn.Module = field(compare=False, repr=False)

    @property
    def num_experts(self) -> int:
        return self.module.gate_up_proj.shape[0]

    @property
    def intermediate_size(self) -> int:
        return self.module.down_proj.shape[-1]

    @property
    def hidden_size(self) -> int:
        return self.module.down_proj.shape[1]


def _is_experts_module(module: nn.Module) -> bool:
    # The decorator sets these flags in __init__; a module with 3-D expert weights and them is an experts module.
    return hasattr(module, "is_concatenated") and hasattr(module, "has_gate") and (
        hasattr(module, "gate_up_proj") or hasattr(module, "up_proj")
    )


def unsupported_reason(module: nn.Module) -> str | None:
    """Why CRISP cannot run this experts module, or None when it can."""
    if not getattr(module, "has_gate", False):
        return "its experts have no gate projection (only up_proj)"
    if getattr(module, "has_bias", False):
        return "its expert projections have biases"
    if getattr(module, "is_transposed", False):
        return "its expert weights are stored transposed"
    if not getattr(module, "is_concatenated", True):
        return "its gate and up projections are interleaved, not concatenated"
    if getattr(module, "has_post_expert_norm", False):
        return "it applies a norm after each expert"
    if type(module)._apply_gate is not _default_apply_gate_of(module):
        return "it uses a custom gating function"
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
        return "it has no gate_up_proj / down_proj tensors"
    if gate_up.dim() != 3 or down.dim() != 3:
        return f"expected 3-D expert weights, got gate_up_proj {tuple(gate_up.shape)}, down_proj {tuple(down.shape)}"
    num_experts, two_inter, hidden = gate_up.shape
    if tuple(down.shape) != (num_experts, hidden, two_inter // 2) or two_inter % 2:
        return (
            f"expected gate_up_proj (E, 2I, H) and down_proj (E, H, I), "
            f"got {tuple(gate_up.shape)} and {tuple(down.shape)}"
        )
    act = getattr(module, "act_fn", None)
    if act is None or not isinstance(act, nn.SiLU) and type(act).__name__ not in ("SiLUActivation", "SiLU"):
        return f"its activation is {type(act).__name__}, CRISP's kernels implement SiLU"
    return None


def _default_apply_gate_of(module: nn.Module):
    """transformers' default ``_apply_gate`` (imported lazily; identity check for custom gates)."""
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:  # pragma: no cover - transformers is an optional extra
        return type(module)._apply_gate
    return _default_apply_gate


def find_moe_layers(model: nn.Module) -> list[MoeLayerRef]:
    """All supported experts modules of ``model``, in layer order.

    Raises UnsupportedModelError when there is none, or when an experts module has a
    layout CRISP does not run (naming the module and why).
    """
    refs = []
    for name, module in model.named_modules():
        if not _is_experts_module(module):
            continue
        reason = unsupported_reason(module)
        if reason is not None:
            raise UnsupportedModelError(
                f"{type(module).__name__} at {name!r} is not supported by CRISP: {reason}"
            )
        match = _LAYER_INDEX.search(name)
        layer_id = int(match.group(1)) if match else len(refs)
        refs.append(MoeLayerRef(layer_id, name, module))
    if not refs:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no MoE experts module using transformers' experts interface "
            "(@use_experts_implementation with gate_up_proj (E, 2I, H) / down_proj (E, H, I))"
        )
    ids = [r.layer_id for r in refs]
    if len(set(ids)) != len(ids):
        raise UnsupportedModelError(f"two experts modules share a layer index: {[r.name for r in refs]}")
    return refs


def model_top_k(model: nn.Module) -> int:
    """Routed experts per token, from the model's config."""
    config = getattr(model, "config", None)
    config = getattr(config, "get_text_config", lambda: config)() if config is not None else None
    for attr in ("num_experts_per_tok", "moe_topk", "top_k"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    raise UnsupportedModelError(f"{type(model).__name__}: config has no num_experts_per_tok")


def max_positions(model: nn.Module) -> int | None:
    """The model's ``max_position_embeddings`` (the longest sequence it takes), or None if it has none."""
    config = getattr(model, "config", None)
    config = getattr(config, "get_text_config", lambda: config)() if config is not None else None
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


@dataclass
class RoutingTrace:
    """Routing decisions recorded per MoE layer: lists of (T, k) tensors, one per forward call."""

    index: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # int64
    weights: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # float32

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All recorded tokens of one layer: ((N, k) int64, (N, k) float32)."""
        return torch.cat(self.index[layer_id]), torch.cat(self.weights[layer_id])


@contextlib.contextmanager
def record_routing(model: nn.Module, layers: list[MoeLayerRef] | None = None) -> Iterator[RoutingTrace]:
    """Record ``top_k_index`` / ``top_k_weights`` of every experts call (CPU copies).

    Works with any experts implementation, since it hooks the experts module's inputs.
    """
    layers = find_moe_layers(model) if layers is None else layers
    trace = RoutingTrace()
    handles = []

    def make_hook(layer_id):
        def hook(module, args, kwargs):
            index = kwargs.get("top_k_index", args[1] if len(args) > 1 else None)
            weights = kwargs.get("top_k_weights", args[2] if len(args) > 2 else None)
            trace.index.setdefault(layer_id, []).append(index.detach().to("cpu", torch.int64))
            trace.weights.setdefault(layer_id, []).append(weights.detach().to("cpu", torch.float32))

        return hook

    for ref in layers:
        handles.append(ref.module.register_forward_pre_hook(make_hook(ref.layer_id), with_kwargs=True))
    try:
        yield trace
    finally:
        for h in handles:
            h.remove()
