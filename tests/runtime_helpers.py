"""Helpers shared by the runtime tests (not a test module)."""

from __future__ import annotations

import torch

from crisp_kernels import QuantFormat, pack_layer


def random_layers(layer_ids=(0, 1), num_experts=6, inter=16, hidden=64, seed=0, symmetric=False):
    g = torch.Generator().manual_seed(seed)
    fmt = QuantFormat(group_size=64 if hidden % 64 == 0 else 32, symmetric=symmetric)
    out = {}
    for i in layer_ids:
        gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.1
        down = torch.randn(num_experts, hidden, inter, generator=g) * 0.1
        order = torch.stack([torch.randperm(inter, generator=g) for _ in range(num_experts)])
        out[i] = pack_layer(gate_up, down, fmt, order)
    return out


class ReplayCache:
    """Brute-force replay of the prefix cache under LRU: resident widths, bytes copied, evictions.

    Deliberately naive (lists, full scans) and independent of crisp_runtime's code.
    """

    def __init__(self, budget, neuron_nbytes):
        self.budget = budget
        self.nb = neuron_nbytes  # layer -> bytes per neuron
        self.resident = {}
        self.recency = []  # least recent first
        self.copied = 0
        self.evictions = 0
        self.kinds = []

    def used(self):
        return sum(w * self.nb[k[0]] for k, w in self.resident.items())

    def _touch(self, key):
        if key in self.recency:
            self.recency.remove(key)
        self.recency.append(key)

    def request(self, key, width, pending):
        have = self.resident.get(key, 0)
        if have >= width:
            self.kinds.append("hit")
            self._touch(key)
            return
        extra = (width - have) * self.nb[key[0]]
        while self.used() + extra > self.budget:
            candidates = [k for k in self.recency if k not in pending and k != key]
            if not candidates:
                candidates = [k for k in self.recency if k != key]
            victim = candidates[0]
            del self.resident[victim]
            self.recency.remove(victim)
            self.evictions += 1
        self.resident[key] = width
        self.copied += extra
        self.kinds.append("miss" if have == 0 else "widen")
        self._touch(key)


def decode_trace(runtime, trace, hidden_size: int, after_step=None, token: list[int] | None = None, seed: int = 0):
    """A routing trace fed to ``runtime.forward`` as a batch-1 decode: token by token, layer by layer, with
    seeded random hidden states (the decisions depend on the routing only). ``token[0]`` is set to the
    current token first (for a trace-driven predictor); ``after_step(layer, hidden)`` runs after each step
    (e.g. a Prefetcher)."""
    g = torch.Generator().manual_seed(seed)
    for t in range(trace.num_tokens):
        if token is not None:
            token[0] = t
        for layer in range(trace.index.shape[0]):
            index = torch.from_numpy(trace.index[layer, t:t + 1]).to(torch.int64)
            hidden = torch.randn(1, hidden_size, generator=g)
            runtime.forward(layer, hidden, index, torch.from_numpy(trace.weights[layer, t:t + 1]))
            if after_step is not None:
                after_step(layer, hidden)


class TracePredictor:
    """The next layer's routing as a trace's predicted routing records it, with the simulator's stand-in weights
    (decreasing over the top-k): what ``Prefetcher.requests`` asks of a ``NextLayerPredictor``. ``token`` is a
    one-element list the caller advances (the token being decoded)."""

    def __init__(self, predicted, token: list[int], num_layers: int) -> None:
        self.predicted, self.token, self.num_layers = predicted, token, num_layers

    def predict_routing(self, layer_id, hidden_states):
        if layer_id + 1 >= self.num_layers:
            return None
        index = torch.from_numpy(self.predicted[layer_id, self.token[0]:self.token[0] + 1]).to(torch.int64)
        k = index.shape[1]
        weights = torch.arange(k, 0, -1, dtype=torch.float32)
        return layer_id + 1, index, (weights / weights.sum()).expand(1, k).contiguous()

