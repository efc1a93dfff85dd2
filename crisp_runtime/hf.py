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

Every check (supported model, pack, plan and weights fit, budget) runs before the model is modified.

Guards, per experts module, installed by ``apply`` with torch's public hooks (no class is patched):

- a forward pre-hook refuses to run the experts when CRISP is applied but the experts
  implementation was switched away from ``"crisp"`` (``model.set_experts_implementation("eager")``
  would compute with the empty placeholders), or when the expert weights are placeholders that
  ``restore()`` could not bring back (``load_model``, ``keep_original=False``);
- a state-dict post-hook puts the kept originals into ``state_dict()`` (so ``save_pretrained``
  writes a complete checkpoint), and refuses when they were not kept, instead of a checkpoint
  without experts.

``restore()`` removes both when the originals came back; without originals they stay. One hook on
the model itself records the attention mask of each forward call, so that ``stats()["tokens"]``
counts real tokens, not padding. Gradients through CRISP experts are refused at ``backward()``
(the router would get none; the kernels have no backward).
"""

from __future__ import annotations

import functools
import numbers
import os
import re
import warnings
from dataclasses import replace
from decimal import Decimal, InvalidOperation
from pathlib import Path

import torch

from crisp_kernels import PackedLayer, QuantFormat
from crisp_kernels.experts_module import without_backward

from .moe_layers import MoeLayerRef, UnsupportedModelError, find_moe_layers, model_top_k
from .pack import (
    CrispPack,
    FingerprintStatus,
    PackMismatchError,
    check_layers_fit_model,
    check_weights_fingerprint,
    layers_from_source,
    load_pack,
    pack_model,
    recorded_weights_sha256,
)
from .plan import CrispPlan, PlanError
from .prefetch import NextLayerPredictor, Prefetcher
from .resident_path import ResidentStep
from .runtime import CrispRuntime, RuntimeConfig, min_budget_bytes, plan_for_layers
from .serving import make_serving

IMPLEMENTATION_NAME = "crisp"
_STATE_ATTR = "_crisp_state"
_GUARD_ATTR = "_crisp_guard"  # the experts module's hook handles (forward pre-hook, state-dict post-hook)
_WEIGHT_NAMES = ("gate_up_proj", "down_proj")


class _TokenMask:
    """The attention mask of the model's current forward call, to count real tokens (not padding).

    Set by a forward pre-hook on the model, read by the experts of that call: ``mask`` is the
    (batch, positions of this call) part of the attention mask, one entry per row the experts
    see; ``padding`` how many of them are 0, counted once per forward at the first MoE layer
    (where the runtime reads the routing on the host anyway), then reused by the other layers.
    """

    __slots__ = ("mask", "padding")

    def __init__(self) -> None:
        self.mask = None
        self.padding = None

    def set(self, mask) -> None:
        self.mask, self.padding = mask, None

    def padding_of(self, num_rows: int) -> int:
        mask = self.mask
        if mask is None or mask.numel() != num_rows:
            return 0  # no mask, or a call whose rows are not this forward's (e.g. the experts called directly)
        if self.padding is None:
            self.padding = int(num_rows - int(torch.count_nonzero(mask)))
        return self.padding


class _ExpertsState:
    """What the ``crisp`` experts function needs on one experts module."""

    __slots__ = ("layer_id", "name", "prefetcher", "previous_impl", "resident", "runtime", "tokens")

    def __init__(self, runtime: CrispRuntime, layer_id: int, name: str, previous_impl, tokens: _TokenMask,
                 prefetcher: Prefetcher | None = None, resident: ResidentStep | None = None) -> None:
        self.runtime = runtime
        self.resident = resident  # every expert resident: the step torch.compile traces (resident_path)
        self.layer_id = layer_id
        self.name = name
        self.previous_impl = previous_impl
        self.tokens = tokens
        self.prefetcher = prefetcher


_NO_GRAD_HINT = ("Run inference under torch.no_grad() / torch.inference_mode(), or restore() the model "
                 "(handle.restore()) before training it")


@torch.compiler.disable
def _run_experts(state: _ExpertsState, hidden_states, top_k_index, top_k_weights):
    # Disabled for torch.compile: the step reads the routing on the host (widths, copies, order, statistics),
    # so a compiled model breaks its graph here, once per MoE layer, instead of at each of those reads.
    out = state.runtime.forward(state.layer_id, hidden_states, top_k_index, top_k_weights)
    if state.prefetcher is not None:
        # After this layer's copies and kernels are enqueued: the next layer's predicted experts queue behind
        # them on the copy stream (CUDA) and never delay a demanded copy; on the CPU they are copied now.
        state.prefetcher(state.layer_id, hidden_states)
    padding = state.tokens.padding_of(hidden_states.shape[0])
    if padding:
        state.runtime.stats.layers[state.layer_id].padding += padding
    return out


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
    if state.resident is not None and torch.compiler.is_compiling():  # traced whole: no host read, no graph break
        run = functools.partial(state.resident, state.layer_id)
    else:
        run = functools.partial(_run_experts, state)
    return without_backward(f"CRISP experts ({state.name})", run, hidden_states, top_k_index, top_k_weights,
                            hint=_NO_GRAD_HINT)


def register() -> None:
    """Register the ``crisp`` experts implementation with transformers (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION_NAME, crisp_experts_forward)


