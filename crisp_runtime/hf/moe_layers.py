"""Finding the MoE experts modules of a transformers (v5) model, and recording their routing.

transformers v5 routes every MoE family decorated with ``@use_experts_implementation``
through one interface: the experts module gets ``(hidden_states (T, H), top_k_index (T, k),
top_k_weights (T, k))`` and holds ``gate_up_proj (E, 2I, H)`` (gate half first) and
``down_proj (E, H, I)``. We support that layout with SiLU gating (:attr:`ExpertsLayout.FUSED`),
and gpt-oss's (:attr:`ExpertsLayout.GPT_OSS`: ``gate_up_proj (E, H, 2I)`` transposed with gate and
up interleaved, ``down_proj (E, I, H)``, biases ``gate_up_proj_bias (E, 2I)`` / ``down_proj_bias
(E, H)``, its clamped SwiGLU with the module's ``alpha`` / ``limit``), recognised by its class's
own ``_apply_gate``. Everything else (other transposed, interleaved or biased layouts, post-expert
norms, other activations) is refused with the reason. Nothing here imports transformers at import
time: we read attributes that the decorator sets on each experts module.
"""

from __future__ import annotations

import contextlib
import enum
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from crisp_kernels import SILU_GLU, Activation, ActivationKind, gpt_oss_to_v5

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


class UnsupportedModelError(ValueError):
    """The model has no MoE layers CRISP can run, or one of them has an unsupported layout."""


class ExpertsLayout(enum.Enum):
    """How an experts module stores its weights (and which activation it applies)."""

    FUSED = "fused"  # gate_up_proj (E, 2I, H) gate half first, down_proj (E, H, I), silu(gate) * up
    GPT_OSS = "gpt-oss"  # transposed, interleaved, biased, clamped SwiGLU (module docstring)


@dataclass(frozen=True)
class ExpertWeights:
    """One layer's expert weights in the v5 layout ``crisp_kernels.pack_layer`` takes (views)."""

    gate_up_proj: torch.Tensor  # (E, 2I, H), gate half first
    down_proj: torch.Tensor  # (E, H, I)
    gate_up_bias: torch.Tensor | None  # (E, 2I), gate half first
    down_bias: torch.Tensor | None  # (E, H)
    activation: Activation


@dataclass(frozen=True)
class MoeLayerRef:
    """One supported experts module of a model."""

    layer_id: int  # index of the decoder layer that holds it (plan and pack keys)
    name: str  # module path, e.g. "model.layers.3.mlp.experts"
    module: nn.Module = field(compare=False, repr=False)
    layout: ExpertsLayout = ExpertsLayout.FUSED

    @property
    def num_experts(self) -> int:
        return self.module.gate_up_proj.shape[0]

    @property
    def intermediate_size(self) -> int:
        down = self.module.down_proj
        return down.shape[1] if self.layout is ExpertsLayout.GPT_OSS else down.shape[-1]

    @property
    def hidden_size(self) -> int:
        down = self.module.down_proj
        return down.shape[2] if self.layout is ExpertsLayout.GPT_OSS else down.shape[1]

    @property
    def activation(self) -> Activation:
        if self.layout is ExpertsLayout.GPT_OSS:
            return Activation(ActivationKind.GPT_OSS_CLAMPED_SWIGLU, float(self.module.alpha), float(self.module.limit))
        return SILU_GLU

    @property
    def has_bias(self) -> bool:
        return self.layout is ExpertsLayout.GPT_OSS

    def weights(self) -> ExpertWeights:
        """The module's expert weights in the v5 layout (views of its parameters, no copy)."""
        m = self.module
        if self.layout is ExpertsLayout.GPT_OSS:
            gate_up, gate_up_bias, down, down_bias = gpt_oss_to_v5(m.gate_up_proj.detach(),
                                                                   m.gate_up_proj_bias.detach(),
                                                                   m.down_proj.detach(), m.down_proj_bias.detach())
            return ExpertWeights(gate_up, down, gate_up_bias, down_bias, self.activation)
        return ExpertWeights(m.gate_up_proj.detach(), m.down_proj.detach(), None, None, SILU_GLU)


def _is_experts_module(module: nn.Module) -> bool:
    # The decorator sets these flags in __init__; a module with 3-D expert weights and them is an experts module.
    return hasattr(module, "is_concatenated") and hasattr(module, "has_gate") and (
        hasattr(module, "gate_up_proj") or hasattr(module, "up_proj")
    )


def experts_layout(module: nn.Module) -> ExpertsLayout | str:
    """The layout of a supported experts module, or why CRISP cannot run it (a str)."""
    if _gpt_oss_apply_gate() is not None and type(module)._apply_gate is _gpt_oss_apply_gate():
        reason = _gpt_oss_reason(module)
        return ExpertsLayout.GPT_OSS if reason is None else f"gpt-oss experts: {reason}"
    reason = unsupported_reason(module)
    return ExpertsLayout.FUSED if reason is None else reason


