"""The transformers (v5) drop-in: ``apply(model, ...)`` and ``load_model(checkpoint, pack)``.

transformers routes every MoE family decorated with ``@use_experts_implementation`` through
``ALL_EXPERTS_FUNCTIONS``. We register one function there under the name ``"crisp"`` (the
registration is global, like every entry of that table, but harmless: the function only
dispatches to the state that ``apply`` attached to each experts module *instance*), then call
``model.set_experts_implementation("crisp")``. ``restore()`` sets back exactly what
``model.get_experts_implementation()`` returned before and puts the original expert
parameters back. No class is ever patched.

While applied, the experts modules' ``gate_up_proj`` / ``down_proj`` are placeholders on the
``meta`` device (same shape and dtype, no memory; plain attributes, so ``model.to()`` skips
them); the originals are kept in host memory for ``restore()`` (or dropped with
``RuntimeConfig(keep_original=False)``; ``load_model`` never has them). Shared experts
(Qwen2-MoE, DeepSeek) are ordinary dense MLPs outside the experts module: untouched, resident.

Every check (supported model, pack and plan fit, budget) runs before the model is modified.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import torch

from crisp_kernels import PackedLayer, QuantFormat

from .executor import CrispRuntime, RuntimeConfig, min_budget_bytes
from .models import MoeLayerRef, UnsupportedModelError, find_moe_layers, model_top_k
from .pack import CrispPack, check_layers_fit_model, load_pack, pack_model
from .plan import CrispPlan, PlanError

IMPLEMENTATION_NAME = "crisp"
_STATE_ATTR = "_crisp_state"
_WEIGHT_NAMES = ("gate_up_proj", "down_proj")


class _ExpertsState:
    """What the ``crisp`` experts function needs on one experts module."""

    __slots__ = ("layer_id", "runtime")

    def __init__(self, runtime: CrispRuntime, layer_id: int) -> None:
        self.runtime = runtime
        self.layer_id = layer_id


def crisp_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ``crisp`` entry of ``ALL_EXPERTS_FUNCTIONS``: dispatch on this module's CRISP state."""
    state = self.__dict__.get(_STATE_ATTR)
    if state is None:
        # A module CRISP was not applied to but whose config says "crisp" (e.g. a second model sharing
        # the config object): run transformers' own eager forward, which the decorator wraps.
        eager = getattr(type(self).forward, "__wrapped__", None)
        if eager is None or "gate_up_proj" in self.__dict__:
            raise RuntimeError(f"{type(self).__name__}: experts implementation is 'crisp' but CRISP is not applied "
                               "to this module (call crisp_runtime.apply(model))")
        return eager(self, hidden_states, top_k_index, top_k_weights)
    return state.runtime.forward(state.layer_id, hidden_states, top_k_index, top_k_weights)


