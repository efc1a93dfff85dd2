"""The all-resident layer step computed on the device, without a host sync: what ``torch.compile`` traces.

With ``gpu_budget=None`` (:class:`~crisp_runtime.residency.device_cache.ResidentExperts`) nothing is ever
copied, so nothing has to be decided on the host: the eager executor still reads the routing on
the host (widths, task order, statistics), which under ``torch.compile`` is a graph break at every
``.tolist()`` / ``.item()`` (32 breaks for the 4-layer tiny Mixtral). :class:`ResidentStep` is the
same layer step as :meth:`CrispRuntime.forward <crisp_runtime.execution.runtime.CrispRuntime.forward>` with
every decision made by tensor ops on the device:

- each slot's width is the plan's (:meth:`CrispPlan.device_token_widths`, the vectorized rules of
  ``token_widths``), or the full width for a routed slot when the serving policy serves hits at the
  resident width (everything is resident at full width);
- every expert of the layer runs over *all* T tokens (fixed shapes, no grouping by expert, whose
  group sizes are data-dependent), a token not routed to it at width 0 and routing weight 0: it
  adds exact zeros (the kernels mask neurons ``j >= width[t]``).

So ``torch.compile(model, fullgraph=True)`` traces a whole patched model whose experts are all
resident; the kernels are the ``torch.ops.crisp`` custom ops (fake implementations, opaque to
dynamo). The price of fixed shapes: each expert reads all its rows every step, E / k times the
weight bytes of the eager path (4x for the tiny Mixtral's 8 experts top-2, ~10x for DeepSeek-MoE's
64 top-6) and as many times the compute. Outputs equal the eager path's up to float32 summation
order (experts added in index order, not the scheduler's). Only the compiled path runs this: the
eager forward keeps the host-planned step (fewer bytes, and its statistics).

Statistics: a compiled step counts nothing (``handle.stats()`` covers eager forwards only). Hits,
bytes and served widths need the routing on the host; and even a step counter is not kept: a
Python int changed inside the traced code becomes a guard on its value, so every call would
recompile (measured: 4 calls, 4 graphs; 1 without the counter).
"""

from __future__ import annotations

import torch

import crisp_kernels  # noqa: F401  (registers torch.ops.crisp)
from crisp_kernels import Backend, PackedExpert
from crisp_runtime.planning.serving import HitWidth
from crisp_runtime.residency.device_cache import ResidentExperts


def _op_args(packed: PackedExpert) -> tuple:
    """The packed expert as the custom op's trailing arguments (tensors and constants)."""
    act = packed.activation
    return (packed.bias, packed.down_bias, act.kind.value, float(act.alpha or 0.0), float(act.limit or 0.0))


class ResidentStep:
    """``step(layer_id, hidden_states, top_k_index, top_k_weights)`` -> (T, H): the runtime's layer step,
    all on the device (module docstring). Built once per applied model with every expert resident."""

    def __init__(self, runtime) -> None:
        if not isinstance(runtime.cache, ResidentExperts):
            raise ValueError("ResidentStep needs every expert resident (gpu_budget=None); with a budget the "
                             "routing decides copies on the host")
        self.runtime = runtime
        self.backend = None if runtime.backend is None else Backend(runtime.backend).value
        full = runtime.plan.intermediate_size
        self.experts = {i: tuple(runtime.cache.acquire(i, e, full).resident for e in range(runtime.num_experts))
                        for i in runtime.layer_ids}
        k = runtime.plan.top_k
        for i in runtime.layer_ids:  # builds the plan's lookup tables on the device once, here, not while tracing
            self.served_widths(i, torch.arange(k, device=runtime.device).unsqueeze(0),
                               torch.ones(1, k, device=runtime.device))

    def served_widths(self, layer_id: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """(T, k) int64 on the device: the width each slot is served at when every expert is resident."""
        runtime = self.runtime
        widths = runtime.plan.device_token_widths(layer_id, top_k_index, top_k_weights)
        if runtime.serving.hit_width is HitWidth.RESIDENT:  # a routed slot gets what is resident: everything
            widths = torch.where(widths > 0, runtime.plan.intermediate_size, 0)
        return widths

    def __call__(self, layer_id: int, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        runtime = self.runtime
        runtime._check_step(layer_id, hidden_states, top_k_index, top_k_weights)
        widths = self.served_widths(layer_id, top_k_index, top_k_weights)
        weights = top_k_weights.to(torch.float32)
        x = hidden_states.contiguous()
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        rows = torch.arange(x.shape[0], device=x.device)
        full = runtime.plan.intermediate_size
        for e, packed in enumerate(self.experts[layer_id]):
            routed = top_k_index == e  # (T, k); a router never repeats an expert within a token
            token_widths = torch.where(routed, widths, 0).amax(dim=1)
            token_weights = torch.where(routed, weights, 0.0).sum(dim=1)
            torch.ops.crisp.expert_mlp_accumulate_(
                out, x, packed.qweight, packed.scales, packed.zeros, packed.fmt.group_size, full, rows,
                token_weights, token_widths, *_op_args(packed), backend=self.backend)
        return out.to(hidden_states.dtype)
