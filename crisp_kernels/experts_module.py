"""``CrispExperts``: a standalone drop-in for the experts module of a transformers (v5) MoE layer.

It takes what those modules take, ``forward(hidden_states (T, H), top_k_index (T, k),
top_k_weights (T, k)) -> (T, H)``, and holds the layer's experts in the packed 4-bit format
instead of ``gate_up_proj`` / ``down_proj``, each expert run over its first ``widths[e]``
neurons. Experts that no token is routed to are not run; an index outside ``[0, E)`` (e.g. the
``E`` some routers use for a dropped slot) and a width of 0 contribute nothing. Experts add
into one fp32 buffer (``expert_mlp_accumulate_``, routing weight applied in the kernel); the
result is returned in ``hidden_states``' dtype.

Everything is on the module's device: this is the all-resident case (no offloading); the
CRISP runtime's scheduler handles experts that live in host memory.

Inference only: the kernels have no backward. With grad mode on and an input that requires
grad, the forward still runs, and ``backward()`` through its output raises (see
:func:`without_backward`) instead of silently giving the routing weights no gradient (the
Triton kernels are invisible to autograd; only the CPU reference kernels would be traced).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from .expert_mlp import Backend, expert_mlp_accumulate_
from .format import PackedExpert, PackedLayer, QuantFormat, _check_prefix_width, pack_layer

TokenWidthFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


ROUTER_GETS_NO_GRADIENT = ("the 4-bit kernels have no backward, so the routing weights (the router) would get no "
                           "gradient")


class _RefuseBackward(torch.autograd.Function):
    """``fn(*inputs)`` computed without autograd, with a backward that raises naming ``what``."""

    @staticmethod
    def forward(ctx, what, why, hint, fn, *inputs):
        ctx.what, ctx.why, ctx.hint = what, why, hint
        return fn(*inputs)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(f"{ctx.what} do not support gradients: {ctx.why}. {ctx.hint}")


def without_backward(what: str, fn: Callable[..., torch.Tensor], *inputs,
                     hint: str = "Run inference under torch.no_grad() or torch.inference_mode()",
                     why: str = ROUTER_GETS_NO_GRADIENT) -> torch.Tensor:
    """``fn(*inputs)``; when grad mode is on and an input requires grad, its result has a backward that
    raises a RuntimeError naming ``what`` and ``why`` (the forward runs unchanged: inference without ``no_grad``
    works)."""
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs):
        return _RefuseBackward.apply(what, why, hint, fn, *inputs)
    return fn(*inputs)


class CrispExperts(nn.Module):
    """The experts of one MoE layer, packed, each at its own width.

    layer: the packed experts (its tensors become buffers, so ``.to(device)`` moves them; a
        dtype cast such as ``.to(torch.bfloat16)`` leaves the packed format untouched).
    widths: (E,) neurons used per expert (list or int tensor); None = all. With a 2-bit tail
        (``layer.tail_start``) widths count storage rows (``crisp_kernels.format``: two neurons per tail row).
    token_width_fn: optional ``fn(top_k_index, top_k_weights) -> (T, k)`` int widths per routed
        slot (e.g. a CRISP plan narrowing the auxiliary expert of a combination); a slot uses
        ``min(widths[e], width)`` neurons. ``forward(..., token_widths=)`` overrides it per call.
    backend: passed to the kernels (None: chosen from the device).
    """

    def __init__(
        self,
        layer: PackedLayer,
        widths: Sequence[int] | torch.Tensor | None = None,
        *,
        token_width_fn: TokenWidthFn | None = None,
        backend: Backend | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(layer, PackedLayer):
            raise TypeError(f"layer: expected a PackedLayer, got {type(layer).__name__}")
        self.fmt: QuantFormat = layer.fmt
        self.num_experts = layer.num_experts
        self.intermediate_dim = layer.intermediate_size
        self.hidden_dim = layer.hidden_size
        self.register_buffer("qweight", layer.qweight)
        self.register_buffer("scales", layer.scales)
        self.register_buffer("zeros", layer.zeros)
        self.register_buffer("neuron_order", layer.neuron_order)
        self.register_buffer("bias", layer.bias)  # (E, I, 2) float32 or None (gpt-oss only)
        self.register_buffer("down_bias", layer.down_bias)  # (E, H) float32 or None
        self.activation = layer.activation
        self.tail_start = layer.tail_start  # storage row where 2-bit neuron pairs begin, or None
        self.widths = widths
        self.token_width_fn = token_width_fn
        self.backend = backend

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_dense(
        cls,
        gate_up_proj: torch.Tensor,
        down_proj: torch.Tensor,
        fmt: QuantFormat | None = None,
        widths: Sequence[int] | torch.Tensor | None = None,
        *,
        neuron_order: torch.Tensor | None = None,
        token_width_fn: TokenWidthFn | None = None,
        backend: Backend | None = None,
    ) -> CrispExperts:
        """Quantize transformers-layout weights (``gate_up_proj`` (E, 2I, H), gate half first;
        ``down_proj`` (E, H, I)) and wrap them. Pack on the CPU and ``.to()`` the module
        afterwards: the dense weights never need to be on the GPU. ``fmt`` None: the default
        :class:`QuantFormat` (g64, asymmetric)."""
        layer = pack_layer(gate_up_proj, down_proj, fmt or QuantFormat(), neuron_order=neuron_order)
        return cls(layer, widths, token_width_fn=token_width_fn, backend=backend)

    @property
    def widths(self) -> tuple[int, ...]:
        return self._widths

    @widths.setter
    def widths(self, widths: Sequence[int] | torch.Tensor | None) -> None:
        """Set the width of every expert; kept as Python ints so forward never syncs to read them."""
        if widths is None:
            widths = [self.intermediate_dim] * self.num_experts
        if isinstance(widths, torch.Tensor):
            if widths.dim() != 1 or widths.is_floating_point() or widths.is_complex():
                raise ValueError(f"widths: expected a 1-D integer tensor, got {widths.dtype} {tuple(widths.shape)}")
            widths = widths.tolist()
        widths = list(widths)
        if len(widths) != self.num_experts:
            raise ValueError(f"widths: expected {self.num_experts} values (one per expert), got {len(widths)}")
        for e, w in enumerate(widths):
            _check_prefix_width(w, self.intermediate_dim, f"widths[{e}]")
        self._widths = tuple(widths)

    @property
    def layer(self) -> PackedLayer:
        """The packed experts (views of the buffers), e.g. to save them."""
        return PackedLayer(self.fmt, self.qweight, self.scales, self.zeros, self.neuron_order, self.bias,
                           self.down_bias, self.activation, self.tail_start)

    def expert(self, index: int) -> PackedExpert:
        """Zero-copy view of expert ``index`` at full width."""
        def row(t):
            return None if t is None else t[index]

        return PackedExpert(self.fmt, self.qweight[index], self.scales[index], row(self.zeros), row(self.bias),
                            row(self.down_bias), self.activation, self.tail_start)

    def _apply(self, fn, recurse=True):
        # Module.to(dtype) / .half() cast floating-point buffers; the fp16 scales are part of the
        # packed format, so they go through as an int16 view of the same bits (device moves apply);
        # likewise the fp32 biases (gpt-oss), as int32 views.
        views = {"scales": (torch.int16, torch.float16), "bias": (torch.int32, torch.float32),
                 "down_bias": (torch.int32, torch.float32)}
        views = {name: v for name, v in views.items() if self._buffers.get(name) is not None}
        for name, (as_int, _) in views.items():
            self._buffers[name] = self._buffers[name].view(as_int)
        try:
            return super()._apply(fn, recurse)
        finally:
            for name, (_, as_float) in views.items():
                self._buffers[name] = self._buffers[name].view(as_float)

    def extra_repr(self) -> str:
        fmt = f"g{self.fmt.group_size} {'sym' if self.fmt.symmetric else 'asym'}"
        if self.tail_start is not None:
            fmt += f", 2-bit tail from row {self.tail_start}"
        return (
            f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, intermediate_dim={self.intermediate_dim}, "
            f"format=4-bit {fmt}, widths={list(self.widths)}"
        )

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        token_widths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(T, H) -> (T, H) in ``hidden_states``' dtype.

        token_widths: optional (T, k) int widths per routed slot (see the class docstring).
        Inference only: ``backward()`` through the result raises (see the module docstring).
        """
        return without_backward(f"{type(self).__name__} experts", self._forward, hidden_states, top_k_index,
                                top_k_weights, token_widths)

    def _forward(self, hidden_states, top_k_index, top_k_weights, token_widths) -> torch.Tensor:
        self._check_routing(hidden_states, top_k_index, top_k_weights)
        num_tokens, top_k = top_k_index.shape
        if token_widths is None and self.token_width_fn is not None:
            token_widths = self.token_width_fn(top_k_index, top_k_weights)
        if token_widths is not None and (
            not isinstance(token_widths, torch.Tensor)
            or tuple(token_widths.shape) != (num_tokens, top_k)
            or token_widths.is_floating_point()
        ):
            got = f"{token_widths.dtype} {tuple(token_widths.shape)}" if isinstance(token_widths, torch.Tensor) else (
                type(token_widths).__name__)  # fmt: skip
            raise ValueError(f"token_widths: expected an integer tensor of shape ({num_tokens}, {top_k}), got {got}")

        out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
        # Group the routed slots by expert: slots of invalid indices go to bucket E (ignored).
        flat = top_k_index.reshape(-1).long()
        flat = torch.where((flat >= 0) & (flat < self.num_experts), flat, self.num_experts)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts + 1).tolist()  # the one device->host sync
        rows_sorted = order // top_k
        weights_sorted = top_k_weights.reshape(-1)[order].float()
        widths_sorted = None if token_widths is None else token_widths.reshape(-1)[order]
        start = 0
        for e in range(self.num_experts):
            count, width = counts[e], self._widths[e]
            if count and width:
                end = start + count
                expert_mlp_accumulate_(
                    out,
                    hidden_states,
                    self.expert(e),
                    width,
                    rows=rows_sorted[start:end],
                    weights=weights_sorted[start:end],
                    token_widths=None if widths_sorted is None else widths_sorted[start:end],
                    backend=self.backend,
                )
            start += count
        return out.to(hidden_states.dtype)

    def _check_routing(self, hidden_states, top_k_index, top_k_weights) -> None:
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 2 or (
            hidden_states.shape[1] != self.hidden_dim
        ):
            shape = tuple(hidden_states.shape) if isinstance(hidden_states, torch.Tensor) else type(hidden_states)
            raise ValueError(f"hidden_states: expected (T, H={self.hidden_dim}), got {shape}")
        if top_k_index.dim() != 2 or top_k_index.shape[0] != hidden_states.shape[0]:
            raise ValueError(
                f"top_k_index: expected (T={hidden_states.shape[0]}, k), got {tuple(top_k_index.shape)}"
            )
        if top_k_index.is_floating_point() or top_k_index.is_complex():
            raise ValueError(f"top_k_index: expected an integer tensor, got {top_k_index.dtype}")
        if tuple(top_k_weights.shape) != tuple(top_k_index.shape):
            raise ValueError(
                f"top_k_weights: expected shape {tuple(top_k_index.shape)} like top_k_index, "
                f"got {tuple(top_k_weights.shape)}"
            )