# ---------------------------------------------------------------------- budgets

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


# Budgets are byte counts compared and summed as Python ints, but torch's allocator and the CUDA
# APIs count in signed 64-bit: a larger number is an overflow (or a typo), not a budget.
MAX_BUDGET_BYTES = 2**63 - 1
_BUDGET_TEXT = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*")
_BUDGET_HINT = "bytes (an int) or a string like '2GiB', '512 MB', '1.5GB'"


def parse_budget(budget) -> int | None:
    """Bytes from an int or a string such as ``"2GiB"``, ``"512 MB"``, ``"1.5GB"``; None stays None.

    Raises TypeError (bool, float, other types) or ValueError (unreadable text, unknown unit,
    not positive, beyond ``MAX_BUDGET_BYTES``), each naming ``gpu_budget``.
    """
    if budget is None:
        return None
    if isinstance(budget, bool):
        raise TypeError(f"gpu_budget: expected {_BUDGET_HINT}, got a bool")
    if isinstance(budget, numbers.Integral):  # int, numpy integers
        value = int(budget)
    elif isinstance(budget, str):
        m = _BUDGET_TEXT.fullmatch(budget)
        if not m:
            raise ValueError(f"gpu_budget: cannot read {budget!r}; expected {_BUDGET_HINT}")
        unit = m.group(2).lower()
        if unit not in _UNITS:
            raise ValueError(f"gpu_budget: unknown unit {m.group(2)!r} in {budget!r}; use one of "
                             "B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)")
        try:  # Decimal: "1.1GB" is exactly 1_100_000_000 bytes (a float gives 1_100_000_000.0000002)
            value = int(Decimal(m.group(1)) * _UNITS[unit])
        except InvalidOperation as exc:  # pragma: no cover - the pattern admits only plain decimals
            raise ValueError(f"gpu_budget: cannot read {budget!r}; expected {_BUDGET_HINT}") from exc
    elif isinstance(budget, numbers.Real):
        hint = " (fractions of GPU memory are not accepted: say how many bytes)" if 0 < budget < 1 else ""
        raise TypeError(f"gpu_budget: expected {_BUDGET_HINT}, got {type(budget).__name__} {budget!r}{hint}")
    else:
        raise TypeError(f"gpu_budget: expected {_BUDGET_HINT}, got {type(budget).__name__} {budget!r}")
    if value <= 0:
        raise ValueError(f"gpu_budget must be positive, got {budget!r}")
    if value > MAX_BUDGET_BYTES:
        raise ValueError(f"gpu_budget {budget!r} is {value} bytes, beyond any device (at most {MAX_BUDGET_BYTES})")
    return value


