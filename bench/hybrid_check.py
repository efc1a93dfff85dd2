"""The hybrid placement's GPU checks (run by ``bench/gpu_check.sh``; neither has run on a GPU: none here).

``copy`` (:func:`measure`, GPU-only): the host-to-device copy rate alone and while the CPU streams
host memory. The hybrid profiles assume the copy engine slows while the CPU reads host memory
(ANCHORS: 25 -> ~15 GB/s on an RTX 4090 desktop; ``HardwareProfile.h2d_bytes_per_s_cpu_busy``): a
pinned copy timed with CUDA events (median of ``repeats``), alone, then while a second thread
streams a host tensor (``sum`` over ``stream_bytes``, what the CPU expert kernel does to memory),
and the streaming thread's own GB/s.

``step`` (:func:`hybrid_step_check`): one real hybrid layer step of ``CrispRuntime`` (placements
``hybrid`` and ``hybrid_split``, a cold cache and one expert resident) against the simulator's
prediction of that step: ``bench.simulate._hybrid_step`` (the simulator's own code) on the tasks and
copies the runtime's step made, with a profile of this machine's figures (the copy rates of ``copy``,
the device's expert rate and the CPU worker's measured here). It runs on any device; on a CPU the
"GPU" is the CPU as well, which only checks the code path (the tests do that).

``prefetch`` (:func:`prefetch_step_check`): two real layer steps, the first with its
experts resident, then the runtime's prefetch of the second's experts, then the second, against
the simulator's timeline of the same (``bench.simulate.schedule`` and ``_prefetch``: prefetched rows
only up to the second layer's start, the rest demanded), with and without the prefetch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from types import SimpleNamespace

import torch

from crisp_runtime import CrispPlan, RuntimeConfig
from crisp_runtime.cpu.experts import CpuExpertsConfig
from crisp_runtime.cpu.knob import measure_cpu_bytes_per_s
from crisp_runtime.execution.runtime import CrispRuntime
from crisp_runtime.residency.ledger import LedgerCounters, ResidencyLedger
from crisp_runtime.scheduling.copy_window import CopyClock

from .common import sync
from .profiles import HardwareProfile
from .runtime import _random_packed, _to_cpu_layer
from .simulate import Job, OrderTotals, SimResult, _hybrid_step, _prefetch, schedule


def _copy_gbps(host: torch.Tensor, dev: torch.Tensor, repeats: int) -> float:  # GPU-only
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dev.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return host.numel() / statistics.median(times) / 1e9


def measure(copy_bytes: int = 256 << 20, stream_bytes: int = 1 << 30, repeats: int = 7) -> dict:
    """{"h2d_gbps", "h2d_gbps_cpu_busy", "cpu_stream_gbps", ...}; raises RuntimeError without CUDA."""
    if not torch.cuda.is_available():
        raise RuntimeError("bench.hybrid_check needs a CUDA GPU (the copy engine is what it measures)")
    host = torch.empty(copy_bytes, dtype=torch.uint8).pin_memory()  # GPU-only from here
    dev = torch.empty(copy_bytes, dtype=torch.uint8, device="cuda")
    _copy_gbps(host, dev, 2)  # warm-up
    alone = _copy_gbps(host, dev, repeats)
    big = torch.ones(stream_bytes // 4, dtype=torch.float32)
    t0 = time.perf_counter()
    big.sum()
    stream_alone = stream_bytes / (time.perf_counter() - t0) / 1e9
    stop = threading.Event()
    passes = [0]

    def stream() -> None:
        while not stop.is_set():
            big.sum()
            passes[0] += 1

    worker = threading.Thread(target=stream, name="crisp-hybrid-check-stream")
    worker.start()
    try:
        time.sleep(0.05)  # the stream is running before the copies start
        t1 = time.perf_counter()
        busy = _copy_gbps(host, dev, repeats)
        elapsed = time.perf_counter() - t1
    finally:
        stop.set()
        worker.join()
    return {"copy_bytes": copy_bytes, "h2d_gbps": alone, "h2d_gbps_cpu_busy": busy, "busy_over_alone": busy / alone,
            "cpu_stream_gbps_alone": stream_alone, "cpu_stream_passes_during_copies": passes[0],
            "copies_elapsed_s": elapsed, "device": torch.cuda.get_device_name(0),
            "threads": torch.get_num_threads()}


def simulated_step_s(step, served, profile: HardwareProfile, neuron_nbytes: int) -> float:
    """The simulator's time of one runtime layer step: ``bench.simulate._hybrid_step`` on its tasks, each GPU
    task's copy as the runtime's ledger decided it (``ExpertTask.copy_bytes``), no router or other work."""
    res = SimResult(0, 1, LedgerCounters(), per_order={"widest_first": OrderTotals()})
    copies = {t.expert: t.copy_bytes for t in step.tasks}
    ledger = SimpleNamespace(request=lambda layer, expert, width, protected: SimpleNamespace(copy_bytes=copies[expert]))
    _hybrid_step(res, ledger, 0, step, served, CopyClock(profile.prefetch_window(neuron_nbytes)), profile, 0.0, True)
    return res.per_order["widest_first"].time_s


def _median_step_s(runtime, x, index, weights, repeats: int, before=None) -> float:
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        sync(runtime.device)
        t0 = time.perf_counter()
        runtime.forward(0, x, index, weights)
        sync(runtime.device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def hybrid_step_check(*, device, h2d_bytes_per_s: float, h2d_bytes_per_s_cpu_busy: float, hidden: int = 4096,
                      intermediate: int = 14336, num_experts: int = 4, top_k: int = 2,
                      placements=("hybrid", "hybrid_split"), repeats: int = 5,
                      cpu_experts: CpuExpertsConfig | None = None) -> list[dict]:
    """Measured vs simulated time of one decode layer step (T = 1, ``top_k`` experts at full width).

    The profile: the given copy rates; the device's expert rate from the same step with every expert
    resident (no budget); the CPU worker's rate from ``cpu_knob.measure_cpu_bytes_per_s`` (the runtime's
    path and threads). Cases per placement: ``cold`` (nothing resident) and ``one_resident`` (the first
    routed expert resident at full width). Each record: measured (median of ``repeats``, device
    synchronised), predicted, their ratio, and where the step put its experts.
    """
    device = torch.device(device)
    cpu_experts = CpuExpertsConfig() if cpu_experts is None else cpu_experts
    layer = _to_cpu_layer(_random_packed(num_experts, intermediate, hidden, device=device))  # packed on the device
    nb = layer.neuron_nbytes
    plan = CrispPlan.full(num_experts, top_k, intermediate, [0])
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    x = torch.randn(1, hidden, dtype=dtype).to(device)
    index = torch.arange(top_k).unsqueeze(0).to(device)
    weights = torch.full((1, top_k), 1.0 / top_k, device=device)
    resident = CrispRuntime({0: layer}, plan, device=device, gpu_budget=None)
    resident.forward(0, x, index, weights)  # warm-up (kernel compilation on CUDA)
    compute_bps = top_k * intermediate * nb / _median_step_s(resident, x, index, weights, repeats)
    cpu_bps = measure_cpu_bytes_per_s(layer, config=cpu_experts)
    profile = HardwareProfile("measured-step", h2d_bytes_per_s, 0.0, compute_bps, 0.0, 0.0, 0.0,
                              description="hybrid_check.hybrid_step_check", cpu_bytes_per_s=cpu_bps,
                              h2d_bytes_per_s_cpu_busy=h2d_bytes_per_s_cpu_busy)
    records = []
    for placement in placements:
        config = RuntimeConfig(serving=placement, cost=profile.cost_model(), cpu_experts=cpu_experts,
                               pin_memory=device.type == "cuda")
        runtime = CrispRuntime({0: layer}, plan, device=device, gpu_budget=num_experts * intermediate * nb,
                               config=config)
        try:
            for case in ("cold", "one_resident"):
                def reset(case=case, runtime=runtime):
                    runtime.cache.clear()
                    if case == "one_resident":
                        runtime.prefetch(0, [(0, intermediate)])
                reset()
                runtime.forward(0, x, index, weights)  # warm-up: a lazily built int4pack copy, the worker thread
                measured = _median_step_s(runtime, x, index, weights, repeats, before=reset)
                step, served = runtime.last_step[0], runtime.last_served[0]
                predicted = simulated_step_s(step, served, profile, nb)
                records.append({
                    "placement": placement, "case": case, "measured_ms": measured * 1e3,
                    "predicted_ms": predicted * 1e3,
                    "measured_over_predicted": measured / predicted if predicted > 0 else None,
                    "cpu_experts": sum(t.on_cpu for t in step.tasks),
                    "split_experts": sum(t.split_at is not None for t in step.tasks),
                    "copied_bytes": sum(t.copy_bytes for t in step.tasks),
                    "profile": {"h2d_gbps": h2d_bytes_per_s / 1e9, "h2d_gbps_cpu_busy": h2d_bytes_per_s_cpu_busy / 1e9,
                                "compute_gbps": compute_bps / 1e9, "cpu_gbps": cpu_bps / 1e9},
                    "hidden": hidden, "intermediate": intermediate, "top_k": top_k, "device": str(device),
                    "cpu": runtime.cpu_stats()["experts"]})
        finally:
            runtime.close()
    return records


def _measured_profile(layer, device, x, index, weights, repeats: int, h2d_bytes_per_s: float,
                      h2d_bytes_per_s_cpu_busy: float | None, cpu_bps: float | None, name: str) -> HardwareProfile:
    """A profile of the given copy rates, the CPU rate, and the device's expert rate measured from a step
    with every expert resident (no budget)."""
    plan = CrispPlan.full(layer.num_experts, index.shape[1], layer.intermediate_size, [0])
    resident = CrispRuntime({0: layer}, plan, device=device, gpu_budget=None)
    resident.forward(0, x, index, weights)  # warm-up (kernel compilation on CUDA)
    step_s = _median_step_s(resident, x, index, weights, repeats)
    compute_bps = index.shape[1] * layer.intermediate_size * layer.neuron_nbytes / step_s
    return HardwareProfile(name, h2d_bytes_per_s, 0.0, compute_bps, 0.0, 0.0, 0.0, description=name,
                           cpu_bytes_per_s=cpu_bps, h2d_bytes_per_s_cpu_busy=h2d_bytes_per_s_cpu_busy)


def simulated_prefetch_pair_s(profile: HardwareProfile, routed0, routed1, width: int, nb: int, budget: int,
                              prefetch: bool) -> float:
    """The simulator's time of layer 0's step (its experts resident), then layer 1's (cold), with or without
    layer 1's experts prefetched during layer 0: ``schedule`` for both steps, ``_prefetch`` for the copies
    (cut at layer 1's start, as the simulator's rule says; what is left is demanded)."""
    led = ResidencyLedger(budget, {0: nb, 1: nb}, {0: width, 1: width})
    for e in routed0:
        led.prefetch(0, e, width)
    end0, _ = schedule([Job(e, width, 0.0, profile.compute_s(width * nb)) for e in routed0], "widest_first")
    copy_free = 0.0
    if prefetch:
        issued, _ = _prefetch(led, 1, [(e, width) for e in routed1], nb, profile, 0.0, end0 + profile.router_s,
                              {(0, e) for e in routed0})
        copy_free = issued[-1][3] if issued else 0.0
    jobs = []
    for e in routed1:
        decision = led.request(1, e, width, protected={(1, x) for x in routed1})
        jobs.append(Job(e, width, profile.load_s(decision.copy_bytes), profile.compute_s(width * nb)))
    end1, _ = schedule(jobs, "widest_first", end0 + profile.router_s, copy_free)
    return end1


def prefetch_step_check(*, device, h2d_bytes_per_s: float, hidden: int = 4096, intermediate: int = 14336,
                        num_experts: int = 4, top_k: int = 2, repeats: int = 5) -> list[dict]:
    """Measured vs simulated time of two decode layer steps (T = 1, full width), layer 0's experts resident,
    layer 1's cold: with the runtime's prefetch of layer 1's experts issued after layer 0's step, and without."""
    device = torch.device(device)
    layers = {i: _to_cpu_layer(_random_packed(num_experts, intermediate, hidden, device=device, seed=i))
              for i in (0, 1)}
    nb = layers[0].neuron_nbytes
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    x = torch.randn(1, hidden, dtype=dtype).to(device)
    routed0, routed1 = list(range(top_k)), list(range(num_experts - top_k, num_experts))
    index0 = torch.tensor([routed0], device=device)
    index1 = torch.tensor([routed1], device=device)
    weights = torch.full((1, top_k), 1.0 / top_k, device=device)
    profile = _measured_profile(layers[0], device, x, index0, weights, repeats, h2d_bytes_per_s, None, None,
                                "measured-prefetch")
    budget = 2 * num_experts * intermediate * nb
    plan = CrispPlan.full(num_experts, top_k, intermediate, [0, 1])
    runtime = CrispRuntime(layers, plan, device=device, gpu_budget=budget,
                           config=RuntimeConfig(pin_memory=device.type == "cuda"))
    records = []
    for prefetch in (False, True):
        times = []
        for n in range(repeats + 1):  # the first is a warm-up
            runtime.cache.clear()
            runtime.prefetch(0, [(e, intermediate) for e in routed0])
            sync(device)
            t0 = time.perf_counter()
            runtime.forward(0, x, index0, weights)
            if prefetch:
                runtime.prefetch(1, [(e, intermediate) for e in routed1])
            runtime.forward(1, x, index1, weights)
            sync(device)
            if n:
                times.append(time.perf_counter() - t0)
        measured = statistics.median(times)
        predicted = simulated_prefetch_pair_s(profile, routed0, routed1, intermediate, nb, budget, prefetch)
        records.append({"prefetch": prefetch, "measured_ms": measured * 1e3, "predicted_ms": predicted * 1e3,
                        "measured_over_predicted": measured / predicted if predicted > 0 else None,
                        "profile": {"h2d_gbps": h2d_bytes_per_s / 1e9,
                                    "compute_gbps": profile.compute_bytes_per_s / 1e9},
                        "hidden": hidden, "intermediate": intermediate, "top_k": top_k, "device": str(device)})
    runtime.close()
    return records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m crisp_bench.hybrid_check", description=__doc__.split("\n")[0])
    parser.add_argument("what", nargs="?", choices=("copy", "step", "prefetch"), default="copy",
                        help="copy: H2D rate alone and while the CPU streams; step: a hybrid layer step against the "
                        "simulator; prefetch: two layer steps with the next layer's prefetch against the simulator "
                        "(both measure the copy rates first); all need a CUDA GPU")
    args = parser.parse_args([] if argv is None else argv)  # None: no arguments (in-process), not sys.argv
    try:
        copy = measure()
        if args.what == "copy":
            print(json.dumps(copy, indent=1))
            return 0
        if args.what == "prefetch":
            records = prefetch_step_check(device="cuda", h2d_bytes_per_s=copy["h2d_gbps"] * 1e9)
        else:
            records = hybrid_step_check(device="cuda", h2d_bytes_per_s=copy["h2d_gbps"] * 1e9,
                                        h2d_bytes_per_s_cpu_busy=copy["h2d_gbps_cpu_busy"] * 1e9)
        print(json.dumps({"copy": copy, "steps": records}, indent=1))
    except RuntimeError as exc:
        print(f"error: {exc}")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
