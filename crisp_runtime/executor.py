"""Issuing a layer step: make each expert's prefix resident and run its kernels, in the scheduler's order.

CPU (and ``RuntimeConfig(async_copies=False)``): the synchronous path. For each expert in
order: copy what is missing, then run ``expert_mlp_accumulate_`` with the per-token widths.

CUDA (``async_copies=True``, the default there), GPU-only code marked below:

- one copy stream per runtime; each expert's missing rows are copied on it (new buffers are
  allocated while it is current, so they belong to its allocator pool) and an event is
  recorded after them;
- the compute stream (the caller's current stream) waits on that event just before that
  expert's kernels, and nothing else: copies run ahead back to back while earlier experts
  compute (the two-stage flow shop);
- buffers written on the copy stream and read on the compute stream get
  ``record_stream(compute)``, so the allocator never hands their memory out while a queued
  kernel may still read it;
- after an expert's kernels an event is recorded on the compute stream; evicting that prefix
  waits on it first, so that freed bytes are really free and the budget stays a hard limit.

A hit needs no wait: the step that copied (or widened) a prefix waited on its copy before its
first kernel, and every later kernel is behind that one on the same compute stream.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from crisp_kernels import Backend, PackedLayer, expert_mlp_accumulate_

from .device_cache import PrefixCache, ResidentExperts
from .eviction import make_policy
from .host_store import HostStore
from .plan import CrispPlan
from .scheduler import CostModel, StepPlan, plan_step
from .stats import LayerStats, RuntimeStats


@dataclass(frozen=True)
class RuntimeConfig:
    """Settings of one applied model (frozen; no global configuration anywhere).

    kernel_backend: None = the pure-torch kernels on CPU tensors (fast in tests, even when
    ``TRITON_INTERPRET=1``) and automatic selection (compiled Triton) on CUDA.
    eviction: "lru" (default), "frequency", "tier", or an EvictionPolicy class.
    async_copies: on CUDA, copy stream + events (False = the synchronous path, for checking).
    pin_memory: pin the host store (None = when CUDA is available).
    keep_original: ``apply`` keeps the original expert weights in host memory so ``restore``
    can bring them back (False frees them; restore then leaves the experts empty).
    record_timings: CUDA event timings per layer step (adds a synchronisation per step).
    device: where the experts run (None = the device of the model's other parameters).
    """

    kernel_backend: Backend | str | None = None
    eviction: object = "lru"
    async_copies: bool = True
    pin_memory: bool | None = None
    keep_original: bool = True
    record_timings: bool = False
    cost: CostModel = field(default_factory=CostModel)
    device: str | None = None


def min_budget_bytes(layers: Mapping[int, PackedLayer], top_k: int) -> int:
    """Smallest budget accepted: one token's experts at full width (``top_k`` full experts of the widest layer).

    A step that needs more at once (prefill touching many experts) is streamed: experts already
    computed in the step are evicted to make room for later ones.
    """
    return top_k * max(layer.intermediate_size * layer.fmt.neuron_nbytes(layer.hidden_size) for layer in
                       layers.values())


class CrispRuntime:
    """Packed experts, a plan, the device cache and the statistics of one applied model."""

    def __init__(
        self,
        layers: Mapping[int, PackedLayer],
        plan: CrispPlan,
        *,
        device,
        gpu_budget: int | None,
        config: RuntimeConfig = RuntimeConfig(),
    ) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # GPU-only: "cuda" == the tensors' "cuda:N"
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.config = config
        self.plan = plan
        self.layer_ids = tuple(sorted(int(i) for i in layers))
        if self.device.type == "cpu" and config.kernel_backend is None:
            self.backend = Backend.TORCH
        else:
            self.backend = None if config.kernel_backend is None else Backend(config.kernel_backend)
        if gpu_budget is None:
            self.cache = ResidentExperts(dict(layers), self.device)
            self.store = None
        else:
            pin = config.pin_memory if config.pin_memory is not None else (
                torch.cuda.is_available() and self.device.type == "cuda")
            self.store = HostStore(layers, pin=pin)
            self.cache = PrefixCache(self.store, int(gpu_budget), self.device, make_policy(config.eviction, plan))
        self.layers = dict(self.store.layers) if self.store is not None else dict(self.cache.layers)
        first = self.layers[self.layer_ids[0]]
        self.num_experts = first.num_experts
        self._nb = {i: layer.fmt.neuron_nbytes(layer.hidden_size) for i, layer in self.layers.items()}
        self.stats = RuntimeStats(self.layer_ids)
        self.last_step: dict[int, StepPlan] = {}
        self._copy_stream = None  # GPU-only, created on first use
        self._async = config.async_copies and self.device.type == "cuda"

    def set_plan(self, plan: CrispPlan) -> None:
        first = self.layers[self.layer_ids[0]]
        plan.check_compatible(num_experts=first.num_experts, top_k=self.plan.top_k,
                              intermediate_size=first.intermediate_size, layer_ids=self.layer_ids)
        self.plan = plan
        if isinstance(self.cache, PrefixCache):
            self.cache.policy.set_plan(plan)

    # ------------------------------------------------------------------ one layer step

    def plan_step(self, layer_id: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> StepPlan:
        """Widths from the plan, then grouping and order from the scheduler (all on the CPU)."""
        index = top_k_index.detach().to("cpu", torch.int64)
        weights = top_k_weights.detach().to("cpu", torch.float32)
        widths = self.plan.token_widths(layer_id, index, weights)
        cache = self.cache
        return plan_step(
            index, widths, num_experts=self.num_experts, neuron_nbytes=self._nb[layer_id],
            resident_width=lambda e: cache.resident_width(layer_id, e), cost=self.config.cost,
        )

    def forward(self, layer_id: int, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """The routed experts' output for ``hidden_states`` (T, H), in its dtype."""
        if layer_id not in self.layers:
            raise KeyError(f"CRISP runtime has no layer {layer_id}; it holds {list(self.layer_ids)}")
        if hidden_states.device != self.device:
            raise RuntimeError(f"layer {layer_id}: activations are on {hidden_states.device}, CRISP experts on "
                               f"{self.device}")
        step = self.plan_step(layer_id, top_k_index, top_k_weights)
        self.last_step[layer_id] = step
        stats = self.stats.layers[layer_id]
        stats.tokens += step.num_tokens
        stats.steps += 1
        stats.bytes_read += step.bytes_read
        stats.bytes_routed += step.bytes_routed
        stats.skipped += step.skipped
        x = hidden_states if hidden_states.stride(-1) == 1 else hidden_states.contiguous()
        out = torch.zeros(x.shape, dtype=torch.float32, device=self.device)
        if step.tasks:
            timer = _StepTimer(self.device) if self.config.record_timings and self.device.type == "cuda" else None
            self._run(layer_id, step, x, top_k_weights, out, stats)
            if timer is not None:
                stats.step_ms += timer.stop()
        return out.to(hidden_states.dtype)

    def _run(self, layer_id: int, step: StepPlan, x, top_k_weights, out, stats: LayerStats) -> None:
        device = self.device
        flat = torch.stack((step.flat_pos, step.flat_widths))
        flat = flat.to(device, non_blocking=False) if device.type != "cpu" else flat
        flat_pos, flat_widths = flat[0], flat[1]
        rows = torch.div(flat_pos, step.top_k, rounding_mode="floor")
        weights = top_k_weights.detach().reshape(-1)[flat_pos].to(torch.float32)
        tasks = step.tasks
        pending = {(layer_id, t.expert) for t in tasks}
        compute_stream = copy_stream = None
        if self._async:  # GPU-only
            compute_stream = torch.cuda.current_stream(device)
            copy_stream = self._get_copy_stream()
        for task in tasks:
            key = (layer_id, task.expert)
            if copy_stream is None:
                got = self.cache.acquire(layer_id, task.expert, task.width, protected=pending)
            else:  # GPU-only: copy on the copy stream, the compute stream waits on this expert's event only
                with torch.cuda.stream(copy_stream):
                    got = self.cache.acquire(layer_id, task.expert, task.width, protected=pending)
                    if got.copied_bytes:
                        copied = torch.cuda.Event()
                        copied.record(copy_stream)
                if got.copied_bytes:
                    compute_stream.wait_event(copied)
                    for t in got.resident.tensors():
                        t.record_stream(compute_stream)
            pending.discard(key)
            stats.bytes_h2d += got.copied_bytes
            stats.evictions += got.evictions
            if got.kind == "hit":
                stats.hits += 1
            elif got.kind == "miss":
                stats.misses += 1
            else:
                stats.widenings += 1
            stats.expert_runs += 1
            s = slice(task.start, task.stop)
            expert_mlp_accumulate_(
                out, x, got.resident, task.width, rows=rows[s], weights=weights[s], token_widths=flat_widths[s],
                backend=self.backend,
            )
            if copy_stream is not None and isinstance(self.cache, PrefixCache):  # GPU-only
                used = torch.cuda.Event()
                used.record(compute_stream)
                self.cache.mark_used(layer_id, task.expert, used)

    def _get_copy_stream(self):  # GPU-only
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        return self._copy_stream


class _StepTimer:  # GPU-only
    def __init__(self, device) -> None:
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)
        self.start.record(torch.cuda.current_stream(device))
        self.device = device

    def stop(self) -> float:
        self.end.record(torch.cuda.current_stream(self.device))
        self.end.synchronize()
        return self.start.elapsed_time(self.end)