def _gpt_oss_apply_gate():
    """gpt-oss's clamped SwiGLU as transformers defines it (imported lazily), or None."""
    try:
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    except ImportError:  # pragma: no cover - transformers without gpt-oss
        return None
    return GptOssExperts._apply_gate


def _gpt_oss_reason(module: nn.Module) -> str | None:
    """Why a module with gpt-oss's gate does not have gpt-oss's layout, or None."""
    flags = {name: getattr(module, name, None) for name in ("has_gate", "has_bias", "is_transposed",
                                                           "is_concatenated", "has_post_expert_norm")}
    if flags != {"has_gate": True, "has_bias": True, "is_transposed": True, "is_concatenated": False,
                 "has_post_expert_norm": False}:
        return f"expected transposed, interleaved, biased experts without a post-expert norm, got {flags}"
    tensors = {n: getattr(module, n, None) for n in ("gate_up_proj", "gate_up_proj_bias", "down_proj",
                                                     "down_proj_bias")}
    if not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        return f"it lacks one of {list(tensors)}"
    shapes = {n: tuple(t.shape) for n, t in tensors.items()}
    gate_up = shapes["gate_up_proj"]
    if len(gate_up) != 3 or gate_up[2] % 2:
        return f"expected gate_up_proj (E, H, 2I), got {gate_up}"
    num_experts, hidden, two_inter = gate_up
    want = {"gate_up_proj": gate_up, "gate_up_proj_bias": (num_experts, two_inter),
            "down_proj": (num_experts, two_inter // 2, hidden), "down_proj_bias": (num_experts, hidden)}
    if shapes != want:
        return f"expected shapes {want}, got {shapes}"
    try:
        Activation(ActivationKind.GPT_OSS_CLAMPED_SWIGLU, getattr(module, "alpha", None),
                   getattr(module, "limit", None))
    except ValueError as exc:
        return str(exc)
    return None


def unsupported_reason(module: nn.Module) -> str | None:
    """Why CRISP cannot run this module as a FUSED (v5, SiLU) experts module, or None when it can."""
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
    act = activation_problem(getattr(module, "act_fn", None))
    return None if act is None else f"its activation is {act}"


def activation_problem(act) -> str | None:
    """None where ``act`` (an experts module's ``act_fn``) is SiLU, which CRISP's kernels implement: a SiLU module
    (torch's, or transformers' ``SiLUActivation``) or ``torch.nn.functional.silu`` itself (LFM2-MoE's experts hold
    the function); else what it is instead, for a refusal."""
    if act is F.silu or isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU"):
        return None
    name = "missing" if act is None else getattr(act, "__name__", None) or type(act).__name__
    return f"{name}, CRISP's kernels implement SiLU"


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
        layout = experts_layout(module)
        if isinstance(layout, str):
            raise UnsupportedModelError(
                f"{type(module).__name__} at {name!r} is not supported by CRISP: {layout}"
            )
        match = _LAYER_INDEX.search(name)
        layer_id = int(match.group(1)) if match else len(refs)
        refs.append(MoeLayerRef(layer_id, name, module, layout))
    if not refs:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no MoE experts module using transformers' experts interface "
            "(@use_experts_implementation with gate_up_proj (E, 2I, H) / down_proj (E, H, I), or gpt-oss's experts)"
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
def experts_input_hooks(layers, hook_for) -> Iterator[None]:
    """Forward pre-hooks on every experts module of ``layers`` (``hook_for(layer_id)`` makes each one's
    ``hook(module, args, kwargs)``), removed on exit also after an error. Hooking the experts module's
    inputs works with any experts implementation."""
    handles = [ref.module.register_forward_pre_hook(hook_for(ref.layer_id), with_kwargs=True) for ref in layers]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def record_routing(model: nn.Module, layers: list[MoeLayerRef] | None = None) -> Iterator[RoutingTrace]:
    """Record ``top_k_index`` / ``top_k_weights`` of every experts call (CPU copies).

    Works with any experts implementation, since it hooks the experts module's inputs.
    """
    layers = find_moe_layers(model) if layers is None else layers
    trace = RoutingTrace()

    def make_hook(layer_id):
        def hook(module, args, kwargs):
            index = kwargs.get("top_k_index", args[1] if len(args) > 1 else None)
            weights = kwargs.get("top_k_weights", args[2] if len(args) > 2 else None)
            trace.index.setdefault(layer_id, []).append(index.detach().to("cpu", torch.int64))
            trace.weights.setdefault(layer_id, []).append(weights.detach().to("cpu", torch.float32))

        return hook

    with experts_input_hooks(layers, make_hook):
        yield trace