def check_serving_arguments(config, serving, cpu) -> None:
    """apply's ``config`` / ``serving`` / ``cpu`` checked before any work (their errors name them)."""
    from .cpu_knob import parse_cpu_mode
    from .defaults import PAPER

    if config is not None and not isinstance(config, RuntimeConfig):
        raise TypeError(f"config: expected RuntimeConfig, got {type(config).__name__}")
    if serving is not None and not (isinstance(serving, str) and serving == PAPER):
        make_serving(serving)
    if cpu is not None:
        parse_cpu_mode(cpu)


def loaded_source(source):
    """``apply``'s ``source`` with a pack folder loaded (a CrispPack: its pack.json is read once, for the layers
    and for the serving choice it stores)."""
    if isinstance(source, (str, os.PathLike)):
        return load_pack(Path(source))
    return source


def serving_choice_for(source, plan: CrispPlan, layers, top_k: int, budget: int | None, *, serving, config, cpu):
    """What runs (``crisp_runtime.defaults.choose_serving``) for this source, plan, budget and the call's
    arguments: one rule for the v5 drop-in and the per-expert blocks."""
    from .defaults import budget_fraction_of, choose_serving, pack_facts
    from .serving_record import budget_base_bytes

    info = source.info if isinstance(source, CrispPack) else {}
    facts = pack_facts(info, plan, top_k)
    fraction = budget_fraction_of(budget, budget_base_bytes(layers))
    return choose_serving(info, facts, fraction, serving=serving, config=config, cpu=cpu)


def log_choice(choice, cpu_decision) -> None:
    """The one log line of what runs and why (logger ``crisp_runtime``, INFO): the serving choice and the CPU
    decision with the bandwidths it used."""
    from .defaults import LOG

    bw = "" if cpu_decision.cpu_bytes_per_s is None else f", CPU {cpu_decision.cpu_bytes_per_s / 1e9:.2f} GB/s"
    if cpu_decision.h2d_bytes_per_s is not None:
        bw += f", H2D {cpu_decision.h2d_bytes_per_s / 1e9:.2f} GB/s"
    LOG.info("%s; cpu decision: %s (%s%s)", choice.log_line(), cpu_decision.placement.value, cpu_decision.reason, bw)


def plan_and_budget_checked(plan: CrispPlan | None, layers, first: PackedLayer, top_k: int, budget: int | None,
                            device) -> CrispPlan:
    """The plan to run (the one given, else full width) checked against the packed layers, and the budget
    against the layers and the device: one rule for the v5 drop-in (:func:`apply`) and the per-expert
    blocks (:func:`crisp_runtime.blocks.apply_blocks`)."""
    layer_ids = sorted(layers)
    if plan is None:
        plan = CrispPlan.full(first.num_experts, top_k, first.intermediate_size, layer_ids)
    plan = plan_for_layers(plan, layers)  # a 2-bit tail pack's plan in neurons -> its storage rows
    try:
        plan.check_compatible(num_experts=first.num_experts, top_k=top_k, intermediate_size=first.intermediate_size,
                              layer_ids=layer_ids)
    except PlanError as exc:
        raise PlanError(f"{exc} (the plan was made for another pack or model)") from exc
    if budget is not None:
        _check_budget_fits_layers(budget, layers, top_k)
        _check_budget_fits_device(budget, device)
    return plan


def _check_budget_fits_layers(budget: int, layers, top_k: int) -> None:
    need = min_budget_bytes(layers, top_k)
    if budget < need:
        raise ValueError(f"gpu_budget of {budget} bytes is too small: one token needs up to {top_k} experts at "
                         f"full width, {need} bytes")


def _check_budget_fits_device(budget: int, device: torch.device) -> None:
    """A budget larger than the device is a typo that would end in an out-of-memory error mid-run."""
    if device.type != "cuda":  # host memory for cpu; nothing to compare against
        return
    total = torch.cuda.get_device_properties(device).total_memory  # GPU-only
    if budget > total:
        raise ValueError(f"gpu_budget of {budget} bytes is more than {device} has ({total} bytes)")


