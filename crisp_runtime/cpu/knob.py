"""The user's knob for hybrid execution: ``apply(..., cpu="off"|"on"|"auto")``.

- ``off``: the configuration as given (GPU-only placement unless the serving policy says otherwise;
  ``serving="paper"``'s default).
- ``on``: the serving policy's placement becomes ``hybrid`` (per step, the GPU / CPU split of
  minimal makespan, ``scheduler.split_step``); the cost model gets the CPU's bandwidth measured
  here (one expert at full width, batch 1, best of 3, on a worker thread set up as the runtime's:
  ``RuntimeConfig.cpu_experts``) with its ridge in tokens (``RIDGE_PROBE_TOKENS`` tokens against one)
  unless the configuration's cost model has a CPU bandwidth, and, where its
  ``join_s`` is 0 (the default), the worker's handoff measured here (``CpuWorker.handoff_s``: a step
  with CPU experts waits for it once; 20-260 us on a 2-core VM), so that a step whose CPU share saves
  less than that stays on the GPU.
- ``auto`` (``apply``'s default for its default and stored choices): with the model on the CPU (no GPU in use:
  none found, or not the model's device), ``cpu_only``: every expert computed by the CPU kernel from the packed
  host rows, with or without a ``gpu_budget`` (:func:`serves_on_cpu`; the device path on a CPU dequantizes whole
  experts with torch ops, 70-80x slower a token on the peer benchmark's large model, 2-core VM), unless the pack
  has 2-bit tail rows, which the CPU kernels do not read. With the model on a GPU: ``on`` when it can pay, from
  the measured bandwidths: experts offloaded (``gpu_budget`` set) and a CPU streaming prefix bytes at >= 1/4 of
  the copy rate (:func:`cpu_pays`) (below that the CPU finishes one full expert in the time of four copies, and
  the overlap it adds is within the planner's own overhead); ``off`` otherwise.

The decision and its reasons are in ``CrispHandle.stats()["cpu"]``.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, replace

import torch

from crisp_kernels import cpu_native
from crisp_runtime.cpu.experts import CpuExperts, CpuExpertsConfig, CpuWorker
from crisp_runtime.planning.serving import make_serving
from crisp_runtime.scheduling.scheduler import Placement

# auto: hybrid when the CPU streams prefix bytes at least this fraction of the H2D rate (see the docstring).
AUTO_MIN_CPU_TO_H2D = 0.25
# the token count whose time, against one token's, gives the CPU's ridge (measure_cpu)
RIDGE_PROBE_TOKENS = 8


class CpuMode(enum.Enum):
    OFF = "off"
    ON = "on"
    AUTO = "auto"


@dataclass(frozen=True)
class CpuDecision:
    """What ``cpu=`` decided, on which figures."""

    mode: CpuMode
    placement: Placement
    reason: str
    cpu_bytes_per_s: float | None = None  # measured here (or the configuration's)
    h2d_bytes_per_s: float | None = None  # measured here on CUDA (or the configuration's)
    kernel: str | None = None
    join_s: float | None = None  # the cost model's per-step CPU cost: the worker's handoff measured here (or set)
    cpu_ridge_tokens: float | None = None  # measured here with the bandwidth (or the configuration's)

    def to_dict(self) -> dict:
        return {"mode": self.mode.value, "placement": self.placement.value, "reason": self.reason,
                "cpu_bytes_per_s": self.cpu_bytes_per_s, "h2d_bytes_per_s": self.h2d_bytes_per_s,
                "kernel": self.kernel, "join_s": self.join_s, "cpu_ridge_tokens": self.cpu_ridge_tokens}


def parse_cpu_mode(cpu) -> CpuMode:
    if isinstance(cpu, CpuMode):
        return cpu
    try:
        return CpuMode(cpu)
    except ValueError:
        raise ValueError(f"cpu: expected 'off', 'on' or 'auto', got {cpu!r}") from None


def measure_cpu_bytes_per_s(layer, repeats: int = 3, config: CpuExpertsConfig | None = None) -> float:
    """Prefix bytes (the format's) per second of the runtime's CPU path: expert 0 of ``layer`` (host
    tensors) at full width, batch 1, best of ``repeats``, timed on a worker thread set up as the
    runtime's (``config``: its precision, int4pack copy and threads; the copy's build is not timed)."""
    return measure_cpu(layer, repeats, config, ridge_at=None)[0]


def measure_cpu(layer, repeats: int = 3, config: CpuExpertsConfig | None = None,
                ridge_at: int | None = RIDGE_PROBE_TOKENS) -> tuple[float, float | None]:
    """(bytes per second at batch 1, ridge in tokens) of the runtime's CPU path on expert 0 of ``layer`` at
    full width (see :func:`measure_cpu_bytes_per_s`). The ridge is the cost model's ``cpu_ridge_tokens``:
    ``ridge_at`` tokens took ``ridge_at / ridge`` times one token's time (at least 1; at most ``ridge_at``, all
    that this probe can tell); ``ridge_at=None``: the bandwidth only (ridge None)."""
    limit = cpu_native.MAX_TOKENS
    if ridge_at is not None and (isinstance(ridge_at, bool) or not isinstance(ridge_at, int)
                                 or not 2 <= ridge_at <= limit):
        raise ValueError(f"ridge_at: expected an int in [2, {cpu_native.MAX_TOKENS}], got {ridge_at!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats: expected a positive int, got {repeats!r}")
    expert = layer.expert(0)
    if expert.device.type != "cpu":
        raise ValueError("measure_cpu_bytes_per_s: the layer must be in host memory")
    cpu = CpuExperts({0: layer}, CpuExpertsConfig() if config is None else config)
    width = layer.intermediate_size

    def timed(tokens: int) -> float:
        x = torch.randn(tokens, layer.hidden_size)
        rows, weights, widths = torch.arange(tokens), torch.ones(tokens), torch.full((tokens,), width)
        out = torch.zeros(tokens, layer.hidden_size)
        best = float("inf")
        for _ in range(repeats + 1):  # the first call warms up (and builds a lazy int4pack copy)
            t0 = time.perf_counter()
            cpu.accumulate_(out, x, 0, 0, width, rows, weights, widths)
            best = min(best, time.perf_counter() - t0)
        return best

    try:
        one = cpu.submit(timed, 1).result()
        many = None if ridge_at is None else cpu.submit(timed, ridge_at).result()
    finally:
        cpu.close()
    ridge = None if many is None else min(float(ridge_at), max(1.0, ridge_at * one / many))
    return expert.nbytes(width) / one, ridge


def measure_handoff_s(config: CpuExpertsConfig | None = None, jobs: int = 50, rounds: int = 3) -> float:
    """The handoff of a worker set up as the runtime's (``CpuWorker.handoff_s``; ~15-40 ms in all here)."""
    worker = CpuWorker((CpuExpertsConfig() if config is None else config).threads)
    try:
        return worker.handoff_s(jobs, rounds)
    finally:
        worker.close()


