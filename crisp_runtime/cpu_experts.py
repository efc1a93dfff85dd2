"""Experts computed on the host CPU (hybrid placement, issue 11): the worker thread and the kernel call.

The scheduler (``scheduler.split_step``) puts some of a step's experts on the CPU; the executor
hands them, as one job, to :class:`CpuWorker`, one persistent single-thread pool per runtime,
created on first use and shut down by :meth:`CpuWorker.close` (``CrispHandle.restore``). One
thread, not one per expert: the CPU kernel is itself multi-threaded (torch's intra-op pool) and
memory-bound, so two experts at once would only share the same bandwidth. The job runs while
the calling thread issues the GPU's copies and kernels (torch ops release the GIL) and writes a
(T, H) float32 partial output on the CPU, which joins the GPU accumulator with one small copy.

The kernel: H1's ``crisp_kernels.cpu_expert.expert_mlp_cpu_accumulate_`` when that module
exists (its fp32 chunked-dequant path on the host rows for fp32 activations: no second copy of
the experts), else, and for experts it does not cover (biases, other activations), the torch
reference (``crisp_kernels.expert_mlp``) on the host store's tensors.
Both read only the first ``width`` rows of the expert's neuron-major prefix in host memory.
"""

from __future__ import annotations

import importlib
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from crisp_kernels import Backend
from crisp_kernels.expert_mlp import expert_mlp_accumulate_unchecked_


def cpu_kernel():
    """H1's CPU expert kernel when ``crisp_kernels.cpu_expert`` provides it, else None (the reference)."""
    try:
        module = importlib.import_module("crisp_kernels.cpu_expert")
    except ImportError:
        return None
    return getattr(module, "expert_mlp_cpu_accumulate_", None)


def cpu_kernel_name() -> str:
    return "crisp_kernels.cpu_expert" if cpu_kernel() is not None else "torch-reference"


def accumulate_cpu_(partial: torch.Tensor, x: torch.Tensor, packed, width: int, rows: torch.Tensor,
                    weights: torch.Tensor, token_widths: torch.Tensor, kernel=None) -> None:
    """``partial[rows] += weights[:, None] * expert_width(x[rows])`` on the CPU (per-token widths <= width).

    partial: (T, H) float32; x: (T, H) activations; rows / weights / token_widths: (n,) CPU tensors
    of this expert's slots. ``kernel``: :func:`cpu_kernel`'s result (None = the torch reference).
    """
    if kernel is None or packed.bias is not None or packed.activation.kind.value != "silu_glu":
        # the reference also covers what H1's kernel does not (biases, other activations: gpt-oss)
        expert_mlp_accumulate_unchecked_(partial, x, packed, width, rows, weights, token_widths, Backend.TORCH)
        return
    part = torch.zeros((rows.numel(), partial.shape[1]), dtype=torch.float32)
    xs = x.index_select(0, rows)
    if xs.dtype not in (torch.float32, torch.bfloat16):  # H1's kernel takes fp32 or bf16 (fp16 from a GPU model)
        xs = xs.float()
    kernel(xs, packed, token_widths, width, weights, part)
    partial.index_add_(0, rows, part)


class CpuWorker:
    """One lazily created single-thread pool for the CPU's experts of every layer step."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    @property
    def started(self) -> bool:
        return self._pool is not None

    def submit(self, fn, /, *args) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="crisp-cpu-experts")
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        """Wait for a job in flight and stop the thread (a later submit starts a new one)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