def _check_device(value, what: str) -> torch.device:
    """A torch.device from ``value`` (str or torch.device), with an error naming ``what``."""
    if not isinstance(value, (str, torch.device)):
        raise TypeError(f"{what}: expected a device name such as 'cpu' or 'cuda:0', got {type(value).__name__}")
    try:
        device = torch.device(value)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"{what}: {value!r} is not a device (expected e.g. 'cpu', 'cuda', 'cuda:0')") from exc
    if device.type == "meta":
        raise ValueError(f"{what}: 'meta' holds no data; expected e.g. 'cpu' or 'cuda:0'")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{what}: {value!r} but no CUDA device is available here")
        if device.index is not None and device.index >= torch.cuda.device_count():  # GPU-only
            raise ValueError(f"{what}: {value!r} but only {torch.cuda.device_count()} CUDA device(s) exist")
    elif device.type != "cpu":
        raise ValueError(f"{what}: {value!r}; CRISP runs on 'cpu' or 'cuda' devices")
    return device


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
        self._model_hooks: list = []  # the attention-mask hooks on the model (removed by restore)
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
        out["cpu"] = self.runtime.cpu_stats()  # apply(cpu=...)'s decision, and how the CPU's experts run
        out["serving"] = serving_stats(self.runtime)
        return out

    def reset_stats(self) -> None:
        self.runtime.stats.reset()

    def restore(self) -> None:
        """Bring back the original expert weights and experts implementation (idempotent)."""
        if not self.active:
            return
        self.runtime.close()  # the CPU worker thread of hybrid execution, if one was started
        kept = True
        for ref in self.refs:
            module = ref.module
            module.__dict__.pop(_STATE_ATTR, None)
            if ref.name not in self._stash:
                continue
            module_kept = True
            for name, where, obj, device in self._stash[ref.name]:
                if where == "param" and obj is not None:
                    module.__dict__.pop(name, None)
                    if device is not None and obj.device != device:
                        obj.data = obj.data.to(device)
                    module._parameters[name] = obj
                else:  # not kept, or load_model (there never were full-precision experts): the placeholder stays
                    module_kept = False
            _reorder_parameters(module, self._stash[ref.name])
            if module_kept:
                _remove_guard(module)
            kept &= module_kept
        for hook in self._model_hooks:
            hook.remove()
        self._model_hooks.clear()
        self.model.set_experts_implementation(self._previous_impl)
        self.active = False
        if not kept:
            warnings.warn("CRISP restore: the original expert weights were not kept (keep_original=False or "
                          "load_model); the experts stay empty placeholders and running or saving the model "
                          "raises an error: reload the checkpoint, or apply a CRISP pack again", stacklevel=2)

    def __enter__(self) -> CrispHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def __repr__(self) -> str:
        return (f"CrispHandle(layers={list(self.runtime.layer_ids)}, policy={self.plan.policy.value}, "
                f"budget={self.gpu_budget}, active={self.active})")


def serving_stats(runtime: CrispRuntime) -> dict:
    """``stats()["serving"]``: the configuration that runs, where it came from and why
    (``crisp_runtime.defaults.ServingChoice``), with the serving policy, prefetch and eviction after the CPU
    decision."""
    choice = runtime.serving_choice
    out = {} if choice is None else choice.to_dict()
    cfg = runtime.config
    out["running"] = {"serving": cfg.serving.name, "placement": cfg.serving.placement.value,
                      "prefetch": None if cfg.prefetch is None else cfg.prefetch.to_dict(),
                      "eviction": cfg.eviction if isinstance(cfg.eviction, str) else
                      getattr(cfg.eviction, "name", type(cfg.eviction).__name__)}
    return out


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


# ---------------------------------------------------------------------- guards (per module, torch's public hooks)


