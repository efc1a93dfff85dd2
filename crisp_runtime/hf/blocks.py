"""Per-expert MoE blocks: an ``nn.ModuleList`` of small MLPs with the routing in the block's own forward.

transformers v5 families go through ``@use_experts_implementation`` (``crisp_runtime.hf.dropin``). Many
models people run do not: DeepSeek-MoE-16B's remote code (``DeepseekMoE``: a ``MoEGate`` returning
``(topk_idx, topk_weight, aux_loss)``, 64 ``DeepseekMLP`` experts, 2 shared experts as one larger
MLP), transformers v4-era Mixtral (``MixtralSparseMoeBlock``: ``gate`` Linear + experts of
``w1``/``w3``/``w2``, softmax top-2 renormalised) and Qwen1.5-MoE (``Qwen2MoeSparseMoeBlock``:
softmax top-k, ``norm_topk_prob``, a ``shared_expert`` scaled by ``sigmoid(shared_expert_gate(x))``),
and community fine-tunes and merges of them.

A :class:`BlockShape` says, for one such block class, how to get the routing
``(top_k_index, top_k_weights)`` from the block's router, where the experts are and what their
three projections are called, and how to add the shared experts. ``BLOCK_SHAPES`` is the
registry; a new shape is one ``BlockShape(...)`` (a routing function of a few lines), passed as
``apply(model, shapes=(*BLOCK_SHAPES, mine))``.

``apply`` (``crisp_runtime.hf.dropin``) hands such models to :func:`apply_blocks`: the experts' weights are
stacked one layer at a time into the v5 layout (``gate_up_proj (E, 2I, H)``, ``down_proj (E, H, I)``)
and packed by ``crisp_kernels.pack_layer``, the same packing as ``pack_model``; the block's
``forward`` is replaced *on this instance* (an entry in the module's ``__dict__``, no class is
patched) by: route with the block's own router, run the routed experts through the same
:class:`CrispRuntime` (plans, budget, cache, stats), add the shared experts. The experts'
Linear weights become ``meta`` placeholders (plain attributes, so ``model.to()`` skips them); the
original ``Parameter`` objects are kept and ``restore()`` puts them back (the same objects, so
bitwise). The runtime knobs are ``apply``'s, through the same code: ``cpu="off"|"on"|"auto"``
(``cpu_knob.decide_cpu``; hybrid placement on the runtime's CPU worker) and next-layer prefetch
(``RuntimeConfig.prefetch``: ``prefetch.Prefetcher`` with :class:`BlockRoutePredictor`, the next
block's own routing on this block's input, in place of the v5 router call). Not done for these
blocks: padding-aware token counts (``stats()["tokens"]`` counts every position), ``state_dict()``
while applied (it lacks the experts: restore first), ``crisp-profile`` (it needs the v5 experts
interface).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from crisp_kernels import PackedLayer, QuantFormat, pack_layer
from crisp_kernels.experts_module import without_backward
from crisp_runtime.cpu.knob import decide_cpu
from crisp_runtime.execution.runtime import CrispRuntime, RuntimeConfig
from crisp_runtime.hf.handle import (
    CrispHandle,
    budget_bytes,
    check_device,
    check_serving_arguments,
    host_store_budget,
    loaded_source,
    log_choice,
    plan_and_budget_checked,
    read_budget,
    serving_choice_for,
    to_dtype,
)
from crisp_runtime.hf.moe_layers import (
    _LAYER_INDEX,
    UnsupportedModelError,
    _is_experts_module,
    activation_problem,
    model_top_k,
)
from crisp_runtime.planning.plan import CrispPlan
from crisp_runtime.scheduling.prefetch import Prefetcher
from crisp_runtime.storage.pack import (
    CrispPack,
    PackMismatchError,
    fingerprint_mismatch,
    layers_from_source,
    recorded_weights_sha256,
    weights_sha256,
)

_BLOCK_STATE = "_crisp_block_state"

# route(block, x (T, H)) -> (top_k_index (T, k) int, top_k_weights (T, k), router_logits or None)
Route = Callable[[nn.Module, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]
# shared(block, x (T, H)) -> (T, H), added to the routed experts' output
Shared = Callable[[nn.Module, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class BlockShape:
    """How CRISP reads one per-expert MoE block class.

    class_names: ``type(block).__name__`` of the blocks of this shape (the block must also hold an
        ``nn.ModuleList`` at ``experts``: transformers v5's MixtralSparseMoeBlock has the same name
        and an experts *module*, and goes through the v5 path).
    route: the block's routing, as its own forward computes it, from its router (e.g. ``block.gate``).
    projections: the names of each expert's (gate, up, down) ``nn.Linear`` s; the expert computes
        ``down(silu(gate(x)) * up(x))``.
    shared: the shared experts' contribution, or None when the shape has none.
    returns_router_logits: the block's forward returns ``(hidden, router_logits)`` (v4 Mixtral /
        Qwen2-MoE), not only ``hidden``.
    route_logits: ``route`` returns the router's logits over every expert (not None): what a
        prefetch of extra experts beyond the router's top-k ranks them by
        (``PrefetchPolicy.extra_experts``; refused for a shape without them).
    """

    name: str
    class_names: tuple[str, ...]
    route: Route
    projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    experts: str = "experts"
    shared: Shared | None = None
    returns_router_logits: bool = False
    route_logits: bool = True


def route_softmax_topk(block: nn.Module, x: torch.Tensor, *, renormalize: bool):
    """v4 Mixtral / Qwen2-MoE routing: softmax over ``block.gate(x)`` in float32, top ``block.top_k``,
    optionally renormalised, cast back to ``x``'s dtype (as their forwards do)."""
    logits = block.gate(x)
    weights = F.softmax(logits, dim=1, dtype=torch.float)
    weights, index = torch.topk(weights, block.top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return index, weights.to(x.dtype), logits


def route_gate_module(block: nn.Module, x: torch.Tensor):
    """DeepSeek-MoE routing: ``block.gate`` is a module taking (batch, seq, H) and returning
    ``(topk_idx, topk_weight, aux_loss)`` (softmax, top-k, ``norm_topk_prob`` applied inside)."""
    index, weights, _ = block.gate(x.unsqueeze(0))
    return index.reshape(x.shape[0], -1), weights.reshape(x.shape[0], -1), None


def shared_plain(attr: str) -> Shared:
    """Shared experts as one MLP at ``block.<attr>`` (DeepSeek: ``shared_experts``), added unscaled."""
    def shared(block, x):
        mlp = getattr(block, attr, None)
        return None if mlp is None else mlp(x)
    return shared


def shared_sigmoid_gated(attr: str, gate_attr: str) -> Shared:
    """Qwen2-MoE: ``sigmoid(block.<gate_attr>(x)) * block.<attr>(x)``."""
    def shared(block, x):
        return torch.sigmoid(getattr(block, gate_attr)(x)) * getattr(block, attr)(x)
    return shared


BLOCK_SHAPES: tuple[BlockShape, ...] = (
    BlockShape("deepseek-moe", ("DeepseekMoE",), route_gate_module, shared=shared_plain("shared_experts"),
               route_logits=False),
    BlockShape("mixtral-v4", ("MixtralSparseMoeBlock",), functools.partial(route_softmax_topk, renormalize=True),
               projections=("w1", "w3", "w2"), returns_router_logits=True),
    BlockShape("qwen2-moe-v4", ("Qwen2MoeSparseMoeBlock",),
               lambda block, x: route_softmax_topk(block, x, renormalize=bool(block.norm_topk_prob)),
               shared=shared_sigmoid_gated("shared_expert", "shared_expert_gate"), returns_router_logits=True),
)


@dataclass(frozen=True)
class MoeBlockRef:
    """One per-expert MoE block of a model."""

    layer_id: int
    name: str
    shape: BlockShape = field(compare=False)
    module: nn.Module = field(compare=False, repr=False)

    def projections(self, expert: int) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        mlp = getattr(self.module, self.shape.experts)[expert]
        return tuple(getattr(mlp, p) for p in self.shape.projections)

    @property
    def num_experts(self) -> int:
        return len(getattr(self.module, self.shape.experts))

    @property
    def intermediate_size(self) -> int:
        return self.projections(0)[0].weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.projections(0)[0].weight.shape[1]

    def stacked(self, rows: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        """``gate_up_proj (E, 2I, H)`` / ``down_proj (E, H, I)`` as the v5 layout holds them (a copy:
        one layer of full-precision experts). ``rows``: only these neurons (the fingerprint reads 4)."""
        gate_up, down = [], []
        for e in range(self.num_experts):
            gate, up, dn = (p.weight.detach() for p in self.projections(e))
            gate_up.append(torch.cat([gate[rows], up[rows]]) if rows != slice(None) else torch.cat([gate, up]))
            down.append(dn[:, rows])
        return torch.stack(gate_up), torch.stack(down)


def _unsupported_reason(ref: MoeBlockRef) -> str | None:
    experts = getattr(ref.module, ref.shape.experts)
    if len(experts) == 0:
        return "it has no experts"
    want = None
    for e, mlp in enumerate(experts):
        missing = [p for p in ref.shape.projections if not isinstance(getattr(mlp, p, None), nn.Linear)]
        if missing:
            return f"expert {e} has no nn.Linear {missing} (expected {list(ref.shape.projections)})"
        gate, up, down = (getattr(mlp, p) for p in ref.shape.projections)
        if any(p.bias is not None for p in (gate, up, down)):
            return f"expert {e}'s projections have biases"
        act = activation_problem(getattr(mlp, "act_fn", None))
        if act is not None:
            return f"expert {e}'s activation is {act}"
        shapes = (tuple(gate.weight.shape), tuple(up.weight.shape), tuple(down.weight.shape))
        inter, hidden = shapes[0]
        if shapes != ((inter, hidden), (inter, hidden), (hidden, inter)):
            return f"expert {e}: gate/up/down weights {shapes}, expected (I, H), (I, H), (H, I)"
        if want is not None and shapes != want:
            return f"expert {e} has weights {shapes}, expert 0 {want}: CRISP packs experts of one size per layer"
        want = shapes
    return None


def find_moe_blocks(model: nn.Module, shapes: Sequence[BlockShape] = BLOCK_SHAPES) -> list[MoeBlockRef]:
    """Every per-expert MoE block of ``model`` whose class is in ``shapes``, in layer order (maybe none).

    Raises UnsupportedModelError for a block of a known shape that CRISP cannot run (naming it and why).
    """
    by_class = {}
    for shape in shapes:
        if not isinstance(shape, BlockShape):
            raise TypeError(f"shapes: expected BlockShape entries, got {type(shape).__name__}")
        for cls in shape.class_names:
            by_class.setdefault(cls, shape)
    refs = []
    for name, module in model.named_modules():
        shape = by_class.get(type(module).__name__)
        if shape is None or not isinstance(getattr(module, shape.experts, None), nn.ModuleList):
            continue
        match = _LAYER_INDEX.search(name)
        ref = MoeBlockRef(int(match.group(1)) if match else len(refs), name, shape, module)
        reason = _unsupported_reason(ref)
        if reason is not None:
            raise UnsupportedModelError(f"{type(module).__name__} at {name!r} ({shape.name}) is not supported by "
                                        f"CRISP: {reason}")
        refs.append(ref)
    ids = [r.layer_id for r in refs]
    if len(set(ids)) != len(ids):
        raise UnsupportedModelError(f"two MoE blocks share a layer index: {[r.name for r in refs]}")
    if refs and len({(r.num_experts, r.intermediate_size, r.hidden_size) for r in refs}) != 1:
        raise UnsupportedModelError("the MoE blocks differ in (experts, intermediate, hidden) sizes: "
                                    f"{sorted({(r.num_experts, r.intermediate_size, r.hidden_size) for r in refs})}")
    return refs


def uses_per_expert_blocks(model: nn.Module, shapes: Sequence[BlockShape] = BLOCK_SHAPES) -> bool:
    """True when ``model`` has no v5 experts module but per-expert blocks of a registered shape."""
    if any(_is_experts_module(m) for m in model.modules()):
        return False
    return bool(find_moe_blocks(model, shapes))


def pack_blocks(refs: Sequence[MoeBlockRef], fmt: QuantFormat | None = None) -> dict[int, PackedLayer]:
    """Quantize the blocks' expert weights, ``{layer_id: PackedLayer}`` (CPU), one layer stacked at a time."""
    fmt = QuantFormat() if fmt is None else fmt
    out = {}
    for ref in refs:
        if any(p.weight.is_meta for e in range(ref.num_experts) for p in ref.projections(e)):
            raise ValueError(f"{ref.name}: the expert weights are not loaded (meta tensors); nothing to pack")
        gate_up, down = ref.stacked()
        layer = pack_layer(gate_up, down, fmt)
        del gate_up, down
        out[ref.layer_id] = PackedLayer(layer.fmt, layer.qweight.cpu(), layer.scales.cpu(),
                                        None if layer.zeros is None else layer.zeros.cpu(), layer.neuron_order.cpu())
    return out


def blocks_weights_sha256(refs: Sequence[MoeBlockRef]) -> str:
    """The weights fingerprint (``pack.weights_sha256``) of these blocks' experts: the same digest as
    the same weights in the v5 layout, so a pack made from either is recognised."""
    views = []
    for ref in refs:
        gate_up, down = ref.stacked(slice(0, 4))
        views.append(SimpleNamespace(module=SimpleNamespace(gate_up_proj=gate_up, down_proj=down)))
    return weights_sha256(views)


def check_layers_fit_blocks(layers: Mapping[int, PackedLayer], refs: Sequence[MoeBlockRef]) -> None:
    """Raise PackMismatchError unless ``layers`` are these blocks' (layer ids and sizes)."""
    problems = []
    if sorted(layers) != sorted(r.layer_id for r in refs):
        problems.append(f"MoE layers {sorted(layers)} in the pack, {sorted(r.layer_id for r in refs)} in the model")
    for ref in refs:
        layer = layers.get(ref.layer_id)
        want = (ref.num_experts, ref.intermediate_size, ref.hidden_size)
        if layer is not None and (layer.num_experts, layer.intermediate_size, layer.hidden_size) != want:
            problems.append(f"layer {ref.layer_id}: (experts, intermediate, hidden) = "
                            f"{(layer.num_experts, layer.intermediate_size, layer.hidden_size)} in the pack, {want} "
                            "in the model")
    if problems:
        raise PackMismatchError("this CRISP pack was made for another model: " + "; ".join(problems[:6]))


# ---------------------------------------------------------------------- the block forward


class BlockRoutePredictor:
    """Predicts the next per-expert block's routed experts from this block's input: the interface of
    ``prefetch.NextLayerPredictor`` (which calls a v5 router), with the next block's own ``route``.

    As for v5 models, the next router sees this block's MoE input, not its own (see the
    ``crisp_runtime.scheduling.prefetch`` docstring). experts: predicted per token (the route's top-k first,
    then the next ones by router logit; more than top-k needs a shape with ``route_logits``).
    """

    def __init__(self, refs: Sequence[MoeBlockRef], *, top_k: int, experts: int | None = None) -> None:
        self.refs = {r.layer_id: r for r in refs}
        self.layer_ids = [r.layer_id for r in refs]
        self.num_experts = refs[0].num_experts
        self.top_k = top_k
        self.experts = top_k if experts is None else experts
        if not top_k <= self.experts <= self.num_experts:
            raise ValueError(f"experts: expected a count in [top_k={top_k}, num_experts={self.num_experts}], "
                             f"got {experts}")
        if self.experts > top_k:
            lacking = sorted({r.shape.name for r in refs if not r.shape.route_logits})
            if lacking:
                raise ValueError(f"prefetch extra_experts: the {', '.join(lacking)} block routing gives no router "
                                 "logits to rank experts beyond its top-k by; use PrefetchPolicy(extra_experts=0)")
        self._next = dict(zip(self.layer_ids[:-1], self.layer_ids[1:], strict=True))

    def next_layer(self, layer_id: int) -> int | None:
        if layer_id not in self.refs:
            raise KeyError(f"layer {layer_id} is not a MoE block of this model ({self.layer_ids})")
        return self._next.get(layer_id)

    def _route(self, layer_id: int, hidden_states: torch.Tensor):
        nxt = self.next_layer(layer_id)
        if nxt is None:
            return None
        ref = self.refs[nxt]
        index, weights, logits = ref.shape.route(ref.module, hidden_states.reshape(-1, hidden_states.shape[-1]))
        return nxt, index.long(), weights, logits

    @torch.no_grad()
    def predict_routing(self, layer_id: int, hidden_states: torch.Tensor):
        """(next layer id, (T, k) index, (T, k) float32 weights), or None after the last MoE block."""
        routed = self._route(layer_id, hidden_states)
        if routed is None:
            return None
        nxt, index, weights, _ = routed
        return nxt, index, weights.float()

    @torch.no_grad()
    def predict(self, layer_id: int, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """(T, experts) int64 predicted experts of the next block (its route's top-k first), or None."""
        routed = self._route(layer_id, hidden_states)
        if routed is None:
            return None
        _, index, _, logits = routed
        extra = self.experts - index.shape[1]
        if extra <= 0:
            return index[:, : self.experts]
        rest = logits.float().scatter(1, index, -float("inf"))  # the route's choice first, then by logit
        return torch.cat([index, rest.topk(extra, dim=1).indices], dim=1)


class _BlockState:
    __slots__ = ("prefetcher", "ref", "runtime")

    def __init__(self, ref: MoeBlockRef, runtime: CrispRuntime, prefetcher: Prefetcher | None = None) -> None:
        self.ref = ref
        self.runtime = runtime
        self.prefetcher = prefetcher


def _block_forward(state: _BlockState, hidden_states: torch.Tensor, *args, **kwargs):
    """The block's forward while CRISP is applied: its own routing, CRISP's experts, its shared experts."""
    ref = state.ref
    block = ref.module
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    index, weights, logits = ref.shape.route(block, x)
    y = without_backward(f"CRISP experts ({ref.name})", functools.partial(state.runtime.forward, ref.layer_id), x,
                         index, weights.to(x.dtype),
                         hint="Run inference under torch.no_grad(), or restore() the model before training it")
    if state.prefetcher is not None:
        # After this block's copies and kernels are enqueued, as for v5 models (hf._run_experts): the next
        # block's predicted experts queue behind them on the copy stream (CUDA); on the CPU they are copied now.
        state.prefetcher(ref.layer_id, x)
    if ref.shape.shared is not None:
        extra = ref.shape.shared(block, x)
        if extra is not None:
            y = y + extra
    y = y.reshape(shape)
    return (y, logits) if ref.shape.returns_router_logits else y


# ---------------------------------------------------------------------- apply / restore


class BlockHandle(CrispHandle):
    """CRISP applied to a model's per-expert blocks; ``restore()`` (or leaving ``with``) undoes it.

    Same surface as :class:`CrispHandle` (stats, reset_stats, set_plan, plan, layers, gpu_budget)."""

    def __init__(self, model, refs: list[MoeBlockRef], runtime: CrispRuntime, stash: dict) -> None:
        super().__init__(model, refs, runtime)
        self._stash = stash  # name of block -> [(linear, original Parameter, its device, parameter order)]

    def restore(self) -> None:
        """Put the original expert Parameters (the same objects) and the class forward back (idempotent)."""
        if not self.active:
            return
        self.runtime.close()  # the CPU worker thread of hybrid execution, if one was started
        dtype = self._changed_dtype()  # model.to(dtype) while applied: the originals follow it
        self._restore_dense(dtype)
        for ref in self.refs:
            ref.module.__dict__.pop(_BLOCK_STATE, None)
            ref.module.__dict__.pop("forward", None)
            for linear, param, device, order in self._stash.get(ref.name, ()):
                linear.__dict__.pop("weight", None)
                if device is not None and param.device != device:
                    param.data = param.data.to(device)
                linear._parameters["weight"] = to_dtype(param, dtype)
                items = [(k, linear._parameters[k]) for k in order]  # the original order (state_dict)
                linear._parameters.clear()
                linear._parameters.update(items)
        self.active = False


def _detach_expert_weights(ref: MoeBlockRef) -> list:
    entries = []
    for e in range(ref.num_experts):
        for linear in ref.projections(e):
            order = list(linear._parameters)
            param = linear._parameters.pop("weight")
            device = param.device
            if device.type != "cpu":
                param.data = param.data.to("cpu")  # frees the device copy; restore() moves it back
            linear.__dict__["weight"] = torch.empty(param.shape, dtype=param.dtype, device="meta")
            entries.append((linear, param, device, order))
    return entries


def apply_blocks(model, source=None, *, plan: CrispPlan | None = None, gpu_budget=None,
                 fmt: QuantFormat | None = None, config: RuntimeConfig | None = None,
                 allow_weights_mismatch: bool = False, serving=None,
                 shapes: Sequence[BlockShape] = BLOCK_SHAPES, cpu=None):
    """CRISP on ``model``'s per-expert MoE blocks (arguments as :func:`crisp_runtime.apply`, ``cpu``,
    ``config.prefetch`` and the default serving choice included); returns a handle with the same surface as
    ``CrispHandle`` (stats, set_plan, restore, context manager)."""
    check_serving_arguments(config, serving, cpu)
    if config is not None and not config.keep_original:
        raise ValueError("config.keep_original=False: per-expert blocks always keep their original weights "
                         "(restore() puts the same Parameter objects back)")
    if fmt is not None and not isinstance(fmt, QuantFormat):
        raise TypeError(f"fmt: expected a QuantFormat, got {type(fmt).__name__} {fmt!r}")
    if plan is not None and not isinstance(plan, CrispPlan):
        raise TypeError(f"plan: expected CrispPlan (e.g. CrispPlan.load(path)), got {type(plan).__name__}")
    if not isinstance(allow_weights_mismatch, bool):
        raise TypeError(f"allow_weights_mismatch: expected True or False, got {type(allow_weights_mismatch).__name__}")
    refs = find_moe_blocks(model, shapes)
    if not refs:
        raise UnsupportedModelError(f"{type(model).__name__} has no per-expert MoE block of a registered shape "
                                    f"({[s.name for s in shapes]})")
    for ref in refs:
        if _BLOCK_STATE in ref.module.__dict__:
            raise RuntimeError(f"CRISP is already applied to {ref.name}; call handle.restore() first")
    budget = read_budget(gpu_budget)
    if config is not None and config.device is not None:
        device = check_device(config.device, "config.device")
    else:
        expert_ids = {id(p.weight) for r in refs for e in range(r.num_experts) for p in r.projections(e)}
        device = next((p.device for p in model.parameters() if id(p) not in expert_ids and not p.is_meta),
                      torch.device("cpu"))
    top_k = model_top_k(model)

    def check_pack(pack: CrispPack) -> None:
        check_layers_fit_blocks(pack.layers, refs)
        recorded = recorded_weights_sha256(pack.info)
        found = None if recorded is None or allow_weights_mismatch else blocks_weights_sha256(refs)
        if found is not None and found != recorded:
            raise fingerprint_mismatch(recorded, found, directory=pack.directory, argument="allow_weights_mismatch")

    source = loaded_source(source)
    layers, pack_plan = layers_from_source(source, fmt, pack=lambda f: pack_blocks(refs, f), check_pack=check_pack,
                                           check_layers=lambda ls: check_layers_fit_blocks(ls, refs))
    first = layers[refs[0].layer_id]
    budget = budget_bytes(budget, layers)  # a share ("25%") of these layers' expert bytes
    plan = plan_and_budget_checked(pack_plan if plan is None else plan, layers, first, top_k, budget, device)
    choice = serving_choice_for(source, plan, layers, top_k, budget, serving=serving, config=config, cpu=cpu)
    requested_budget, budget = budget, host_store_budget(choice.cpu, device, layers, top_k, budget)
    config = choice.config
    predictor = None
    if config.prefetch is not None:  # checked before anything is measured or built
        predictor = BlockRoutePredictor(refs, top_k=top_k,
                                        experts=min(first.num_experts, top_k + config.prefetch.extra_experts))
    config, cpu_decision = decide_cpu(choice.cpu, config=config, budget=budget, device=torch.device(device),
                                      layers=layers, hybrid_config=choice.hybrid)
    if config.prefetch is not None and predictor is None:  # the hybrid form prefetches where the GPU form did not
        predictor = BlockRoutePredictor(refs, top_k=top_k,
                                        experts=min(first.num_experts, top_k + config.prefetch.extra_experts))
    runtime = CrispRuntime(layers, plan, device=device, gpu_budget=budget, config=config)
    runtime.cpu_decision = cpu_decision
    runtime.serving_choice = choice
    runtime.requested_budget = requested_budget  # what stats() and gpu_budget report
    log_choice(choice, cpu_decision)
    # the CPU-only form drops the GPU form's prefetch (nothing is copied)
    prefetcher = None if predictor is None or config.prefetch is None else Prefetcher(predictor, runtime,
                                                                                      config.prefetch)

    # ---- only now modify the model
    stash: dict = {}
    handle = BlockHandle(model, refs, runtime, stash)
    try:
        for ref in refs:
            stash[ref.name] = _detach_expert_weights(ref)
            state = _BlockState(ref, runtime, prefetcher)
            ref.module.__dict__[_BLOCK_STATE] = state
            ref.module.__dict__["forward"] = functools.partial(_block_forward, state)
        handle._swap_dense()
    except BaseException:
        handle.restore()
        raise
    return handle