def _measure_h2d_bytes_per_s(layer, device: torch.device) -> float:  # GPU-only
    host = layer.expert(0).qweight.pin_memory()
    dev = torch.empty_like(host, device=device)
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    return host.numel() * host.element_size() / (time.perf_counter() - t0)


def cpu_pays(cpu_bytes_per_s: float, h2d_bytes_per_s: float) -> bool:
    """``auto``'s rule: the CPU streams prefix bytes at >= ``AUTO_MIN_CPU_TO_H2D`` of the copy rate (module
    docstring). The runtime applies it to the bandwidths measured here, the simulator to a profile's."""
    return cpu_bytes_per_s >= AUTO_MIN_CPU_TO_H2D * h2d_bytes_per_s


def serves_on_cpu(cpu, device, layers) -> bool:
    """Whether ``cpu`` (``"auto"``) puts every expert on the CPU kernel here: no GPU (``device`` is not CUDA) and
    a pack without 2-bit tail rows. The caller then gives the runtime its host store (a ``gpu_budget`` of
    ``min_budget_bytes`` where none was set: on a CPU the budget holds nothing a step reads)."""
    device_type = torch.device(device).type if isinstance(device, str | int) else device.type
    return (parse_cpu_mode(cpu) is CpuMode.AUTO and device_type != "cuda"
            and all(layer.tail_start is None for layer in layers.values()))


def _why_no_gpu(device: torch.device) -> str:
    """The reason's opening where ``cpu="auto"`` runs no GPU: none found, or the model on another device."""
    return "no GPU found" if not torch.cuda.is_available() else f"the model is on {device.type}, not a GPU"