def _placeholders(module) -> list[str]:
    """Names of the expert weights that are meta placeholders (CRISP applied, or dropped)."""
    return [n for n in _WEIGHT_NAMES
            if isinstance(module.__dict__.get(n), torch.Tensor) and module.__dict__[n].is_meta]


def _guard_forward(name: str, module, args) -> None:
    """Forward pre-hook of the experts module at ``name``: refuse to compute with placeholder weights."""
    state = module.__dict__.get(_STATE_ATTR)
    if state is not None:
        impl = getattr(getattr(module, "config", None), "_experts_implementation", None)
        if impl != IMPLEMENTATION_NAME:
            previous = state.previous_impl.get("") if isinstance(state.previous_impl, dict) else state.previous_impl
            raise RuntimeError(
                f"{name}: CRISP is applied to this model but its experts implementation is now {impl!r} "
                f"(model.set_experts_implementation?): the experts' weights are empty placeholders while CRISP holds "
                f"them, so {impl!r} would compute garbage. Call handle.restore() first (it brings the weights and "
                f"the implementation {previous!r} back), or set_experts_implementation('crisp') again")
        return
    if _placeholders(module):
        raise RuntimeError(
            f"{name}: the expert weights of this model are not loaded: CRISP's load_model (or "
            "apply with RuntimeConfig(keep_original=False)) dropped them and restore() cannot bring them back. "
            "Reload the checkpoint with from_pretrained, or apply a CRISP pack to the model again")


def _guard_state_dict(originals, module, state_dict, prefix, local_metadata) -> None:
    """State-dict post-hook of an experts module: the kept originals in place of the placeholders.

    ``originals``: ``((weight name, tensor or None), ...)``; None = not kept, so refuse rather than
    let ``save_pretrained`` write a checkpoint without experts.
    """
    missing = _placeholders(module)
    if not missing:
        return  # real parameters again (restored): they are in state_dict already
    for name, original in originals:
        if name not in missing:
            continue
        if original is None:
            raise RuntimeError(
                f"state_dict() / save_pretrained(): the expert weights at {prefix + name!r} were not kept (CRISP's "
                "load_model, or apply with RuntimeConfig(keep_original=False)), so the checkpoint would have no "
                "experts. Save from a model loaded with from_pretrained (apply keeps the originals by default)")
        state_dict[prefix + name] = original.detach()


def _install_guard(module, name: str, originals) -> None:
    _remove_guard(module)  # a second apply after a restore without originals: replace, don't stack
    module.__dict__[_GUARD_ATTR] = (
        module.register_forward_pre_hook(functools.partial(_guard_forward, name)),
        module.register_state_dict_post_hook(functools.partial(_guard_state_dict, tuple(originals))),
    )


def _remove_guard(module) -> None:
    for hook in module.__dict__.pop(_GUARD_ATTR, ()):
        hook.remove()


def _record_attention_mask(tokens: _TokenMask, module, args, kwargs) -> None:
    """Forward pre-hook of the model: the mask rows of this call's positions (None: count every position)."""
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    inputs = kwargs.get("input_ids", args[0] if args else None)
    if inputs is None:
        inputs = kwargs.get("inputs_embeds")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or not isinstance(inputs, torch.Tensor) or (
            inputs.dim() < 2 or mask.shape[0] != inputs.shape[0] or mask.shape[1] < inputs.shape[1]):
        tokens.set(None)  # no mask, or a 4-D / custom one: every position counts
        return
    tokens.set(mask[:, mask.shape[1] - inputs.shape[1]:])  # with a KV cache the mask covers past positions too


def _clear_attention_mask(tokens: _TokenMask, module, args, kwargs, output=None) -> None:
    tokens.set(None)


# ---------------------------------------------------------------------- apply


