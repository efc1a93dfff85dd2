"""Predicting the next MoE layer's routed experts, for prefetching them while this layer computes.

What is available when the experts of layer l run is their input: the MoE input of layer l, i.e.
the residual stream after layer l's attention and its post-attention RMSNorm (the ``hidden_states``
the experts forward receives). Layer l+1's router sees ``norm_{l+1}(h + attn_{l+1}(h) + moe_l(h))``
instead; we apply layer l+1's router to layer l's MoE input as is. The residual stream changes
little from one layer to the next, so the ranking of l+1's router logits mostly survives (the
measured precision / recall per layer are in docs/profile-and-eval.md; Pre-gated MoE and ProMoE
use the same idea).

The router of each MoE layer is found through the model's public modules: the experts module that
``crisp_runtime.hf.moe_layers.find_moe_layers`` finds sits in a sparse-MoE block whose ``gate`` is the router, and
most transformers (v5) families (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, GLM-4.5, ...) call it as
``router_logits, top_k_weights, top_k_index = block.gate(hidden_states)`` (checked once on a zero token). Others route
in the block's own forward (a router named otherwise, a plain linear ``gate`` with a bias added after it, a router
taking more arguments: Granite, Jamba, Phi-3.5-MoE, LFM2-MoE, MiniMax-M2, AFMoE); for those the block itself is run
on the hidden state and stopped where it calls its experts, whose inputs are its routing.

A prediction of ``n`` experts per token is the router's own top-k (its routing rule, with its
grouping and biases where the family has them) followed by the next ``n - k`` experts by router
logit. Nothing here touches a device beyond the one the hidden state is on.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from crisp_runtime.hf.moe_layers import (
    MoeLayerRef,
    UnsupportedModelError,
    experts_input_hooks,
    find_moe_layers,
    model_top_k,
)
from crisp_runtime.planning.serving import DominantWiden, ServingPolicy, ahead_width
from crisp_runtime.scheduling.copy_window import PrefetchWindow


@dataclass(frozen=True)
class RouterRef:
    """The router of one MoE layer: its ``gate`` (``experts`` None), or the MoE block whose forward routes and then
    calls ``experts`` (the routing read from that call's inputs, :func:`block_routing`)."""

    layer_id: int
    name: str
    module: nn.Module = field(compare=False, repr=False)
    experts: nn.Module | None = field(default=None, compare=False, repr=False)

    def route(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """(router logits or None, (T, k) weights, (T, k) index) for hidden_states (T, H), out of the model's sight
        (:func:`unseen`): the router's (or block's) own hooks do not run, and what the model records while it runs
        (``output_router_logits``) gets no entry from the prediction."""
        if self.experts is None:
            return unseen(self.module.forward, hidden_states)
        weights, index = unseen(block_routing, self.module, self.experts, hidden_states)
        return None, weights, index


def unseen(fn, *args):
    """``fn(*args)`` in a fresh, empty ``contextvars`` context: every context variable at its default there, so
    that what transformers collects during a forward (router logits and hidden states, by hooks that read the
    collector from a context variable) does not see a prediction run in the middle of that forward, out of order
    (``output_router_logits=True`` gained an entry per predicted layer, and the aux loss moved)."""
    return contextvars.Context().run(fn, *args)


class _Routed(Exception):  # noqa: N818 - control flow, never seen outside block_routing
    """The experts' inputs of a block's forward, which block_routing stops there."""

    def __init__(self, index: torch.Tensor, weights: torch.Tensor) -> None:
        super().__init__("routed")
        self.index, self.weights = index, weights


def block_routing(block: nn.Module, experts: nn.Module, hidden_states: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """((T, k) weights, (T, k) index) that ``block``'s forward on hidden_states (T, H) passes its ``experts``: the
    block runs as a batch of one sequence up to that call, which a forward pre-hook stops (put first, so that no
    other hook on the experts, such as a trace recorder, sees the call; in this thread only, so that another thread's
    forward of the same model passes); nothing after it runs. What a block computes before its experts runs twice
    (AFMoE's shared experts: one more shared-expert pass a predicted layer), and hooks on the modules it calls on
    the way (its router) see that call."""

    owner = threading.get_ident()

    def stop(module, args, kwargs):
        if threading.get_ident() != owner:  # another thread's forward of the same model: not this prediction's
            return None
        index = kwargs.get("top_k_index", args[1] if len(args) > 1 else None)
        weights = kwargs.get("top_k_weights", args[2] if len(args) > 2 else None)
        raise _Routed(index, weights)

    handle = experts.register_forward_pre_hook(stop, with_kwargs=True, prepend=True)
    try:
        block.forward(hidden_states.unsqueeze(0))  # forward, not __call__: the block's own hooks see no prediction
    except _Routed as routed:
        if routed.index is None or routed.weights is None:
            raise UnsupportedModelError(f"{type(block).__name__} calls its experts without top_k_index and "
                                        "top_k_weights: its routing cannot be read") from None
        return routed.weights.reshape(hidden_states.shape[0], -1), routed.index.reshape(hidden_states.shape[0], -1)
    finally:
        handle.remove()
    raise UnsupportedModelError(f"{type(block).__name__}'s forward did not call its experts: its routing cannot be "
                                "read")


def _gives_routing(gate: nn.Module, ref: MoeLayerRef) -> bool:
    """Whether ``gate`` maps hidden states (T, H) to (router logits (T, E), weights (T, k), index (T, k)), tried on
    one zero token on its own device and dtype (meta included: then only the shapes are computed)."""
    param = next(gate.parameters(), None)
    x = torch.zeros(1, ref.hidden_size, device=None if param is None else param.device,
                    dtype=None if param is None else param.dtype)
    try:
        with torch.no_grad():
            out = gate.forward(x)  # not __call__: the gate's hooks see no probe
    except Exception:  # a router that takes other arguments: the block routes it
        return False
    if not (isinstance(out, tuple) and len(out) == 3 and all(isinstance(t, torch.Tensor) for t in out)):
        return False
    logits, weights, index = out
    return (logits.shape == (1, ref.num_experts) and weights.dim() == 2 and weights.shape == index.shape
            and not index.is_floating_point())


def find_routers(model: nn.Module, refs: Sequence[MoeLayerRef] | None = None) -> dict[int, RouterRef]:
    """{layer_id: router} for every supported MoE layer of ``model``: the ``gate`` beside its experts where it gives
    (logits, weights, index), else the MoE block holding them (routed by its own forward, :func:`block_routing`)."""
    refs = find_moe_layers(model) if refs is None else refs
    routers = {}
    for ref in refs:
        block_name = ref.name.rpartition(".")[0]
        block = model.get_submodule(block_name) if block_name else model
        gate = getattr(block, "gate", None)
        if isinstance(gate, nn.Module) and gate is not ref.module and _gives_routing(gate, ref):
            routers[ref.layer_id] = RouterRef(ref.layer_id, f"{block_name}.gate" if block_name else "gate", gate)
        elif block is not ref.module:
            routers[ref.layer_id] = RouterRef(ref.layer_id, block_name, block, experts=ref.module)
        else:
            raise UnsupportedModelError(f"the experts at {ref.name!r} sit in no MoE block with a router: next-layer "
                                        "prediction needs one")
    return routers


class NextLayerPredictor:
    """Predicts layer l+1's routed experts from layer l's MoE input (see the module docstring).

    experts: experts predicted per token (``top_k`` = the router's own choice; ``top_k + 1`` adds
    the next expert by router logit, trading precision for recall).
    """

    def __init__(self, model: nn.Module, *, experts: int | None = None,
                 refs: Sequence[MoeLayerRef] | None = None) -> None:
        refs = find_moe_layers(model) if refs is None else list(refs)
        self.routers = find_routers(model, refs)
        self.layer_ids = [r.layer_id for r in refs]
        self.num_experts = refs[0].num_experts
        self.top_k = model_top_k(model)
        self.experts = self.top_k if experts is None else experts
        if not self.top_k <= self.experts <= self.num_experts:
            raise ValueError(f"experts: expected a count in [top_k={self.top_k}, num_experts={self.num_experts}], "
                             f"got {experts}")
        if self.experts > self.top_k and not self.ranks_by_logit:
            by_block = next(r.name for r in self.routers.values() if r.experts is not None)
            raise UnsupportedModelError(f"predicting {self.experts} experts a token (the router's top-{self.top_k} and "
                                        f"{self.experts - self.top_k} more by logit: PrefetchPolicy.extra_experts) "
                                        f"needs the router's logits, and {by_block} routes inside its own forward "
                                        "(no 'gate' giving logits, weights and index): use extra_experts=0")
        self._next = dict(zip(self.layer_ids[:-1], self.layer_ids[1:], strict=True))

    @property
    def ranks_by_logit(self) -> bool:
        """Whether every router gives its logits, so that experts beyond the top-k can be predicted (False where a
        block routes inside its own forward)."""
        return all(r.experts is None for r in self.routers.values())

    def next_layer(self, layer_id: int) -> int | None:
        """The MoE layer after ``layer_id``, or None for the last one."""
        if layer_id not in self.routers:
            raise KeyError(f"layer {layer_id} is not a MoE layer of this model ({self.layer_ids})")
        return self._next.get(layer_id)

    @torch.no_grad()
    def predict(self, layer_id: int, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """(T, experts) int64 predicted experts of the next MoE layer (router's top-k first), or None
        when ``layer_id`` is the last MoE layer. hidden_states: layer ``layer_id``'s MoE input (T, H)."""
        nxt = self.next_layer(layer_id)
        if nxt is None:
            return None
        logits, _, index = self.routers[nxt].route(hidden_states.reshape(-1, hidden_states.shape[-1]))
        index = index.long()
        extra = self.experts - index.shape[1]
        if extra <= 0:
            return index[:, : self.experts]
        rest = logits.float().scatter(1, index, -float("inf"))  # the router's choice first, then by logit
        return torch.cat([index, rest.topk(extra, dim=1).indices], dim=1)

    @torch.no_grad()
    def predict_routing(self, layer_id: int, hidden_states: torch.Tensor):
        """(next layer id, (T, k) index, (T, k) weights) the next layer's router gives layer ``layer_id``'s
        MoE input (None for the last layer): what a plan needs to give predicted experts a width."""
        nxt = self.next_layer(layer_id)
        if nxt is None:
            return None
        _, weights, index = self.routers[nxt].route(hidden_states.reshape(-1, hidden_states.shape[-1]))
        return nxt, index.long(), weights.float()


@dataclass(frozen=True)
class PredictionAccuracy:
    """Precision and recall of next-layer predictions for one layer pair, micro-averaged over tokens."""

    layer_id: int  # the layer whose MoE input predicts
    next_layer_id: int
    predicted_per_token: int
    tokens: int
    hits: int  # predicted (token, expert) slots that the next layer routed
    precision: float  # hits / predicted slots
    recall: float  # hits / routed slots of the next layer


def prediction_accuracy(index: np.ndarray | torch.Tensor, predicted: np.ndarray | torch.Tensor,
                        layer_ids: Sequence[int], experts: int | None = None) -> list[PredictionAccuracy]:
    """Per layer pair (l, l+1): precision and recall of ``predicted[l]`` against the routing ``index[l + 1]``.

    index: (L, T, k) routed experts; predicted: (L, T, n) predicted experts of the next layer (the last
    layer's row is unused); experts: use the first ``experts`` predictions (default all n). A token's
    predicted experts are a set: a duplicate counts once.
    """
    index = torch.as_tensor(np.asarray(index)).long()
    predicted = torch.as_tensor(np.asarray(predicted)).long()
    if index.dim() != 3 or predicted.dim() != 3 or index.shape[:2] != predicted.shape[:2]:
        raise ValueError(f"index (L, T, k) and predicted (L, T, n) must share L and T, got {tuple(index.shape)} and "
                         f"{tuple(predicted.shape)}")
    n = predicted.shape[2] if experts is None else experts
    if not 1 <= n <= predicted.shape[2]:
        raise ValueError(f"experts: expected 1..{predicted.shape[2]}, got {experts}")
    num_experts = int(max(index.max(), predicted.max())) + 1
    out = []
    for li in range(index.shape[0] - 1):
        slots = predicted[li, :, :n]
        slots = torch.where(slots >= 0, slots, num_experts)  # a negative sentinel predicts nothing: a spare column
        pred = torch.zeros(index.shape[1], num_experts + 1, dtype=torch.bool).scatter_(1, slots, True)[:, :-1]
        routed = torch.zeros_like(pred).scatter_(1, index[li + 1], True)
        hits = int((pred & routed).sum())
        npred, nrouted = int(pred.sum()), int(routed.sum())
        out.append(PredictionAccuracy(int(layer_ids[li]), int(layer_ids[li + 1]), n, index.shape[1], hits,
                                      hits / npred if npred else 0.0, hits / nrouted if nrouted else 0.0))
    return out


@contextlib.contextmanager
def record_predictions(model: nn.Module, predictor: NextLayerPredictor,
                       refs: Sequence[MoeLayerRef] | None = None) -> Iterator[dict[int, list[torch.Tensor]]]:
    """Record ``predictor``'s next-layer prediction at every experts call: {layer_id: [(T, n) int64 CPU]}.

    Hooks the experts modules' inputs (``moe_layers.experts_input_hooks``, as ``record_routing``), so it
    works with any experts implementation; the last MoE layer records rows of -1.
    """
    refs = find_moe_layers(model) if refs is None else refs
    out: dict[int, list[torch.Tensor]] = {}

    def make_hook(layer_id):
        def hook(module, args, kwargs):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            pred = predictor.predict(layer_id, hidden)
            if pred is None:
                pred = torch.full((hidden.reshape(-1, hidden.shape[-1]).shape[0], predictor.experts), -1,
                                  dtype=torch.int64)
            out.setdefault(layer_id, []).append(pred.detach().to("cpu", torch.int64))

        return hook

    with experts_input_hooks(refs, make_hook):
        yield out


# What predicts the next layer's experts (``to_dict``'s "rule"): the one rule there is (NextLayerPredictor)
PREFETCH_RULE = "next-layer router on this layer's MoE input"


class PrefetchWidth(enum.Enum):
    """The width a prefetch asks for each predicted (token, expert) slot of the next layer.

    Why not always the plan's (docs/serving-and-residency.md, 2026-12-01, 25% budget): under a dominant floor
    of 75% a missed dominant is served at 75%, yet PLAN prefetches it at full width, so up to a quarter
    of the 0.46 GB/token of prefetch is rows a floor-served dominant would not have loaded; but PLAN is
    also what widens a floor-loaded dominant (a hit serves the resident width), which kept the
    accuracy loss at 1.96% against 3.44% without prefetch.
    """

    PLAN = "plan"  # every predicted slot at the plan's width (the default)
    SERVING = "serving"  # what the serving policy loads on a miss: the floor for a dominant, the plan's
    # width for an auxiliary, nothing for an auxiliary it would skip; the plan's width for a dominant the
    # policy widens once resident (``serving.ahead_width``: its first use would copy nothing more)
    AUX_NONE = "aux-none"  # dominants only, at the plan's width; no auxiliary is prefetched


@dataclass(frozen=True)
class PrefetchPolicy:
    """Prefetch across layers: while layer l runs, copy what layer l+1 is predicted to need.

    The request for layer l+1: each expert the next router picks for a token of this step (its top-k,
    see :class:`NextLayerPredictor`) at the width ``width`` gives that predicted slot (the largest
    over the step's tokens; :func:`slot_widths`), plus ``extra_experts`` more per token by router logit
    at the narrowest width the plan gives that token's predicted slots (a cheap speculative prefix: the
    recall of top-k + 1 is higher, see docs/profile-and-eval.md); an extra expert is an auxiliary, so
    none under ``AUX_NONE`` or a serving policy that skips a missing auxiliary. The runtime admits a
    request only within its budget (``CrispRuntime.prefetch``).

    window: None (default: every admitted request is copied in full, as a CPU run where copies take no
    time does), or a :class:`~crisp_runtime.scheduling.copy_window.PrefetchWindow`: the runtime then admits only the
    rows a modeled copy engine delivers before the next layer's demand (``crisp_runtime.scheduling.copy_window``,
    the simulator's rule), so that a CPU run serves the widths a GPU of that timing would.
    """

    extra_experts: int = 0
    width: PrefetchWidth = PrefetchWidth.PLAN
    window: PrefetchWindow | None = None

    def __post_init__(self) -> None:
        if isinstance(self.extra_experts, bool) or not isinstance(self.extra_experts, int) or self.extra_experts < 0:
            raise ValueError(f"PrefetchPolicy: extra_experts must be a non-negative int, got {self.extra_experts!r}")
        if not isinstance(self.width, PrefetchWidth):
            try:
                object.__setattr__(self, "width", PrefetchWidth(self.width))
            except ValueError:
                choices = ", ".join(m.value for m in PrefetchWidth)
                raise ValueError(f"PrefetchPolicy: width must be one of {choices}, got {self.width!r}") from None
        if self.window is not None and not isinstance(self.window, PrefetchWindow):
            raise ValueError(f"PrefetchPolicy: window must be a PrefetchWindow or None, got {self.window!r}")

    def to_dict(self) -> dict:
        out = {"rule": PREFETCH_RULE, "extra_experts": self.extra_experts,
               "width": self.width.value}
        if self.window is not None:  # absent without one: records written before windows stay comparable
            out["window"] = self.window.to_dict()
        return out


def slot_widths(policy: PrefetchPolicy, plan, serving: ServingPolicy, layer_id: int, index: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
    """(T, k) int64 width to prefetch for each predicted slot of layer ``layer_id`` (0 = none).

    index / weights: the next layer's predicted routing (T, k), as its router gives it; index values
    outside [0, E) get 0. The one rule of the runtime's :class:`Prefetcher` and the simulator.
    """
    if policy.width is PrefetchWidth.PLAN:
        return plan.token_widths(layer_id, index, weights)
    wanted, dominant = plan.token_widths_and_roles(layer_id, index, weights, roles=True)
    if policy.width is PrefetchWidth.AUX_NONE:
        return torch.where(dominant, wanted, torch.zeros_like(wanted))
    full = plan.intermediate_size
    flat = [ahead_width(serving, w, d, full) for w, d in zip(wanted.reshape(-1).tolist(),
                                                            dominant.reshape(-1).tolist(), strict=True)]
    return torch.tensor(flat, dtype=torch.int64).reshape(wanted.shape)


def topup_requests(policy: PrefetchPolicy, plan, serving: ServingPolicy, layer_id: int, index: torch.Tensor,
                   weights: torch.Tensor) -> list[tuple[int, int]]:
    """The second phase of a prefetch, issued after the first (:func:`slot_widths`) is admitted: each
    predicted dominant at the plan's width, widest first, when ``serving`` widens dominants ahead of
    demand (``DominantWiden.AHEAD``) and the prefetch asks the serving widths; else none.

    The first phase loads each predicted miss at what serving needs (a dominant at its floor); this one
    copies the rows a floor-resident dominant lacks, so the copy link widens dominants only with the
    time the misses leave (the simulator cuts it at the next layer's demand).
    """
    if serving.dominant_widen is not DominantWiden.AHEAD or policy.width is not PrefetchWidth.SERVING:
        return []
    wanted, dominant = plan.token_widths_and_roles(layer_id, index, weights, roles=True)
    widths = torch.where(dominant, wanted, torch.zeros_like(wanted))
    return widest_first(merge_requests(index.reshape(-1).tolist(), widths.reshape(-1).tolist()))


def merge_requests(experts: Iterable[int], widths: Iterable[int],
                   into: dict[int, int] | None = None) -> dict[int, int]:
    """{expert: widest width asked} over slots (an expert < 0 or a width 0 asks nothing), in first-asked order."""
    wanted: dict[int, int] = {} if into is None else into
    for e, w in zip(experts, widths, strict=True):
        if e >= 0 and w > 0 and w > wanted.get(e, 0):
            wanted[e] = w
    return wanted


def widest_first(wanted: dict[int, int]) -> list[tuple[int, int]]:
    """The request in issue order: widest first (ties in first-asked order)."""
    return sorted(wanted.items(), key=lambda item: -item[1])


class Prefetcher:
    """Issues one layer's prefetch for the next: ``prefetcher(layer_id, hidden_states)`` after layer
    ``layer_id``'s experts were enqueued (so on CUDA the copies queue behind its demanded ones)."""

    def __init__(self, predictor: NextLayerPredictor, runtime, policy: PrefetchPolicy) -> None:
        if not isinstance(policy, PrefetchPolicy):
            raise TypeError(f"policy: expected PrefetchPolicy, got {type(policy).__name__}")
        self.predictor = predictor
        self.runtime = runtime
        self.policy = policy

    def requests(self, layer_id: int, hidden_states: torch.Tensor) -> tuple[int, list[tuple[int, int]]] | None:
        """(next layer id, [(expert, width), ...]) to prefetch, or None after the last MoE layer."""
        phases = self.phases(layer_id, hidden_states)
        return None if phases is None else (phases[0], phases[1])

    def phases(self, layer_id: int, hidden_states: torch.Tensor
               ) -> tuple[int, list[tuple[int, int]], list[tuple[int, int]]] | None:
        """(next layer id, first phase, second phase) of this layer's prefetch, or None after the last
        MoE layer: the first as :meth:`requests`, the second :func:`topup_requests` (usually [])."""
        routed = self.predictor.predict_routing(layer_id, hidden_states)
        if routed is None:
            return None
        nxt, index, weights = routed
        plan, serving = self.runtime.plan, self.runtime.step_serving
        widths = slot_widths(self.policy, plan, serving, nxt, index, weights)
        wanted = merge_requests(index.reshape(-1).tolist(), widths.reshape(-1).tolist())
        if self.policy.extra_experts and _prefetches_extra(self.policy, serving):
            extra = self.predictor.predict(layer_id, hidden_states)[:, index.shape[1]:][:, : self.policy.extra_experts]
            plan_widths = plan.token_widths(nxt, index, weights)
            narrow = torch.where(plan_widths > 0, plan_widths, plan_widths.new_full((), plan.intermediate_size))
            narrow = narrow.min(dim=1).values
            for row, w in zip(extra.tolist(), narrow.tolist(), strict=True):
                merge_requests(row, [w] * len(row), into=wanted)
        return nxt, widest_first(wanted), topup_requests(self.policy, plan, serving, nxt, index, weights)

    def __call__(self, layer_id: int, hidden_states: torch.Tensor):
        phases = self.phases(layer_id, hidden_states)
        if phases is None:
            return []
        nxt, first, second = phases
        out = self.runtime.prefetch(nxt, first) if first else []
        if second:  # after the first phase: on a GPU queued behind its copies on the copy stream
            out += self.runtime.prefetch(nxt, second)
        return out


def _prefetches_extra(policy: PrefetchPolicy, serving: ServingPolicy) -> bool:
    """An extra (non-top-k) predicted expert would be an auxiliary: prefetched unless the policy
    prefetches dominants only, or serves by the serving policy and that skips a missing auxiliary."""
    if policy.width is PrefetchWidth.AUX_NONE:
        return False
    return policy.width is PrefetchWidth.PLAN or ahead_width(serving, 1, False, 1) > 0
