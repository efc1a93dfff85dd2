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
``RuntimeConfig(keep_original=False)``; ``load_model`` never has them). A ``model.to(dtype)`` / ``.half()`` while
applied skips them too: ``restore()`` converts them (and attention's original layers) to the model's new dtype.
Shared experts (Qwen2-MoE, DeepSeek) are ordinary dense MLPs outside the experts module: untouched, resident.

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
import os
import warnings
from dataclasses import replace
from pathlib import Path

import torch

from crisp_kernels import QuantFormat
from crisp_kernels.experts_module import without_backward
from crisp_runtime.execution.resident_path import ResidentStep
from crisp_runtime.execution.runtime import CrispRuntime, RuntimeConfig
from crisp_runtime.hf import blocks
from crisp_runtime.hf.handle import (
    MODEL_DTYPES,
    MODEL_DTYPES_TEXT,
    BudgetShare,
    CrispHandle,
    budget_bytes,
    check_budget_fits_layers,
    check_device,
    check_model_dtype,
    check_serving_arguments,
    host_store_budget,
    loaded_source,
    log_choice,
    pack_folder,
    plan_and_budget_checked,
    read_budget,
    serving_choice_for,
    to_dtype,
)
from crisp_runtime.hf.moe_layers import MoeLayerRef, UnsupportedModelError, find_moe_layers, model_top_k
from crisp_runtime.planning.plan import CrispPlan
from crisp_runtime.scheduling.prefetch import NextLayerPredictor, Prefetcher
from crisp_runtime.storage.pack import (
    CrispPack,
    FingerprintStatus,
    PackMismatchError,
    check_layers_fit_model,
    check_weights_fingerprint,
    fingerprint_mismatch,
    layers_from_source,
    load_pack,
    pack_model,
    recorded_weights_sha256,
)

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

    __slots__ = ("host_step", "layer_id", "name", "prefetcher", "previous_impl", "resident", "runtime", "tokens")

    def __init__(self, runtime: CrispRuntime, layer_id: int, name: str, previous_impl, tokens: _TokenMask,
                 prefetcher: Prefetcher | None = None, resident: ResidentStep | None = None, host_step=None) -> None:
        self.runtime = runtime
        # _run_experts marked torch.compiler.disable, made by apply: the marking imports torch._dynamo (1.5 s on the
        # 2-core VM), which a model being patched has imported already and `import crisp_runtime` should not pay
        self.host_step = host_step
        self.resident = resident  # every expert resident: the step torch.compile traces (resident_path)
        self.layer_id = layer_id
        self.name = name
        self.previous_impl = previous_impl
        self.tokens = tokens
        self.prefetcher = prefetcher


_NO_GRAD_HINT = ("Run inference under torch.no_grad() / torch.inference_mode(), or restore() the model "
                 "(handle.restore()) before training it")


def _run_experts(state: _ExpertsState, hidden_states, top_k_index, top_k_weights):
    # Run as torch.compiler.disable(_run_experts) (_ExpertsState.host_step): the step reads the routing on the host
    # (widths, copies, order, statistics), so a compiled model breaks its graph here, once per MoE layer, instead of
    # at each of those reads.
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
        run = functools.partial(state.host_step, state)
    return without_backward(f"CRISP experts ({state.name})", run, hidden_states, top_k_index, top_k_weights,
                            hint=_NO_GRAD_HINT)


def register() -> None:
    """Register the ``crisp`` experts implementation with transformers (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION_NAME, crisp_experts_forward)


# ---------------------------------------------------------------------- the handle


class ExpertsHandle(CrispHandle):
    """CRISP applied to a v5 model's experts modules (the ``crisp`` experts implementation)."""

    def __init__(self, model, refs: list[MoeLayerRef], runtime: CrispRuntime, previous_impl, stash: dict) -> None:
        super().__init__(model, refs, runtime)
        self._previous_impl = previous_impl
        self._stash = stash  # name of module -> [(weight name, "param" | "attr", object, device)]
        self._model_hooks: list = []  # the attention-mask hooks on the model (removed by restore)

    def restore(self) -> None:
        """Bring back the original expert weights and experts implementation (idempotent)."""
        if not self.active:
            return
        self.runtime.close()  # the CPU worker thread of hybrid execution, if one was started
        dtype = self._changed_dtype()  # model.to(dtype) while applied: the originals follow it
        self._restore_dense(dtype)
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
                    module._parameters[name] = to_dtype(obj, dtype)
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
    """Run ``model``'s MoE experts through CRISP, on this model instance only; returns a :class:`CrispHandle`.

    Use it as a context manager (``with apply(model, pack, gpu_budget="6GiB") as crisp: model.generate(...)``)
    or call ``crisp.restore()`` to put the original experts back. No class is patched. With only a pack and a
    budget it runs the configuration the pack stores for that budget (or the default rule): set nothing else.

    Arguments:

    - ``source``: the experts to run. A path to a pack folder written by ``crisp-profile`` (its plan.json is
      used unless ``plan`` is given); a ``CrispPack`` or ``{layer_id: PackedLayer}`` as is; None packs the
      model's own expert weights now (4-bit, full width, in their present order: no CRISP widths).
    - ``plan``: a :class:`CrispPlan` to use instead of the pack's (None: the pack's plan; full width when there
      is no pack).
    - ``gpu_budget``: GPU memory for the expert prefix cache: bytes (an int or a string such as ``"6GiB"``) or a
      share of the pack's expert bytes at full width (``"25%"``: the unit of ``crisp-profile --gpu-budget``, of the
      choices a pack stores and of the simulator's budgets); experts stay in host memory and only the missing
      prefix rows are copied. None keeps every packed expert on the device (no offload). A budget too small
      for one layer's routed experts is refused.
    - ``serving`` / ``config``: None for both (the default) = the serving choice the pack stores for this budget,
      else the default rule from the pack's own statistics (``crisp_runtime.planning.defaults``: auxiliaries
      served from what is resident, next-layer prefetch, next-use eviction; the neuron split when the CPU pays).
      ``serving="paper"`` is the paper's configuration (the plan's widths, no prefetch, LRU, cpu off), the
      baseline every figure is compared with. Otherwise a :class:`ServingPolicy`, a name (``"plan"``,
      ``"resident"``, ``"resident-floor75"``, ...) or its dict, and/or a :class:`RuntimeConfig` (eviction,
      prefetch, expert order, device, kernels), run as given. ``stats()["serving"]`` says what runs and why (also
      logged once, logger ``crisp_runtime``).
    - ``cpu``: None (default) = ``"auto"`` for the stored and default choices (``"off"`` when ``serving`` or
      ``config`` is given): offloaded experts computed on the host CPU where the measured bandwidths say it pays
      (with the model on the CPU, every expert on the CPU kernel from the packed host rows, budget or not:
      ``cpu_only``); ``"on"`` (whenever a step's cost model says the CPU beats copying) or ``"off"`` (on a CPU:
      the device path a GPU runs, torch ops on dequantized rows). ``stats()["cpu"]`` says what was decided.
    - ``fmt``: the 4-bit format when ``source`` is None (default: group 64, asymmetric).
    - ``allow_weights_mismatch``: use a pack whose recorded weights fingerprint differs from the model's expert
      weights. Refused by default: the same architecture with other weights would run without a word, wrongly.
    - ``shapes``: per-expert MoE block shapes to recognise (None: ``blocks.BLOCK_SHAPES``) for models whose MoE
      layers are per-expert modules (DeepSeek-MoE remote code, v4 Mixtral, Qwen1.5-MoE).

    Errors name the bad argument: a pack of other weights, a bad budget, a model without MoE layers.
    """
    check_serving_arguments(config, serving, cpu)
    if fmt is not None and not isinstance(fmt, QuantFormat):
        raise TypeError(f"fmt: expected a QuantFormat (e.g. QuantFormat(group_size=64, symmetric=False)), got "
                        f"{type(fmt).__name__} {fmt!r}")
    if plan is not None and not isinstance(plan, CrispPlan):
        raise TypeError(f"plan: expected CrispPlan (e.g. CrispPlan.load(path)), got {type(plan).__name__}")
    if not isinstance(allow_weights_mismatch, bool):
        raise TypeError(f"allow_weights_mismatch: expected True or False, got {type(allow_weights_mismatch).__name__}")

    shapes = blocks.BLOCK_SHAPES if shapes is None else _check_shapes(shapes)
    if isinstance(model, torch.nn.Module):
        check_model_dtype(model)
    if isinstance(model, torch.nn.Module) and blocks.uses_per_expert_blocks(model, shapes):
        return blocks.apply_blocks(model, source, plan=plan, gpu_budget=gpu_budget, fmt=fmt, config=config,
                                   allow_weights_mismatch=allow_weights_mismatch, serving=serving, shapes=shapes,
                                   cpu=cpu)
    if not (hasattr(model, "set_experts_implementation") and hasattr(model, "get_experts_implementation")):
        raise UnsupportedModelError(f"{type(model).__name__} is not a transformers v5 PreTrainedModel with "
                                    "set_experts_implementation(), and has no per-expert MoE block of a registered "
                                    f"shape ({', '.join(s.name for s in shapes)}; crisp_runtime.hf.blocks)")
    return _apply_to_experts(model, find_moe_layers(model), source, plan=plan, budget=read_budget(gpu_budget),
                             fmt=fmt, config=config, allow_weights_mismatch=allow_weights_mismatch, serving=serving,
                             cpu=cpu)


def _check_shapes(shapes) -> tuple:
    """apply's ``shapes`` as a tuple of BlockShape, with an error naming the argument."""
    hint = "expected None or a sequence of crisp_runtime.hf.blocks.BlockShape (e.g. blocks.BLOCK_SHAPES)"
    try:
        out = tuple(shapes) if not isinstance(shapes, (str, bytes)) else None
    except TypeError:
        out = None
    if out is None or not all(isinstance(s, blocks.BlockShape) for s in out):
        raise TypeError(f"shapes: {hint}, got {type(shapes).__name__} {shapes!r}")
    return out


def _apply_to_experts(model, refs: list[MoeLayerRef], source, *, plan: CrispPlan | None,
                      budget: int | BudgetShare | None,
                      fmt: QuantFormat | None, config: RuntimeConfig | None, allow_weights_mismatch: bool, serving,
                      cpu) -> ExpertsHandle:
    """:func:`apply` on a v5 model's experts modules ``refs`` (found once by the caller), its arguments checked."""
    from crisp_runtime.cpu.knob import decide_cpu

    for ref in refs:
        if _STATE_ATTR in ref.module.__dict__:
            raise RuntimeError(f"CRISP is already applied to {ref.name}; call handle.restore() first")
    device = (check_device(config.device, "config.device") if config is not None and config.device is not None
              else _model_device(model, refs))
    top_k = model_top_k(model)
    source = loaded_source(source)

    # ---- the packed layers
    def check_pack(pack: CrispPack) -> None:
        pack.check_model(model, refs=refs)
        if not allow_weights_mismatch:
            check_pack_weights(pack, model, refs=refs)

    layers, pack_plan = layers_from_source(source, fmt, pack=lambda f: pack_model(model, f, refs=refs),
                                           check_pack=check_pack,
                                           check_layers=lambda ls: check_layers_fit_model(ls, model, refs=refs))
    first = layers[refs[0].layer_id]
    budget = budget_bytes(budget, layers)  # a share ("25%") of these layers' expert bytes
    plan = plan_and_budget_checked(pack_plan if plan is None else plan, layers, first, top_k, budget, device)
    choice = serving_choice_for(source, plan, layers, top_k, budget, serving=serving, config=config, cpu=cpu)
    requested_budget, budget = budget, host_store_budget(choice.cpu, device, layers, top_k, budget)
    config, cpu_decision = decide_cpu(choice.cpu, config=choice.config, budget=budget, device=torch.device(device),
                                      layers=layers, hybrid_config=choice.hybrid)
    runtime = CrispRuntime(layers, plan, device=device, gpu_budget=budget, config=config)
    runtime.cpu_decision = cpu_decision
    runtime.serving_choice = choice
    runtime.requested_budget = requested_budget  # what stats() and gpu_budget report
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
    handle = ExpertsHandle(model, refs, runtime, previous_impl, stash)
    tokens = _TokenMask()
    host_step = torch.compiler.disable(_run_experts)
    try:
        for ref in refs:
            entries = stash[ref.name] = _detach_weights(ref.module, keep=config.keep_original)
            originals = [(name, obj if where == "param" else None) for name, where, obj, _ in entries]
            _install_guard(ref.module, ref.name, originals)
            ref.module.__dict__[_STATE_ATTR] = _ExpertsState(runtime, ref.layer_id, ref.name, previous_impl, tokens,
                                                             prefetcher, resident, host_step)
        handle._model_hooks += [
            model.register_forward_pre_hook(functools.partial(_record_attention_mask, tokens), with_kwargs=True),
            model.register_forward_hook(functools.partial(_clear_attention_mask, tokens), with_kwargs=True,
                                        always_call=True),
        ]
        model.set_experts_implementation(IMPLEMENTATION_NAME)
        handle._swap_dense()
    except BaseException:
        handle.restore()
        raise
    return handle


def check_pack_weights(pack: CrispPack, model, *, refs=None) -> None:
    """Refuse a pack whose recorded weights fingerprint is not ``model``'s (PackMismatchError).

    A pack without a recorded fingerprint (``save_pack`` without one) is accepted; a model whose
    expert weights are not loaded cannot be checked, which is refused too: the caller says
    ``allow_weights_mismatch=True`` when it knows the pack is right.
    """
    status = check_weights_fingerprint(pack, model, refs=refs, argument="allow_weights_mismatch")
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
    if dtype is None or dtype == "auto":
        return dtype
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        dtype = getattr(torch, dtype)
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype not in MODEL_DTYPES:
        raise ValueError(f"dtype: {dtype} is not a dtype CRISP runs; expected None or 'auto' (the checkpoint's) or "
                         f"{MODEL_DTYPES_TEXT}")
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    raise TypeError(f"dtype: expected None or 'auto' (the checkpoint's) or a floating torch.dtype such as "
                    f"torch.bfloat16, got {dtype!r}")


def load_model(checkpoint_dir, pack_dir, *, device="cpu", dtype=None, plan: CrispPlan | None = None,
               gpu_budget=None, config: RuntimeConfig | None = None, allow_weights_mismatch: bool = False,
               serving=None, cpu=None):
    """Load a causal LM from a local checkpoint plus a CRISP pack: returns ``(model, handle)``.

    The checkpoint (safetensors) is read one tensor at a time into a model built on the ``meta`` device: only
    the non-expert weights are loaded; the full-precision experts are never read whole, nor put on the GPU
    (their fingerprint is checked from 4-row slices). The model is then moved to ``device`` and runs its
    experts from the pack. Nothing is downloaded.

    Arguments:

    - ``checkpoint_dir``: a local transformers checkpoint folder (config.json + safetensors).
    - ``pack_dir``: the pack folder ``crisp-profile`` wrote for this checkpoint.
    - ``device``: where the model runs (``"cpu"``, ``"cuda"``, ``"cuda:N"``).
    - ``dtype``: the non-expert weights' dtype (None: the checkpoint's).
    - ``gpu_budget``, ``serving``, ``config``, ``cpu``, ``plan``, ``allow_weights_mismatch``: as in :func:`apply`
      (with only a budget: the pack's stored choice for it, else the default rule).

    ``handle.restore()`` cannot bring back the original experts (they were never loaded); reload the checkpoint
    to run it without CRISP.
    """
    path = _local_checkpoint(checkpoint_dir)  # before importing transformers: a wrong name fails at once
    if config is not None and not isinstance(config, RuntimeConfig):
        raise TypeError(f"config: expected RuntimeConfig, got {type(config).__name__}")
    if plan is not None and not isinstance(plan, CrispPlan):
        raise TypeError(f"plan: expected CrispPlan (e.g. CrispPlan.load(path)), got {type(plan).__name__}")
    check_serving_arguments(config, serving, cpu)  # a bad policy fails before the checkpoint loads
    device = check_device(device, "device")
    dtype = _check_dtype(dtype)
    if not isinstance(allow_weights_mismatch, bool):
        raise TypeError(f"allow_weights_mismatch: expected True or False, got {type(allow_weights_mismatch).__name__}")
    pack = load_pack(pack_folder(pack_dir, "pack_dir"))  # fail on a bad pack before reading the checkpoint
    budget = budget_bytes(read_budget(gpu_budget), pack.layers)
    top_k = pack.info.get("top_k")
    if budget is not None and isinstance(top_k, int) and top_k > 0:
        check_budget_fits_layers(budget, pack.layers, top_k)  # apply() checks again; here before the checkpoint
    from crisp_runtime.hf.checkpoint import checkpoint_weights_sha256, load_skeleton

    # One tensor at a time through safetensors; the experts stay on disk (meta placeholders): host memory
    # holds the non-expert weights and the pack, never the full-precision experts (crisp_runtime.hf.checkpoint).
    model, cmap = load_skeleton(path, dtype)
    check_model_dtype(model)  # a checkpoint stored in float64, dtype None
    pack.check_model(model, refs=cmap.refs)
    recorded = recorded_weights_sha256(pack.info)
    found = None if allow_weights_mismatch or recorded is None else checkpoint_weights_sha256(model, cmap)
    if found is not None and found != recorded:
        raise fingerprint_mismatch(recorded, found, directory=pack.directory, argument="allow_weights_mismatch")
    model.to(device)
    # The experts are placeholders already (never read): there is nothing to keep whether or not config says so.
    config = None if config is None else replace(config, keep_original=False)
    handle = _apply_to_experts(model, cmap.refs, pack, plan=plan, budget=budget, fmt=None, config=config,
                               allow_weights_mismatch=True, serving=serving, cpu=cpu)  # weights checked above
    return model, handle