def apply(model, source=None, *, plan: CrispPlan | None = None, gpu_budget=None, fmt: QuantFormat | None = None,
          config: RuntimeConfig | None = None, allow_weights_mismatch: bool = False, serving=None,
          shapes=None, cpu=None) -> CrispHandle:
    """Run ``model``'s MoE experts through CRISP; returns a :class:`CrispHandle`.

    A model without v5 experts modules but with per-expert MoE blocks (DeepSeek-MoE remote code,
    v4-style Mixtral / Qwen2-MoE: ``crisp_runtime.blocks``) goes to ``blocks.apply_blocks``;
    shapes: the block shapes to recognise (None: ``blocks.BLOCK_SHAPES``).

    source: None packs the model's current expert weights in their present order (4-bit,
    ``fmt`` or QuantFormat(group 64, asymmetric)); a path loads a pack folder (and its plan.json
    when ``plan`` is None); a CrispPack or ``{layer_id: PackedLayer}`` is used as is.
    plan: None = the pack's plan, else full width everywhere.
    gpu_budget: bytes (int or "2GiB") of the device prefix cache, experts streamed from host
    memory; None = every packed expert resident on the device, no offload.
    allow_weights_mismatch: use a pack whose recorded weights fingerprint differs from the
    model's expert weights (or cannot be checked because they are not loaded). By default that
    is refused: the same architecture with other weights would run without a word, wrongly.
    serving / config: None for both (the default) = what the pack stores for this budget, else the default
    rule from the pack's statistics (``crisp_runtime.defaults``: residency-aware serving, next-layer prefetch,
    next-use eviction; the neuron split when the CPU pays); ``serving="paper"`` = the paper's configuration
    (the plan's widths, no prefetch, LRU, cpu off); otherwise a ServingPolicy, a name ("plan", "resident",
    "resident-floor75", ...) or its dict, and/or a RuntimeConfig (every expert knob), run as given.
    ``stats()["serving"]`` says what ran and why (also logged once, logger ``crisp_runtime``).
    cpu: None (default) = "auto" for the default and stored choices ("off" when serving or config is given):
    offloaded experts computed on the host CPU when the measured bandwidths say it pays (on a CPU-only machine:
    nothing to split, reported); "on" (whenever the per-step split says it is faster than copying them) or "off"
    (as configured); ``stats()["cpu"]`` says what was decided (``crisp_runtime.cpu_knob``).
    """
    from .cpu_knob import decide_cpu

    check_serving_arguments(config, serving, cpu)
    if fmt is not None and not isinstance(fmt, QuantFormat):
        raise TypeError(f"fmt: expected a QuantFormat (e.g. QuantFormat(group_size=64, symmetric=False)), got "
                        f"{type(fmt).__name__} {fmt!r}")
    if plan is not None and not isinstance(plan, CrispPlan):
        raise TypeError(f"plan: expected CrispPlan (e.g. CrispPlan.load(path)), got {type(plan).__name__}")
    if not isinstance(allow_weights_mismatch, bool):
        raise TypeError(f"allow_weights_mismatch: expected True or False, got {type(allow_weights_mismatch).__name__}")
    from . import blocks  # lazily: blocks imports this module

    shapes = blocks.BLOCK_SHAPES if shapes is None else tuple(shapes)
    if isinstance(model, torch.nn.Module) and blocks.uses_per_expert_blocks(model, shapes):
        return blocks.apply_blocks(model, source, plan=plan, gpu_budget=gpu_budget, fmt=fmt, config=config,
                                   allow_weights_mismatch=allow_weights_mismatch, serving=serving, shapes=shapes,
                                   cpu=cpu)
    if not (hasattr(model, "set_experts_implementation") and hasattr(model, "get_experts_implementation")):
        raise UnsupportedModelError(f"{type(model).__name__} is not a transformers v5 PreTrainedModel with "
                                    "set_experts_implementation(), and has no per-expert MoE block of a registered "
                                    f"shape ({', '.join(s.name for s in shapes)}; crisp_runtime.blocks)")
    refs = find_moe_layers(model)
    for ref in refs:
        if _STATE_ATTR in ref.module.__dict__:
            raise RuntimeError(f"CRISP is already applied to {ref.name}; call handle.restore() first")
    budget = parse_budget(gpu_budget)
    device = (_check_device(config.device, "config.device") if config is not None and config.device is not None
              else _model_device(model, refs))
    top_k = model_top_k(model)
    source = loaded_source(source)

    # ---- the packed layers
    def check_pack(pack: CrispPack) -> None:
        pack.check_model(model)
        if not allow_weights_mismatch:
            check_pack_weights(pack, model)

    layers, pack_plan = layers_from_source(source, fmt, pack=lambda f: pack_model(model, f), check_pack=check_pack,
                                           check_layers=lambda ls: check_layers_fit_model(ls, model))
    first = layers[refs[0].layer_id]
    plan = plan_and_budget_checked(pack_plan if plan is None else plan, layers, first, top_k, budget, device)
    choice = serving_choice_for(source, plan, layers, top_k, budget, serving=serving, config=config, cpu=cpu)
    config, cpu_decision = decide_cpu(choice.cpu, config=choice.config, budget=budget, device=torch.device(device),
                                      layers=layers, hybrid_config=choice.hybrid)
    runtime = CrispRuntime(layers, plan, device=device, gpu_budget=budget, config=config)
    runtime.cpu_decision = cpu_decision
    runtime.serving_choice = choice
    log_choice(choice, cpu_decision)
    resident = ResidentStep(runtime) if budget is None else None
    prefetcher = None
    if config.prefetch is not None:
        experts = min(first.num_experts, top_k + config.prefetch.extra_experts)
        prefetcher = Prefetcher(NextLayerPredictor(model, experts=experts, refs=refs), runtime, config.prefetch)

    # ---- only now modify the model
    register()
    previous_impl = model.get_experts_implementation()
    stash: dict = {}
    handle = CrispHandle(model, refs, runtime, previous_impl, stash)
    tokens = _TokenMask()
    try:
        for ref in refs:
            entries = stash[ref.name] = _detach_weights(ref.module, keep=config.keep_original)
            originals = [(name, obj if where == "param" else None) for name, where, obj, _ in entries]
            _install_guard(ref.module, ref.name, originals)
            ref.module.__dict__[_STATE_ATTR] = _ExpertsState(runtime, ref.layer_id, ref.name, previous_impl, tokens,
                                                             prefetcher, resident)
        handle._model_hooks += [
            model.register_forward_pre_hook(functools.partial(_record_attention_mask, tokens), with_kwargs=True),
            model.register_forward_hook(functools.partial(_clear_attention_mask, tokens), with_kwargs=True,
                                        always_call=True),
        ]
        model.set_experts_implementation(IMPLEMENTATION_NAME)
    except BaseException:
        handle.restore()
        raise
    return handle