def register() -> None:
    """Register the ``crisp`` experts implementation with transformers (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION_NAME, crisp_experts_forward)


# ---------------------------------------------------------------------- budgets

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_budget(budget) -> int | None:
    """Bytes from an int or a string such as ``"2GiB"``, ``"512 MB"``, ``"1.5GB"``; None stays None."""
    if budget is None:
        return None
    if isinstance(budget, bool):
        raise TypeError("gpu_budget: expected bytes (int) or a string like '2GiB', got a bool")
    if isinstance(budget, int):
        value = budget
    elif isinstance(budget, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", budget)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"gpu_budget: cannot read {budget!r}; use bytes or e.g. '2GiB', '512MB'")
        value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    else:
        raise TypeError(f"gpu_budget: expected bytes (int) or a string like '2GiB', got {type(budget).__name__} "
                        f"{budget!r} (fractions of GPU memory are not accepted: say how many bytes)")
    if value <= 0:
        raise ValueError(f"gpu_budget must be positive, got {budget!r}")
    return value


# ---------------------------------------------------------------------- the handle


class CrispHandle:
    """CRISP applied to one model instance; ``restore()`` (or leaving the ``with`` block) undoes it."""

    def __init__(self, model, refs: list[MoeLayerRef], runtime: CrispRuntime, previous_impl,
                 stash: dict) -> None:
        self.model = model
        self.refs = refs
        self.runtime = runtime
        self._previous_impl = previous_impl
        self._stash = stash  # name of module -> [(weight name, "param" | "attr", object, device)]
        self.active = True

    # ---- the public surface
    @property
    def plan(self) -> CrispPlan:
        return self.runtime.plan

    @property
    def layers(self) -> dict[int, PackedLayer]:
        return dict(self.runtime.layers)

    @property
    def gpu_budget(self) -> int | None:
        return getattr(self.runtime.cache, "budget", None)

    def set_plan(self, plan: CrispPlan) -> None:
        """Switch policy (same pack, same cache): for comparing policies on one applied model."""
        if not isinstance(plan, CrispPlan):
            raise TypeError(f"plan: expected CrispPlan, got {type(plan).__name__}")
        self.runtime.set_plan(plan)

    def stats(self) -> dict:
        out = self.runtime.stats.as_dict()
        cache = self.runtime.cache
        out["cache"] = {"budget_bytes": getattr(cache, "budget", None), "used_bytes": cache.used,
                        "peak_bytes": cache.peak, "policy": self.plan.policy.value}
        return out

    def reset_stats(self) -> None:
        self.runtime.stats.reset()

    def restore(self) -> None:
        """Bring back the original expert weights and experts implementation (idempotent)."""
        if not self.active:
            return
        kept = True
        for ref in self.refs:
            module = ref.module
            module.__dict__.pop(_STATE_ATTR, None)
            if ref.name not in self._stash:
                continue
            for name, where, obj, device in self._stash[ref.name]:
                module.__dict__.pop(name, None)
                if where == "param":
                    if obj is None:
                        kept = False
                        continue
                    if device is not None and obj.device != device:
                        obj.data = obj.data.to(device)
                    module._parameters[name] = obj
                else:  # load_model: there never were full-precision experts
                    module.__dict__[name] = obj
                    kept = False
            _reorder_parameters(module, self._stash[ref.name])
        self.model.set_experts_implementation(self._previous_impl)
        self.active = False
        if not kept:
            warnings.warn("CRISP restore: the original expert weights were not kept (keep_original=False or "
                          "load_model); the experts are empty placeholders", stacklevel=2)

    def __enter__(self) -> CrispHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def __repr__(self) -> str:
        return (f"CrispHandle(layers={list(self.runtime.layer_ids)}, policy={self.plan.policy.value}, "
                f"budget={self.gpu_budget}, active={self.active})")


def _reorder_parameters(module, entries) -> None:
    # Keep the original parameter order (state_dict, named_parameters) after putting them back.
    order = getattr(module, "_crisp_param_order", None)
    if order is None:
        return
    params = module._parameters
    items = [(k, params[k]) for k in order if k in params] + [(k, v) for k, v in params.items() if k not in order]
    params.clear()
    params.update(items)
    del module.__dict__["_crisp_param_order"]


# ---------------------------------------------------------------------- apply


def apply(model, source=None, *, plan: CrispPlan | None = None, gpu_budget=None, fmt: QuantFormat | None = None,
          config: RuntimeConfig | None = None) -> CrispHandle:
    """Run ``model``'s MoE experts through CRISP; returns a :class:`CrispHandle`.

    source: None packs the model's current expert weights in their present order (4-bit,
    ``fmt`` or QuantFormat(group 64, asymmetric)); a path loads a pack folder (and its plan.json
    when ``plan`` is None); a CrispPack or ``{layer_id: PackedLayer}`` is used as is.
    plan: None = the pack's plan, else full width everywhere.
    gpu_budget: bytes (int or "2GiB") of the device prefix cache, experts streamed from host
    memory; None = every packed expert resident on the device, no offload.
    """
    config = RuntimeConfig() if config is None else config
    if not isinstance(config, RuntimeConfig):
        raise TypeError(f"config: expected RuntimeConfig, got {type(config).__name__}")
    if not (hasattr(model, "set_experts_implementation") and hasattr(model, "get_experts_implementation")):
        raise UnsupportedModelError(f"{type(model).__name__} is not a transformers v5 PreTrainedModel with "
                                    "set_experts_implementation()")
    refs = find_moe_layers(model)
    for ref in refs:
        if _STATE_ATTR in ref.module.__dict__:
            raise RuntimeError(f"CRISP is already applied to {ref.name}; call handle.restore() first")
    budget = parse_budget(gpu_budget)
    top_k = model_top_k(model)

    # ---- the packed layers
    pack_plan = None
    if source is None:
        if fmt is not None and not isinstance(fmt, QuantFormat):
            raise TypeError(f"fmt: expected QuantFormat, got {type(fmt).__name__}")
        layers = pack_model(model, fmt)
    else:
        if fmt is not None:
            raise ValueError("fmt applies only when apply() packs the model (source=None); a pack has its format")
        if isinstance(source, (str, os.PathLike)):
            source = load_pack(Path(source))
        if isinstance(source, CrispPack):
            source.check_model(model)
            layers, pack_plan = dict(source.layers), source.plan
        elif isinstance(source, Mapping):
            layers = {int(k): v for k, v in source.items()}
            for k, v in layers.items():
                if not isinstance(v, PackedLayer):
                    raise TypeError(f"source[{k}]: expected PackedLayer, got {type(v).__name__}")
            check_layers_fit_model(layers, model)
        else:
            raise TypeError(f"source: expected None, a pack folder, a CrispPack or {{layer_id: PackedLayer}}, got "
                            f"{type(source).__name__}")
    first = layers[refs[0].layer_id]
    layer_ids = sorted(layers)

    # ---- the plan
    if plan is None:
        plan = pack_plan
    if plan is None:
        plan = CrispPlan.full(first.num_experts, top_k, first.intermediate_size, layer_ids)
    if not isinstance(plan, CrispPlan):
        raise TypeError(f"plan: expected CrispPlan, got {type(plan).__name__}")
    try:
        plan.check_compatible(num_experts=first.num_experts, top_k=top_k, intermediate_size=first.intermediate_size,
                              layer_ids=layer_ids)
    except PlanError as exc:
        raise PlanError(f"{exc} (the plan was made for another pack or model)") from exc

    # ---- the device and the budget
    device = torch.device(config.device) if config.device is not None else _model_device(model, refs)
    if budget is not None:
        need = min_budget_bytes(layers, top_k)
        if budget < need:
            raise ValueError(f"gpu_budget of {budget} bytes is too small: one token needs up to {top_k} experts at "
                             f"full width, {need} bytes")
    runtime = CrispRuntime(layers, plan, device=device, gpu_budget=budget, config=config)

    # ---- only now modify the model
    register()
    previous_impl = model.get_experts_implementation()
    stash: dict = {}
    handle = CrispHandle(model, refs, runtime, previous_impl, stash)
    try:
        for ref in refs:
            stash[ref.name] = _detach_weights(ref.module, keep=config.keep_original)
            ref.module.__dict__[_STATE_ATTR] = _ExpertsState(runtime, ref.layer_id)
        model.set_experts_implementation(IMPLEMENTATION_NAME)
    except BaseException:
        handle.restore()
        raise
    return handle


def _model_device(model, refs) -> torch.device:
    expert_params = {id(getattr(r.module, n, None)) for r in refs for n in _WEIGHT_NAMES}
    for p in model.parameters():
        if id(p) not in expert_params and not p.is_meta:
            return p.device
    return torch.device("cpu")


def _detach_weights(module, *, keep: bool) -> list:
    """Replace gate_up_proj / down_proj by meta placeholders; return what restore() puts back."""
    entries = []
    module.__dict__["_crisp_param_order"] = list(module._parameters)
    for name in _WEIGHT_NAMES:
        if name in module._parameters:
            param = module._parameters.pop(name)
            device = param.device
            if keep and device.type != "cpu":
                param.data = param.data.to("cpu")  # frees the device copy; restore() moves it back
            entries.append((name, "param", param if keep else None, device))
            module.__dict__[name] = torch.empty(param.shape, dtype=param.dtype, device="meta")
        else:  # already a placeholder (load_model)
            entries.append((name, "attr", module.__dict__[name], None))
    return entries


def drop_expert_weights(model) -> None:
    """Free the full-precision expert weights of every MoE layer (meta placeholders instead)."""
    for ref in find_moe_layers(model):
        for name in _WEIGHT_NAMES:
            if name in ref.module._parameters:
                param = ref.module._parameters.pop(name)
                ref.module.__dict__[name] = torch.empty(param.shape, dtype=param.dtype, device="meta")


def load_model(checkpoint_dir, pack_dir, *, device="cpu", dtype=None, plan: CrispPlan | None = None,
               gpu_budget=None, config: RuntimeConfig | None = None):
    """Load a causal LM from a local checkpoint plus a CRISP pack: ``(model, handle)``.

    The checkpoint is read on the CPU; its expert weights are dropped there, only then is the
    rest moved to ``device`` and CRISP applied with the pack's experts. Full-precision experts
    never reach the GPU.
    """
    from transformers import AutoModelForCausalLM

    pack = load_pack(pack_dir)  # fail on a bad pack before reading the checkpoint
    budget = parse_budget(gpu_budget)
    kwargs = {"dtype": dtype} if dtype is not None else {}
    model = AutoModelForCausalLM.from_pretrained(checkpoint_dir, **kwargs)  # on the CPU (no device_map)
    pack.check_model(model)
    drop_expert_weights(model)
    model.to(device)
    config = RuntimeConfig() if config is None else config
    handle = apply(model, pack, plan=plan, gpu_budget=budget, config=replace(config, keep_original=False))
    return model, handle