def replay_cpu(device) -> str | None:
    """``apply``'s ``cpu`` for a tool that replays on ``device`` what ``apply`` runs on a GPU machine (``crisp-bench
    e2e``'s ``gpu`` placement and ``crisp-default``, which ``simulate --compare`` matches): None (the default) on a
    GPU; ``"off"`` elsewhere, where the default would serve every expert on the CPU kernel (:func:`serves_on_cpu`)
    instead of the device path that a GPU runs and the simulator models."""
    return None if torch.device(device).type == "cuda" else "off"


def decide_cpu(cpu, *, config, budget: int | None, device: torch.device, layers,
               hybrid_config=None) -> tuple[object, CpuDecision]:
    """The configuration to run and what was decided (``layers``: the packed layers, for measuring).
    hybrid_config: what runs when the CPU is used (``crisp_runtime.planning.defaults``: the default's hybrid family);
    None: ``config`` with its GPU placement made ``hybrid``."""
    mode = parse_cpu_mode(cpu)
    placement = config.serving.placement
    if mode is CpuMode.OFF:
        return config, CpuDecision(mode, placement, "cpu='off': the configuration as given")
    cpu_only = serves_on_cpu(mode, device, layers)
    if mode is CpuMode.AUTO and device.type != "cuda" and not cpu_only:
        return config, CpuDecision(mode, placement, f"{_why_no_gpu(device)}: the experts run on {device.type} "
                                   "through the device path (the pack's 2-bit tail rows are read by it only)")
    if budget is None:
        if mode is CpuMode.ON:
            raise ValueError("cpu='on' computes offloaded experts on the CPU: it needs a gpu_budget")
        if not cpu_only:
            return config, CpuDecision(mode, placement, "no gpu_budget: every expert resident on the device")
        raise ValueError("no GPU: every expert runs on the CPU from its host rows, which needs the host store; "
                         "pass the budget serves_on_cpu's caller gives (min_budget_bytes)")
    if cpu_only:  # every expert on the CPU kernel; prefetch and the GPU cache have nothing to do
        config, hybrid_config = replace(config, serving=make_serving("cpu_only"), prefetch=None), None
        placement = Placement.CPU
    first = layers[min(layers)]
    cost = config.cost
    if cost.has_cpu:  # the configuration's CPU figures, its ridge included
        cpu_bps, ridge = cost.cpu_bytes_per_s, cost.cpu_ridge_tokens
    else:
        cpu_bps, ridge = measure_cpu(first, config=config.cpu_experts)
    h2d_bps = cost.h2d_bytes_per_s
    if device.type == "cuda":  # GPU-only
        h2d_bps = _measure_h2d_bytes_per_s(first, device)
    name = config.cpu_experts.impl.value
    if mode is CpuMode.AUTO and not cpu_only and not cpu_pays(cpu_bps, h2d_bps):  # GPU-only from here (cuda)
        return config, CpuDecision(mode, placement, f"CPU {cpu_bps / 1e9:.1f} GB/s < {AUTO_MIN_CPU_TO_H2D} x H2D "
                                   f"{h2d_bps / 1e9:.1f} GB/s", cpu_bps, h2d_bps, name)
    if hybrid_config is not None:
        config, placement = hybrid_config, hybrid_config.serving.placement
        cost = config.cost
    new_placement = Placement.HYBRID if placement is Placement.GPU else placement
    serving = replace(config.serving, placement=new_placement,
                      name=config.serving.name if placement is not Placement.GPU else
                      ("hybrid" if config.serving.name == "plan" else f"{config.serving.name}+hybrid"))
    # cpu_only: a step has no GPU task, so its CPU rows run on the calling thread (no handoff to measure, 15-40 ms)
    join_s = cost.join_s if cost.join_s > 0 or cpu_only else measure_handoff_s(config.cpu_experts)
    new_cost = replace(cost, cpu_bytes_per_s=cpu_bps, h2d_bytes_per_s=h2d_bps, join_s=join_s, cpu_ridge_tokens=ridge)
    reason = ("cpu='on'" if mode is CpuMode.ON else
              f"{_why_no_gpu(device)}: every expert on the CPU kernel ({name}) from host memory, "
              f"{cpu_bps / 1e9:.1f} GB/s"
              if cpu_only else f"CPU {cpu_bps / 1e9:.1f} GB/s >= {AUTO_MIN_CPU_TO_H2D} x H2D {h2d_bps / 1e9:.1f} GB/s")
    return replace(config, serving=serving, cost=new_cost), CpuDecision(mode, new_placement, reason, cpu_bps,
                                                                        h2d_bps, name, join_s, ridge)
