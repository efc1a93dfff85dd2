"""The host store: every packed expert in host memory, pinned when CUDA is present, allocated once.

Each layer's tensors are the ``PackedLayer`` tensors themselves, pinned once at set-up
(``PackedLayer.pin_memory`` copies into page-locked memory). Nothing is allocated afterwards:
a copy of rows ``k0..k1`` of expert ``e`` reads a contiguous slice of each tensor
(``qweight[e, k0:k1]`` etc.; the format is neuron-major).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch

from crisp_kernels import PackedExpert, PackedLayer


class HostStore:
    """Packed layers in host memory, ``layer_id -> PackedLayer``."""

    def __init__(self, layers: Mapping[int, PackedLayer], *, pin: bool | None = None) -> None:
        if not layers:
            raise ValueError("HostStore: expected at least one packed layer")
        if pin is None:
            pin = torch.cuda.is_available()
        self.pinned = bool(pin)
        self.layers: dict[int, PackedLayer] = {}
        for layer_id, layer in layers.items():
            if not isinstance(layer, PackedLayer):
                raise TypeError(f"HostStore: layer {layer_id} is {type(layer).__name__}, expected PackedLayer")
            if layer.qweight.device.type != "cpu":
                layer = _to_cpu(layer)
            if self.pinned and not layer.qweight.is_pinned():  # GPU-only: page-locked for async H2D copies
                layer = layer.pin_memory()
            self.layers[int(layer_id)] = layer

    def layer(self, layer_id: int) -> PackedLayer:
        return self.layers[layer_id]

    def expert(self, layer_id: int, expert: int) -> PackedExpert:
        return self.layers[layer_id].expert(expert)

    def neuron_nbytes(self, layer_id: int) -> int:
        return self.layers[layer_id].neuron_nbytes  # the format's bytes, + 8 for a gpt-oss (gate, up) bias pair

    def full_width(self, layer_id: int) -> int:
        return self.layers[layer_id].intermediate_size

    def rows(self, layer_id: int, expert: int, start: int, stop: int) -> tuple[torch.Tensor, ...]:
        """Host slices holding neurons ``start..stop`` of one expert (contiguous views)."""
        return self.layers[layer_id].expert_rows(expert, start, stop)  # qweight, scales[, zeros][, bias]

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers.values())


def _to_cpu(layer: PackedLayer) -> PackedLayer:
    return replace(layer.to("cpu"), neuron_order=layer.neuron_order.cpu())  # biases (gpt-oss) included