def check_pack_weights(pack: CrispPack, model) -> None:
    """Refuse a pack whose recorded weights fingerprint is not ``model``'s (PackMismatchError).

    A pack without a recorded fingerprint (``save_pack`` without one) is accepted; a model whose
    expert weights are not loaded cannot be checked, which is refused too: the caller says
    ``allow_weights_mismatch=True`` when it knows the pack is right.
    """
    try:
        status = check_weights_fingerprint(pack, model)
    except PackMismatchError as exc:
        raise PackMismatchError("this CRISP pack was made from other weights than this model (the weights "
                                "fingerprint in its pack.json differs); pass allow_weights_mismatch=True to use it "
                                "anyway") from exc
    if status is FingerprintStatus.UNAVAILABLE:
        raise PackMismatchError("cannot check that this CRISP pack was made from this model's weights: its expert "
                                "weights are not loaded (placeholders); pass allow_weights_mismatch=True if the pack "
                                "was made from this model's checkpoint")


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


def _local_checkpoint(checkpoint_dir) -> Path:
    """The checkpoint folder, checked up front: load_model never downloads (a hub name fails at once)."""
    if not isinstance(checkpoint_dir, (str, os.PathLike)):
        raise TypeError(f"checkpoint_dir: expected a local folder (str or path), got {type(checkpoint_dir).__name__}")
    path = Path(checkpoint_dir)
    if not path.is_dir():
        raise FileNotFoundError(
            f"checkpoint_dir: {os.fspath(checkpoint_dir)!r} is not a local folder; load_model reads local checkpoints "
            "only and never downloads: fetch it first (e.g. `hf download NAME --local-dir DIR`) and pass DIR")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"checkpoint_dir: {path} has no config.json; expected a transformers checkpoint "
                                "folder (config.json and *.safetensors)")
    return path


