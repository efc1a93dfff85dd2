"""Issuing a layer step: make each expert's prefix resident and run its kernels, in the scheduler's order.

Per layer step: the plan's wanted widths and roles, the serving policy's served widths and the
scheduler's order come from one pure function (``serving.plan_served_step``, also what the
simulator runs); the executor then moves tensors and launches kernels. Inputs are checked once
per step here (activations, routing shapes); the kernels are called through their unchecked
entry with a backend resolved once and expert views cached by the prefix cache.

CPU (and ``RuntimeConfig(async_copies=False)``): the synchronous path. For each expert in
order: copy what is missing, then run the expert's kernel with the per-token served widths.

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

Hybrid placement (``ServingPolicy.placement`` other than GPU): the scheduler marks
some tasks ``on_cpu``. Before the GPU's tasks are issued, those go as one job to the runtime's
CPU worker thread (``cpu_experts.CpuExperts``): it reads each expert's prefix from host memory
(nothing copied to the device, nothing admitted to the ledger; the int4pack copy of the fast path,
or the host store's rows: ``RuntimeConfig.cpu_experts``) and accumulates into a (T, H) float32
partial output on the CPU; after the GPU's tasks are issued the executor waits for the job and
adds the partial to the accumulator (one small host-to-device copy on CUDA). On a CPU-only
machine the same path runs, the "GPU" tasks on the CPU too.

A hit needs no wait: the step that copied (or widened) a prefix waited on its copy before its
first kernel, and every later kernel is behind that one on the same compute stream. The one
exception is a prefetched prefix (:meth:`CrispRuntime.prefetch`): its copy was issued on the
copy stream with an event, and the first step that uses it waits on that event.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from crisp_kernels import Backend, PackedLayer
from crisp_kernels.expert_mlp import (
    expert_mlp_accumulate_unchecked_,
    experts_mlp_accumulate_unchecked_,
    resolve_backend,
)
from crisp_kernels.format import rows_for_neurons
from crisp_runtime.cpu.dense import DenseWeights
from crisp_runtime.cpu.experts import CpuExperts, CpuExpertsConfig
from crisp_runtime.execution.stats import LayerStats, RuntimeStats
from crisp_runtime.planning.plan import CrispPlan
from crisp_runtime.planning.serving import ServedSlots, ServingPolicy, floor_in_rows, make_serving, plan_served_step
from crisp_runtime.residency.device_cache import PrefixCache, ResidentExperts
from crisp_runtime.residency.eviction import POLICIES as EVICTION_POLICIES
from crisp_runtime.residency.eviction import EvictionPolicy, make_policy
from crisp_runtime.residency.host_store import HostStore
from crisp_runtime.residency.ledger import HIT, MISS, TRANSIENT, Decision, transient_buffer_bytes, transient_rows
from crisp_runtime.scheduling.copy_window import CopyClock, admit_requests, hybrid_jobs
from crisp_runtime.scheduling.prefetch import PrefetchPolicy
from crisp_runtime.scheduling.scheduler import CostModel, StepPlan, TaskOrder

_ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Non-float32 steps of at most this many tokens keep their float32 accumulator across steps (_accumulator).
_KEEP_ACCUMULATOR_ROWS = 64


@dataclass(frozen=True)
class RuntimeConfig:
    """Settings of one applied model, passed as ``apply(..., config=RuntimeConfig(...))`` (frozen; there is no
    global configuration). Every field has a default that serves the plan as profiled.

    eviction: which cached expert prefix to drop when the budget is full: "lru" (default), "frequency",
    "tier" (the plan's Hot and Warm experts kept longest), "next_use" (the prefix predicted to be needed
    furthest ahead), or an EvictionPolicy class or instance (``eviction.PinnedPolicy`` keeps a hot set).
    kernel_backend: None = the pure-torch kernels on CPU tensors (fast in tests, even when
    ``TRITON_INTERPRET=1``) and automatic selection (compiled Triton) on CUDA.
    serving: how routed slots are served from what is resident (``crisp_runtime.planning.serving``): a
    ServingPolicy, a name ("plan" = default, every slot at the plan's width; "resident";
    "resident-floor75") or its dict form.
    order: the order of a step's experts (Johnson's rule by default; ROUTER for benchmarks).
    prefetch: None, or a ``crisp_runtime.scheduling.prefetch.PrefetchPolicy``: ``apply`` then has each MoE layer
    prefetch the next layer's predicted experts (the next router on this layer's MoE input).
    async_copies: on CUDA, copy stream + events (False = the synchronous path, for checking).
    pin_memory: pin the host store (None = when CUDA is available).
    keep_original: ``apply`` keeps the original expert weights in host memory so ``restore``
    can bring them back (False frees them; restore then leaves the experts empty).
    record_timings: CUDA event timings per layer step (adds a synchronisation per step); on the
    synchronous path (CPU, or ``async_copies=False``) also each expert's load and compute time,
    the device synchronised after each (``CrispRuntime.last_timings``, ``stats.copy_ms``).
    device: where the experts run (None = the device of the model's other parameters).
    cpu_experts: how the CPU computes the experts a CPU placement gives it (precision q8 / bf16 / fp32,
    when the int4pack copy is built, the worker's threads: ``crisp_runtime.cpu.experts``).
    dense: what ``apply`` does with the model's dense layers (attention's projections, shared experts and dense MLP
    layers, the lm head; not the router): ``"auto"`` (default: where their weights are on the CPU and the native
    kernel builds, ``"q8"`` when every expert runs on the CPU's 8-bit kernel, as ``cpu_only`` at the default
    precision does, else ``"bf16"``; ``"keep"`` where it cannot), ``"keep"``, ``"q4"`` (4-bit rows with 8-bit
    activations on the CPU; the lm head in 8-bit blocks), ``"q8"`` (llama.cpp's Q8_0: 8-bit blocks of 32, 8-bit
    activations, ~0.5% rounding, half of bf16's bytes) or ``"bf16"`` (the layers whose weights are bf16 values kept in
    bf16, fp32 arithmetic: the same results up to summation order): ``crisp_runtime.cpu.dense``; restore puts them back
    (with ``keep_original=False`` a bf16 layer's fp32 original is freed while applied and refilled exactly).
    """

    kernel_backend: Backend | str | None = None
    eviction: object = "lru"
    async_copies: bool = True
    pin_memory: bool | None = None
    keep_original: bool = True
    record_timings: bool = False
    cost: CostModel = field(default_factory=CostModel)
    device: str | None = None
    serving: ServingPolicy | str | Mapping = field(default_factory=ServingPolicy)
    order: TaskOrder | str = TaskOrder.JOHNSON
    prefetch: PrefetchPolicy | None = None
    cpu_experts: CpuExpertsConfig = field(default_factory=CpuExpertsConfig)
    dense: DenseWeights | str = DenseWeights.AUTO

    def __post_init__(self) -> None:
        for name in ("async_copies", "keep_original", "record_timings", "pin_memory"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (name == "pin_memory" and value is None):
                choices = "True, False or None" if name == "pin_memory" else "True or False"
                raise TypeError(f"RuntimeConfig.{name}: expected {choices}, got {type(value).__name__} {value!r}")
        if self.kernel_backend is not None:
            try:
                Backend(self.kernel_backend)
            except ValueError:
                raise ValueError(f"RuntimeConfig.kernel_backend: expected None (automatic) or one of "
                                 f"{[b.value for b in Backend]}, got {self.kernel_backend!r}") from None
        eviction = self.eviction
        if not (isinstance(eviction, str) and eviction in EVICTION_POLICIES or isinstance(eviction, EvictionPolicy)
                or isinstance(eviction, type) and issubclass(eviction, EvictionPolicy)):
            raise ValueError(f"RuntimeConfig.eviction: expected one of {list(EVICTION_POLICIES)}, an EvictionPolicy "
                             f"class or instance, got {eviction!r}")
        try:
            object.__setattr__(self, "dense", DenseWeights(self.dense))
        except ValueError:
            raise ValueError(f"RuntimeConfig.dense: expected one of {[d.value for d in DenseWeights]}, "
                             f"got {self.dense!r}") from None
        if not isinstance(self.cpu_experts, CpuExpertsConfig):
            raise TypeError(f"RuntimeConfig.cpu_experts: expected a CpuExpertsConfig, got "
                            f"{type(self.cpu_experts).__name__}")
        object.__setattr__(self, "serving", make_serving(self.serving))
        if self.prefetch is not None and not isinstance(self.prefetch, PrefetchPolicy):
            raise TypeError(f"RuntimeConfig.prefetch: expected PrefetchPolicy or None, got "
                            f"{type(self.prefetch).__name__}")
        try:
            object.__setattr__(self, "order", TaskOrder(self.order))
        except ValueError:
            raise ValueError(f"RuntimeConfig.order: expected one of {[o.value for o in TaskOrder]}, "
                             f"got {self.order!r}") from None


def min_budget_bytes(layers: Mapping[int, PackedLayer], top_k: int) -> int:
    """Smallest budget accepted: one token's experts at full width (``top_k`` full experts of the widest layer).

    A step that needs more at once (prefill touching many experts) is streamed: experts already
    computed in the step are evicted to make room for later ones.
    """
    return top_k * max(layer.intermediate_size * layer.neuron_nbytes for layer in layers.values())


def plan_for_layers(plan: CrispPlan, layers: Mapping[int, PackedLayer]) -> CrispPlan:
    """``plan`` in the layers' unit of width. A pack with a 2-bit tail counts widths in storage rows; a plan
    written in neurons for it (``intermediate_size`` = the model's I, as a profiler writes it) is converted
    (``CrispPlan.in_storage_rows``). Any other plan is returned as given (``check_compatible`` then judges it)."""
    first = next(iter(layers.values()))
    if first.tail_start is not None and plan.intermediate_size == first.num_neurons != first.intermediate_size:
        return plan.in_storage_rows(first.tail_start)
    return plan


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
        plan = plan_for_layers(plan, layers)
        self.config = config
        self.serving = config.serving
        self.plan = plan
        self.layer_ids = tuple(sorted(int(i) for i in layers))
        if self.device.type == "cpu" and config.kernel_backend is None:
            self.backend = Backend.TORCH
        else:
            self.backend = resolve_backend(config.kernel_backend, self.device)
        self._transient_room: dict[int, int] = {}  # the neuron split's transient buffer, per layer (none by default)
        if gpu_budget is None:
            self.cache = ResidentExperts(dict(layers), self.device)
            self.store = None
        else:
            pin = config.pin_memory if config.pin_memory is not None else (
                torch.cuda.is_available() and self.device.type == "cuda")
            self.store = HostStore(layers, pin=pin)
            self.cache = PrefixCache(self.store, int(gpu_budget) - self._transient_buffer(int(gpu_budget)),
                                     self.device, make_policy(config.eviction, plan))
        self.layers = dict(self.store.layers) if self.store is not None else dict(self.cache.layers)
        first = self.layers[self.layer_ids[0]]
        # the policy as applied to the plan's unit (a tail pack's storage rows): its floor restated in rows
        # (serving.floor_in_rows); ``serving`` stays the policy as configured (what stats() and records name)
        self.step_serving = floor_in_rows(self.serving, first.num_neurons, first.intermediate_size,
                                          lambda n: rows_for_neurons(n, first.tail_start))
        self.num_experts = first.num_experts
        self._nb = {i: layer.neuron_nbytes for i, layer in self.layers.items()}  # + 8 B per gpt-oss bias pair
        self._hidden = {i: layer.hidden_size for i, layer in self.layers.items()}
        self.stats = RuntimeStats(self.layer_ids)
        self.last_step: dict[int, StepPlan] = {}
        self.last_served: dict[int, ServedSlots] = {}  # per layer: the widths its last step served, per slot
        # per layer, with record_timings on the synchronous path: (load s, compute s) of each task of the last step
        self.last_timings: dict[int, list[tuple[float, float]]] = {}
        # The last planned step, (layer_id, tasks): a prefetch never evicts its keys (built when one asks).
        self._last_tasks: tuple[int, tuple] = (-1, ())
        self._zero_row = torch.zeros(1, dtype=torch.int64, device=self.device)  # a decode step's one token row
        # Buffers kept across steps (forward's hot path): the accumulator of non-float32 decode steps and the
        # decode steps' routing weights, per stream on CUDA (see _accumulator and _decode_weights).
        self._accumulators: dict = {}
        self._weight_buffers: dict = {}
        self._cuda = self.device.type == "cuda"  # read per step (torch.device.type: ~0.35 us, 2-core VM)
        self._gpu_placement = not self.serving.placement.uses_cpu  # read per step (the enum property: ~0.8 us)
        self._copy_stream = None  # GPU-only, created on first use
        # One layer step (or prefetch) at a time: the ledger, the cache and the kept buffers are shared by every
        # thread running the model (an uncontended acquire costs ~0.1 us a step)
        self._lock = threading.RLock()
        self.cpu_decision = None  # what apply(cpu=...) decided (crisp_runtime.cpu.knob.CpuDecision), for stats()
        self.serving_choice = None  # what ran and why (crisp_runtime.planning.defaults.ServingChoice), for stats()
        if self.serving.placement.uses_cpu:
            if first.tail_start is not None:
                raise ValueError(f"serving placement {self.serving.placement.value!r} computes experts on the CPU, "
                                 "whose kernels read 4-bit rows only; this pack has 2-bit tail rows (GPU placement)")
            if self.store is None:
                raise ValueError(f"serving placement {self.serving.placement.value!r} computes experts on the CPU "
                                 "from host memory: it needs a gpu_budget (experts offloaded to host memory; without "
                                 "a GPU, apply(..., cpu='auto') picks the smallest)")
            if not config.cost.has_cpu:
                raise ValueError(f"serving placement {self.serving.placement.value!r} computes experts on the CPU and "
                                 "needs its measured bandwidth: pass cpu='on' or cpu='auto' to apply / load_model "
                                 "(they measure it), or RuntimeConfig(cost=CostModel(cpu_bytes_per_s=...))")
        # The CPU's experts run on its worker thread (created on first use); an EAGER int4pack copy is built
        # here, and only for a placement that uses the CPU.
        self._cpu = CpuExperts(self.store.layers if self.serving.placement.uses_cpu else {}, config.cpu_experts)
        # GPU-only: with no offload (ResidentExperts) nothing is ever copied, so there is nothing to overlap.
        self._async = config.async_copies and self.device.type == "cuda" and isinstance(self.cache, PrefixCache)
        # PrefetchPolicy.window: the modeled copy clock (scheduling.copy_window) stepped by every forward, which
        # admits only the prefetch rows that modeled copy engine delivers in time (the simulator's rule).
        # Under a CPU placement the clock times each step as the split does (CopyClock.hybrid_step: the CPU's
        # timing comes from the window, HardwareProfile.prefetch_window).
        window = None if config.prefetch is None else config.prefetch.window
        if window is not None and self.serving.placement.uses_cpu and not window.has_cpu:
            raise ValueError(f"PrefetchPolicy.window {window.name!r} has no CPU timing (cpu_bytes_per_s); serving "
                             f"placement {self.serving.placement.value!r} computes experts on the CPU (build the "
                             "window from a profile with a CPU, or use window=None)")
        self._clock = None if window is None else CopyClock(window)

    def _transient_buffer(self, gpu_budget: int) -> int:
        """The neuron split's transient buffer (``ServingPolicy.transient_buffer``): sets ``self._transient_room``
        (per layer, the bytes one step may copy into it: its rows in that layer) and returns its bytes, which
        the cache's budget gives up (0 without one)."""
        frac = self.serving.transient_buffer
        store = self.store
        nb = {i: store.neuron_nbytes(i) for i in store.layers}
        full = {i: store.full_width(i) for i in store.layers}
        self._transient_room = {i: transient_rows(frac, full[i]) * nb[i] for i in nb} if frac else {}
        buf = transient_buffer_bytes(frac, nb, full) if frac else 0
        if buf >= gpu_budget:
            raise ValueError(f"serving {self.serving.name!r}: the transient buffer of {buf:,} bytes "
                             f"({frac:g} full-width experts) leaves nothing of gpu_budget={gpu_budget:,} bytes")
        return buf

    def __getstate__(self) -> dict:
        # copy.deepcopy of an applied model copies its runtime: the copy gets a lock of its own (a lock has no copy)
        state = self.__dict__.copy()
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()

    def close(self) -> None:
        """Stop the CPU worker thread, if one was started (``CrispHandle.restore`` calls this)."""
        self._cpu.close()

    def cpu_stats(self) -> dict | None:
        """``stats()["cpu"]``: what ``apply(cpu=...)`` decided (``CpuDecision``) and, for a placement that uses
        the CPU, how its experts run (``CpuExperts.info``: precision, threads, int4pack copies and their bytes);
        None when neither applies."""
        uses_cpu = self.serving.placement.uses_cpu
        if self.cpu_decision is None and not uses_cpu:
            return None
        out = {} if self.cpu_decision is None else self.cpu_decision.to_dict()
        out["experts"] = self._cpu.info() if uses_cpu else None
        return out

    def set_plan(self, plan: CrispPlan) -> None:
        plan = plan_for_layers(plan, self.layers)
        first = self.layers[self.layer_ids[0]]
        plan.check_compatible(num_experts=first.num_experts, top_k=self.plan.top_k,
                              intermediate_size=first.intermediate_size, layer_ids=self.layer_ids)
        with self._lock:  # between two layer steps
            self.plan = plan
            if isinstance(self.cache, PrefixCache):
                self.cache.policy.set_plan(plan)

    # ------------------------------------------------------------------ one layer step

    def plan_served(self, layer_id: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                    ) -> tuple[ServedSlots, StepPlan]:
        """Served widths and the ordered step plan (all on the CPU): ``serving.plan_served_step`` (which reads
        a decode step's routing with one ``tolist`` each and converts a larger one to CPU tensors)."""
        cache = self.cache
        # One frame per routed expert (the ledger's dict read directly) instead of three (closure, cache, ledger).
        width = (cache.ledger.layer_width(layer_id) if type(cache) is PrefixCache
                 else lambda e: cache.resident_width(layer_id, e))
        return plan_served_step(
            self.step_serving, self.plan, layer_id, top_k_index, top_k_weights, num_experts=self.num_experts,
            neuron_nbytes=self._nb[layer_id], resident_width=width,
            cost=self.config.cost, order=self.config.order,
        )

    def plan_step(self, layer_id: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> StepPlan:
        """The ordered step plan of :meth:`plan_served` (widths as served)."""
        return self.plan_served(layer_id, top_k_index, top_k_weights)[1]

    def forward(self, layer_id: int, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """The routed experts' output for ``hidden_states`` (T, H), in its dtype. Threads running the model at
        once take turns, one layer step at a time."""
        with self._lock:
            return self._step(layer_id, hidden_states, top_k_index, top_k_weights)

    def _step(self, layer_id: int, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
              top_k_weights: torch.Tensor) -> torch.Tensor:
        self._check_step(layer_id, hidden_states, top_k_index, top_k_weights)
        served, step = self.plan_served(layer_id, top_k_index, top_k_weights)
        self.last_step[layer_id] = step
        self.last_served[layer_id] = served
        self._last_tasks = (layer_id, step.tasks)
        stats = self.stats.layers[layer_id]
        stats.tokens += step.num_tokens
        stats.steps += 1
        stats.bytes_read += step.bytes_read
        stats.bytes_routed += step.bytes_routed
        stats.skipped += step.skipped
        if served.slot_dominant is not None:  # roles computed: serving may have changed widths (else all 0)
            _add_served(stats, served)
        x = hidden_states if hidden_states.stride(-1) == 1 else hidden_states.contiguous()
        out = self._accumulator(x)
        if step.tasks:
            timer = _StepTimer(self.device) if self._cuda and self.config.record_timings else None
            if self._gpu_placement:  # every task whole on the GPU: no CPU rows to hand out
                self._run_gpu(layer_id, step, x, top_k_weights, out, stats, step.tasks, gpu_placement=True)
            else:
                self._run(layer_id, step, x, top_k_weights, out, stats)
            if timer is not None:
                stats.step_ms += timer.stop()
        if self._clock is not None:
            self._clock_step(step, top_k_index)
        return out if hidden_states.dtype == torch.float32 else out.to(hidden_states.dtype)

    def _accumulator(self, x: torch.Tensor) -> torch.Tensor:
        """The step's zeroed float32 (T, H) accumulator.

        A float32 step returns it to the caller: a new tensor each step (``zeros_like``: 4.5 us where
        ``torch.zeros(shape, dtype=, device=)`` took 10 us, loaded 2-core VM). Any other dtype returns a
        converted copy, so a decode-sized accumulator (T <= 64: <= 1 MiB at H = 4096) is kept and
        zeroed in place (~0.6-1.7 us), one per stream on CUDA: the next step's ``zero_`` is queued behind
        this step's kernels and conversion on the same stream (GPU-only reasoning, not run here).
        Not when autograd records (the kept buffer would join a graph).
        """
        if x.dtype == torch.float32 or x.shape[0] > _KEEP_ACCUMULATOR_ROWS or x.requires_grad:
            return torch.zeros_like(x, dtype=torch.float32, memory_format=torch.contiguous_format)
        key = torch.cuda.current_stream(self.device) if self._cuda else None  # GPU-only: per stream
        buf = self._accumulators.get(key)
        if buf is None or buf.shape != x.shape:
            buf = self._accumulators[key] = torch.zeros(x.shape, dtype=torch.float32, device=self.device)
            return buf
        return buf.zero_()

    def _decode_weights(self, top_k_weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A decode step's (1, k) routing weights as k one-element float32 views, one per routed slot.

        The weights are copied (converted) into a buffer kept across steps whose views were made
        once: one op per step where a gather, a conversion and a split cost ~15 us (2-core VM). The
        kernels of the step read the views before the next step overwrites them: on the CPU they have
        run; on CUDA the next copy is queued behind them on the same stream (one buffer per stream).
        """
        key = (top_k_weights.shape[1], torch.cuda.current_stream(self.device) if self._cuda else None)  # GPU-only
        got = self._weight_buffers.get(key)
        if got is None:
            buf = torch.empty((1, key[0]), dtype=torch.float32, device=self.device)
            got = self._weight_buffers[key] = (buf, buf.view(-1).split(1))
        got[0].copy_(top_k_weights.detach() if top_k_weights.requires_grad else top_k_weights)
        return got[1]

    def _check_step(self, layer_id, x, top_k_index, top_k_weights) -> None:
        """The boundary checks of a layer step: the kernels below are called unchecked."""
        hidden = self._hidden.get(layer_id)
        if hidden is None:
            raise KeyError(f"CRISP runtime has no layer {layer_id}; it holds {list(self.layer_ids)}")
        shape = x.shape if isinstance(x, torch.Tensor) else None  # each tensor getter is ~0.1 us: read once
        if shape is None or len(shape) != 2 or shape[1] != hidden:
            got = type(x).__name__ if shape is None else tuple(shape)
            raise ValueError(f"layer {layer_id}: hidden_states must be (T, H={hidden}), got {got}")
        if x.dtype not in _ACTIVATION_DTYPES:
            raise ValueError(f"layer {layer_id}: hidden_states must be fp16, bf16 or fp32, got {x.dtype}")
        if x.device != self.device:
            raise RuntimeError(f"layer {layer_id}: activations are on {x.device}, CRISP experts on {self.device}")
        index_shape = top_k_index.shape
        if len(index_shape) != 2 or index_shape != top_k_weights.shape or index_shape[0] != shape[0]:
            raise ValueError(f"layer {layer_id}: top_k_index and top_k_weights must both be (T={x.shape[0]}, k), "
                             f"got {tuple(top_k_index.shape)} and {tuple(top_k_weights.shape)}")

    def _run(self, layer_id: int, step: StepPlan, x, top_k_weights, out, stats: LayerStats) -> None:
        """A step under a placement that uses the CPU (``forward`` runs a GPU placement's through ``_run_gpu``)."""
        n_gpu = sum(1 for t in step.tasks if not t.on_cpu)
        cpu_parts = [t for t in step.tasks if t.cpu_rows is not None]  # CPU tasks and split tasks' CPU rows
        if not cpu_parts:
            self._run_gpu(layer_id, step, x, top_k_weights, out, stats, step.tasks)
            return
        if step.num_tokens == 1 and all(t.stop - t.start == 1 for t in cpu_parts):
            work = self._cpu_token_job(layer_id, step, x, top_k_weights, cpu_parts, stats)
        else:
            work = self._cpu_job(layer_id, step, x, top_k_weights, cpu_parts, stats)
        if not n_gpu:  # nothing for this thread to drive meanwhile: the CPU rows here, no hand-off to the worker
            if out.device.type == "cpu":  # added into the step's own accumulator: no partial, no join
                self._cpu.run_here(functools.partial(work, into=out))
                return
            partial = self._cpu.run_here(work)
        else:
            job = self._cpu.submit(work)
            try:  # the GPU tasks come first in the step's order (a split task's prefix among them)
                self._run_gpu(layer_id, step, x, top_k_weights, out, stats, step.tasks[:n_gpu])
            finally:
                partial = job.result()  # re-raises the worker's exception; never leaves it writing
        out += partial.to(self.device, non_blocking=self.device.type == "cuda")  # the one small join copy

    def _cpu_job(self, layer_id: int, step: StepPlan, x, top_k_weights, tasks, stats: LayerStats):
        """The step's CPU rows as one job: each task's ``cpu_rows`` (a CPU task's [0, width), a split task's
        [split_at, width)); ``job(threads=None)`` returns their (T, H) float32 partial (None: on the worker, at
        its own threads); ``into``: a (T, H) float32 CPU tensor to add into instead of a new partial."""
        cpu, nb = self._cpu, self._nb[layer_id]
        all_weights = top_k_weights.detach().reshape(-1).to("cpu", torch.float32)
        x_cpu = x.detach().to("cpu")  # (T, H): one small device-to-host copy of the activations
        parts = []
        for t in tasks:
            pos = step.flat_pos[t.start:t.stop]
            row_start, width = t.cpu_rows
            parts.append((t.expert, width, row_start, torch.div(pos, step.top_k, rounding_mode="floor"),
                          all_weights[pos], step.flat_widths[t.start:t.stop]))
        _count_cpu_rows(stats, tasks, nb)

        def work(threads: int | None = None, into: torch.Tensor | None = None):
            partial = torch.zeros(x_cpu.shape, dtype=torch.float32) if into is None else into
            for expert, width, row_start, r, w, tw in parts:
                cpu.accumulate_(partial, x_cpu, layer_id, expert, width, r, w, tw, row_start, threads)
            return partial

        return work

    def _cpu_token_job(self, layer_id: int, step: StepPlan, x, top_k_weights, tasks, stats: LayerStats):
        """:meth:`_cpu_job` for a one-token step (a decode step, one slot per task): plain ints from the step's
        lists and each expert's rows bound once (``CpuExperts.accumulate_token_``), where the tensor path spends
        ~0.1 ms a layer on slices, divisions and per-call checks (2-core VM, against ~4 ms of kernel for two
        Mixtral-shaped experts on one core). ``job(threads=None, into=None)``: ``into`` a (1, H) float32 CPU
        tensor to add into, else a new partial is returned."""
        cpu, nb = self._cpu, self._nb[layer_id]
        weights = top_k_weights.detach().reshape(-1).to("cpu", torch.float32).contiguous()  # (k,)
        x_cpu = x.detach().to("cpu", torch.float32).contiguous()  # (1, H)
        pos, widths = step.pos_list, step.widths_list
        parts = []
        for t in tasks:
            row_start, width = t.cpu_rows
            parts.append((t.expert, row_start, max(row_start, min(width, widths[t.start])), pos[t.start]))
        _count_cpu_rows(stats, tasks, nb)

        def work(threads: int | None = None, into: torch.Tensor | None = None):
            partial = torch.zeros(x_cpu.shape, dtype=torch.float32) if into is None else into
            for expert, row_start, row_stop, slot in parts:
                cpu.accumulate_token_(partial, x_cpu, layer_id, expert, row_start, row_stop, weights, slot, threads)
            return partial

        return work

    def _task_inputs(self, step: StepPlan, tasks, top_k_weights, gpu_placement: bool) -> tuple:
        """Per task, what its kernel reads: the token rows, their routing weights and per-token widths."""
        n = len(tasks)
        if gpu_placement and step.num_tokens == 1 and tasks[-1].stop == n:
            # Decode, one slot per expert (GPU placement: a hybrid one's transient tasks want widths): every
            # expert reads row 0 (one shared index tensor), its weight is a view of the buffer the step's
            # weights are copied into, and its one token needs exactly the task's width, so no per-token
            # widths (None: the kernel runs all `width` rows, the same values as widths == width).
            # Per step one copy, where the tensor path costs a gather, a conversion and two splits.
            views = self._decode_weights(top_k_weights)
            pos = step.pos_list
            return (self._zero_row,) * n, [views[pos[t.start]] for t in tasks], (None,) * n
        device = self.device
        if device.type == "cpu":
            flat_pos, flat_widths = step.flat_pos, step.flat_widths
        else:  # one host-to-device transfer for both
            flat = torch.stack((step.flat_pos, step.flat_widths)).to(device)
            flat_pos, flat_widths = flat[0], flat[1]
        if n != len(step.tasks):  # hybrid: the GPU's tasks are the first ones, their slots a prefix
            flat_pos, flat_widths = flat_pos[:tasks[-1].stop], flat_widths[:tasks[-1].stop]
        weights = top_k_weights.detach().reshape(-1)[flat_pos]
        if weights.dtype != torch.float32:
            weights = weights.to(torch.float32)
        # One split per tensor per step, not a slice per expert (each slice is a ~1 us dispatch); the
        # functional split skips Tensor.split's Python wrapper (5.6 vs 8.7 us for 8 parts, loaded 2-core VM).
        counts = [t.stop - t.start for t in tasks]
        weights_s = torch.split_with_sizes(weights, counts)
        widths_s = torch.split_with_sizes(flat_widths, counts)
        if step.num_tokens == 1 and flat_pos.shape[0] == n:  # decode: one slot per expert, all row 0
            rows_s = (self._zero_row,) * n  # a shared index tensor: no div and split (~11 us a step)
        else:
            rows_s = torch.split_with_sizes(torch.div(flat_pos, step.top_k, rounding_mode="floor"), counts)
        return rows_s, weights_s, widths_s

    def _run_gpu(self, layer_id: int, step: StepPlan, x, top_k_weights, out, stats: LayerStats, tasks,
                 gpu_placement: bool = False) -> None:
        device = self.device
        rows_s, weights_s, widths_s = self._task_inputs(step, tasks, top_k_weights, gpu_placement)
        room = self._transient_room.get(layer_id, 0)  # bytes this step may still copy to the transient buffer
        if not (step.bytes_missing or self._async or self.config.record_timings):  # synchronous, copies nothing
            self._run_resident(layer_id, x, out, stats, tasks, rows_s, weights_s, widths_s, room, gpu_placement)
            return
        # The step's keys not yet run are protected from eviction; a step that copies nothing evicts nothing
        # (bytes_missing: the GPU tasks' missing rows at planning, nothing changed since), so none to protect.
        pending = {(layer_id, t.expert) for t in tasks} if step.bytes_missing else set()
        cache, backend = self.cache, self.backend
        compute_stream = copy_stream = None
        if self._async:  # GPU-only
            compute_stream = torch.cuda.current_stream(device)
            copy_stream = self._get_copy_stream()
        timings = [] if self.config.record_timings and copy_stream is None else None
        if timings is not None:
            self.last_timings[layer_id] = timings
        # Hits and expert runs are counted once per step: the loop counts only the tasks that copied (`copies`)
        # and how many got their prefix (`acquired`, so a step that raises counts what it did, as before).
        acquired = copies = 0
        try:
            for i, task in enumerate(tasks):
                if timings is not None:
                    _sync(device)
                    t0 = time.perf_counter()
                # gpu_width (a property, ~0.1 us): a split task's prefix [0, split_at), else its width; a GPU
                # placement has neither CPU nor split tasks
                width = task.width if gpu_placement else task.gpu_width
                if copy_stream is None:
                    got = cache.acquire(layer_id, task.expert, width, protected=pending, transient_room=room)
                else:  # GPU-only: copy on the copy stream, the compute stream waits on this expert's event only
                    with torch.cuda.stream(copy_stream):
                        got = cache.acquire(layer_id, task.expert, width, protected=pending, transient_room=room)
                        if got.copied_bytes:
                            copied = torch.cuda.Event()
                            copied.record(copy_stream)
                    if got.copied_bytes:
                        compute_stream.wait_event(copied)
                        for part in (got.resident, got.transient):  # a transient task: the buffer's rows too
                            if part is not None:
                                for t in part.tensors():
                                    t.record_stream(compute_stream)
                    else:
                        ready = cache.take_ready(layer_id, task.expert)  # a prefetch's copy, not yet waited on
                        if ready is not None:
                            compute_stream.wait_event(ready)
                            for t in got.resident.tensors():
                                t.record_stream(compute_stream)
                acquired += 1
                if timings is not None:
                    _sync(device)
                    t1 = time.perf_counter()
                if pending:
                    pending.discard((layer_id, task.expert))
                decision = got.decision
                if decision is not None:  # None: ResidentExperts, a hit
                    if decision.kind != HIT:
                        copies += 1
                        room -= _count_copy(stats, decision)
                    elif decision.from_prefetch:
                        stats.prefetch_hits += 1
                if got.transient is None:
                    expert_mlp_accumulate_unchecked_(out, x, got.resident, width, rows_s[i], weights_s[i],
                                                     widths_s[i], backend)
                else:
                    _run_transient(out, x, got, rows_s[i], weights_s[i], widths_s[i], backend)
                if timings is not None:
                    _sync(device)
                    timings.append((t1 - t0, time.perf_counter() - t1))
                    stats.copy_ms += 1e3 * (t1 - t0)
                if copy_stream is not None and got.resident is not None:  # GPU-only
                    used = torch.cuda.Event()
                    used.record(compute_stream)
                    cache.mark_used(layer_id, task.expert, used)
        finally:
            stats.hits += acquired - copies
            stats.expert_runs += acquired

    def _run_resident(self, layer_id: int, x, out, stats: LayerStats, tasks, rows_s, weights_s, widths_s,
                      room: int, gpu_placement: bool) -> None:
        """The synchronous path of a step that copies nothing (``bytes_missing`` 0: every task's prefix was
        resident at its width when the step was planned, and nothing ran since): each task's prefix asked of
        the cache in order (``acquire_resident``: the same requests as the general loop, all hits), then their
        kernels in one grouped entry, in the same order (the same sums). Counted once per step."""
        experts = [t.expert for t in tasks]
        widths = [t.width for t in tasks] if gpu_placement else [t.gpu_width for t in tasks]  # see _run_gpu
        resident, from_prefetch = self.cache.acquire_resident(layer_id, experts, widths, transient_room=room)
        stats.hits += len(tasks)
        stats.expert_runs += len(tasks)
        stats.prefetch_hits += from_prefetch
        experts_mlp_accumulate_unchecked_(out, x, resident, widths, rows_s, weights_s, widths_s, self.backend)

    def _clock_step(self, step: StepPlan, top_k_index: torch.Tensor) -> None:
        """Time this step on the modeled clock (``PrefetchPolicy.window``): one job per expert run, in the
        routing's first-appearance order (the clock orders them by Johnson's rule, as the simulator), copying
        the rows its prefix lacked before the step (the ledger's decision unless a step streams through a
        budget below its own experts) and computing its width. Under a CPU placement the step is the split's
        (``CopyClock.hybrid_step`` on the tasks in issue order, as ``bench.simulate._hybrid_step``)."""
        window = self._clock.window
        if not self._gpu_placement:  # a CPU placement: the split's makespan, as the simulator's _hybrid_step
            self._clock.hybrid_step(*hybrid_jobs(
                window, step.tasks, lambda t: max(0, t.gpu_width - t.resident_width) * window.row_nbytes))
            return
        tasks = {t.expert: t for t in step.tasks}
        jobs = []
        for e in dict.fromkeys(top_k_index.reshape(-1).tolist()):
            task = tasks.get(e)
            if task is not None:
                jobs.append(window.job(e, task.width, max(0, task.gpu_width - task.resident_width)))
        self._clock.step(jobs)

    # ------------------------------------------------------------------ prefetch

    def prefetch(self, layer_id: int, requests: Iterable[tuple[int, int]]) -> list[Decision]:
        """Copy experts of ``layer_id`` ahead of demand: ``requests`` = [(expert, width), ...].

        Counted in the same budget through the ledger: a request is admitted only if it fits
        after evicting prefixes that neither the last planned step nor this batch needs (see
        ``ResidencyLedger.prefetch``); a rejected or already resident request copies nothing.
        On CUDA the copies go on the copy stream behind every copy already issued, so they
        never delay a demanded copy of the step in flight; the step that first uses a
        prefetched prefix waits on its event. Returns the admitted decisions, in order.
        With ``gpu_budget=None`` everything is resident and nothing is done.
        With ``PrefetchPolicy.window`` only the rows the modeled copy engine delivers before the next
        step's demand are admitted (``copy_window.admit_requests`` in the span of the last step: a request
        cut short ends it, and a later call of the same step admits nothing); ``stats`` counts the requests
        cut (``prefetch_cut``) and their rows not copied (``prefetch_cut_rows``).
        """
        with self._lock:
            return self._prefetch(layer_id, requests)

    def _prefetch(self, layer_id: int, requests: Iterable[tuple[int, int]]) -> list[Decision]:
        if layer_id not in self._hidden:
            raise KeyError(f"prefetch: CRISP runtime has no layer {layer_id}; it holds {list(self.layer_ids)}")
        full = self.layers[layer_id].intermediate_size
        wanted: dict[int, int] = {}
        for item in requests:
            try:
                e, w = (int(v) for v in item)
            except (TypeError, ValueError):
                raise ValueError(f"prefetch: expected (expert, width) pairs, got {item!r}") from None
            if not 0 <= e < self.num_experts or not 0 < w <= full:
                raise ValueError(f"prefetch: expert {e} must lie in [0, {self.num_experts}) and width {w} in "
                                 f"(0, {full}]")
            wanted[e] = max(w, wanted.get(e, 0))
        if not isinstance(self.cache, PrefixCache):
            return []
        cache = self.cache
        stats = self.stats.layers[layer_id]
        last_layer, last_tasks = self._last_tasks
        protected = {(last_layer, t.expert) for t in last_tasks} | {(layer_id, e) for e in wanted}
        out = []
        copy_stream = self._get_copy_stream() if self._async else None

        def issue(e: int, w: int) -> Decision | None:
            if copy_stream is None:
                decision = cache.prefetch(layer_id, e, w, protected=protected)
            else:  # GPU-only: behind every copy already issued on the copy stream
                with torch.cuda.stream(copy_stream):
                    decision = cache.prefetch(layer_id, e, w, protected=protected)
                    if decision is not None:
                        ready = torch.cuda.Event()
                        ready.record(copy_stream)
                        cache.set_ready(layer_id, e, ready)
            if decision is None:
                stats.prefetch_rejected += 1
                return None
            stats.prefetches += 1
            stats.prefetch_bytes += decision.copy_bytes
            stats.evictions += len(decision.evicted)
            out.append(decision)
            return decision

        span = None if self._clock is None else self._clock.span
        got = admit_requests(wanted.items(), lambda e: cache.resident_width(layer_id, e), issue, span)
        stats.prefetch_cut += got.cut_requests
        stats.prefetch_cut_rows += got.cut_rows
        return out

    def _get_copy_stream(self):  # GPU-only
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        return self._copy_stream


def _run_transient(out, x, got, rows, weights, widths, backend) -> None:
    """A task whose missing rows went to the step's transient buffer (``ResidencyLedger`` kind "transient"):
    the resident rows [0, r) from the cache and the buffer's rows [r, width) as two kernel calls on the same
    tokens (an expert's output is a sum over its neurons, as in the neuron split): a token of width w gets
    min(w, r) rows of the first and max(0, min(w, width) - r) of the second (the kernel clamps to width)."""
    r = got.decision.old_width
    if r:
        expert_mlp_accumulate_unchecked_(out, x, got.resident, r, rows, weights, widths, backend)
    expert_mlp_accumulate_unchecked_(out, x, got.transient, got.width - r, rows, weights,
                                     (widths - r).clamp_(min=0), backend)


def _count_copy(stats: LayerStats, decision: Decision) -> int:
    """Count a task's copy (a miss, a widening or a transient copy) in ``stats``; returns the bytes it took from
    the step's transient buffer (0 unless "transient": rows copied into the buffer, not admitted)."""
    stats.bytes_h2d += decision.copy_bytes
    stats.evictions += len(decision.evicted)
    if decision.kind == MISS:
        stats.misses += 1
    elif decision.kind == TRANSIENT:
        stats.transients += 1
        stats.transient_bytes += decision.copy_bytes
        return decision.copy_bytes
    else:
        stats.widenings += 1
    return 0


def _count_cpu_rows(stats: LayerStats, tasks, neuron_nbytes: int) -> None:
    """A step's CPU rows in its layer's statistics: each task's ``cpu_rows`` (a split task's CPU part counts too)."""
    for t in tasks:
        row_start, width = t.cpu_rows
        stats.cpu_runs += 1
        stats.cpu_bytes_read += (width - row_start) * neuron_nbytes
        if row_start:
            stats.cpu_splits += 1


def _add_served(stats: LayerStats, served: ServedSlots) -> None:
    stats.fallbacks += served.fallbacks
    stats.serving_skips += served.skips
    stats.served_wider += served.wider
    stats.served_widened += served.widened
    stats.served_dominant_slots += served.dominant_slots
    stats.served_dominant_neurons += served.dominant_neurons
    stats.served_aux_slots += served.aux_slots
    stats.served_aux_neurons += served.aux_neurons


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # GPU-only
        torch.cuda.synchronize(device)


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
