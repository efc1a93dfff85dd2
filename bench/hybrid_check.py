"""GPU-only: the host-to-device copy rate alone and while the CPU streams host memory (issue 11).

The hybrid profiles assume the copy engine slows while the CPU reads host memory (ANCHORS: 25 ->
~15 GB/s on an RTX 4090 desktop; ``HardwareProfile.h2d_bytes_per_s_cpu_busy``). This measures it:
a pinned copy timed with CUDA events (median of ``repeats``), alone, then while a second thread
streams a host tensor (``sum`` over ``stream_bytes``, what the CPU expert kernel does to memory), and
the streaming thread's own GB/s. Run by ``bench/gpu_check.sh``; it has never run (no GPU here).
"""

from __future__ import annotations

import json
import statistics
import threading
import time

import torch


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


def main() -> int:
    try:
        print(json.dumps(measure(), indent=1))
    except RuntimeError as exc:
        print(f"error: {exc}")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