def _check_dtype(dtype):
    if dtype is None or dtype == "auto" or isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype) and (
            getattr(torch, dtype).is_floating_point):
        return getattr(torch, dtype)
    raise TypeError(f"dtype: expected None or 'auto' (the checkpoint's) or a floating torch.dtype such as "
                    f"torch.bfloat16, got {dtype!r}")


def load_model(checkpoint_dir, pack_dir, *, device="cpu", dtype=None, plan: CrispPlan | None = None,
               gpu_budget=None, config: RuntimeConfig | None = None, allow_weights_mismatch: bool = False,
               serving=None, cpu=None):
    """Load a causal LM from a local checkpoint plus a CRISP pack: ``(model, handle)``.

    The checkpoint (safetensors) is read on the CPU one tensor at a time into a model built on the
    ``meta`` device: only the non-expert weights are materialised; the expert weights are never read
    whole (their recorded fingerprint is checked from 4-row slices; ``allow_weights_mismatch=True``
    skips that). Then the model is moved to ``device`` and CRISP applied with the pack's experts.
    Full-precision experts never reach the GPU, nor host memory. Nothing is downloaded:
    ``checkpoint_dir`` must be a local folder.
    serving, config, cpu: as in :func:`apply` (None for all: the pack's stored choice for the budget, else the
    default rule; ``crisp_runtime.defaults``).
    """
    path = _local_checkpoint(checkpoint_dir)  # before importing transformers: a wrong name fails at once
    if config is not None and not isinstance(config, RuntimeConfig):
        raise TypeError(f"config: expected RuntimeConfig, got {type(config).__name__}")
    if plan is not None and not isinstance(plan, CrispPlan):
        raise TypeError(f"plan: expected CrispPlan (e.g. CrispPlan.load(path)), got {type(plan).__name__}")
    check_serving_arguments(config, serving, cpu)  # a bad policy fails before the checkpoint loads
    device = _check_device(device, "device")
    dtype = _check_dtype(dtype)
    if not isinstance(allow_weights_mismatch, bool):
        raise TypeError(f"allow_weights_mismatch: expected True or False, got {type(allow_weights_mismatch).__name__}")
    pack = load_pack(pack_dir)  # fail on a bad pack before reading the checkpoint
    budget = parse_budget(gpu_budget)
    top_k = pack.info.get("top_k")
    if budget is not None and isinstance(top_k, int) and top_k > 0:
        _check_budget_fits_layers(budget, pack.layers, top_k)  # apply() checks again; here before the checkpoint
    from .checkpoint import checkpoint_weights_sha256, load_skeleton

    # One tensor at a time through safetensors; the experts stay on disk (meta placeholders): host memory
    # holds the non-expert weights and the pack, never the full-precision experts (crisp_runtime.checkpoint).
    model, cmap = load_skeleton(path, dtype)
    pack.check_model(model)
    recorded = recorded_weights_sha256(pack.info)
    if not allow_weights_mismatch and recorded is not None and recorded != checkpoint_weights_sha256(model, cmap):
        raise PackMismatchError("this CRISP pack was made from other weights than this model (the weights "
                                "fingerprint in its pack.json differs); pass allow_weights_mismatch=True to use it "
                                "anyway")
    model.to(device)
    # The experts are placeholders already (never read): there is nothing to keep whether or not config says so.
    config = None if config is None else replace(config, keep_original=False)
    handle = apply(model, pack, plan=plan, gpu_budget=budget, config=config, allow_weights_mismatch=True,
                   serving=serving, cpu=cpu)  # weights checked above, while they were there
    return model, handle
