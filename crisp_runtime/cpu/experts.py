"""Experts computed on the host CPU (hybrid placement): the worker thread and the kernel call.

The scheduler (``scheduler.split_step``) puts some of a step's experts on the CPU; the executor
hands them, as one job, to :class:`CpuExperts`' worker: one persistent single-thread pool per
runtime, created on first use and shut down by :meth:`CpuExperts.close` (``CrispHandle.restore``).
One thread, not one per expert: the kernel is itself multi-threaded (torch's intra-op pool) and
memory-bound, so two experts at once would only share the same bandwidth. The job runs while the
calling thread issues the GPU's copies and kernels (torch ops release the GIL) and writes a (T, H)
float32 partial output on the CPU, which joins the GPU accumulator with one small copy. A step with no
GPU task (every step under ``cpu_only``) runs its job on the calling thread instead (:meth:`CpuExperts.run_here`):
there is nothing to overlap, and the hand-off cost ~0.25 ms a layer (tiny Mixtral under ``cpu_only``: 5.2 -> 4.1 ms a
token, 4 layers, 2-core VM).

The kernel is ``crisp_kernels.cpu_expert.expert_mlp_cpu_accumulate_`` (docs/cpu-kernel.md), set by
a frozen :class:`CpuExpertsConfig` (``RuntimeConfig.cpu_experts``):

- **kernel** ``AUTO`` (default): the native C kernel (``crisp_kernels.cpu_native``, built on first use
  with the host's compiler) on the host rows themselves, no second copy, with 8-bit activations under
  ``precision`` ``Q8`` and in fp32 otherwise, so ``prepare`` only matters where it cannot build (then
  ``TORCH``, with a RuntimeWarning saying why, and ``stats()["cpu"]["experts"]["impl"]``) or for steps of more than
  ``cpu_native.MAX_TOKENS`` tokens; ``NATIVE`` refuses to start without it; ``TORCH`` is the path below.

- **precision** ``Q8`` (default): the native kernel quantizes the activations to 8 bits (blocks of 32, as llama.cpp's
  Q8_0) and the down coefficients likewise (blocks of 16 neurons), and its dots are integer sums
  (``crisp_kernels.cpu_expert_q8``): within 2**-5 of the float64 reference per expert, measured 0.85-1.2%; 1.6x the
  fp32 kernel's speed at T = 1 on AVX2 (a Mixtral-shaped H 2048 expert, 1 thread, 2-core AMD EPYC VM: 9.3 against 5.9
  GB/s, ``crisp-bench peer``'s kernel measurement), 2.0x with AVX-512 (Zen 4: 14.8 against 7.3); next-token accuracy
  of the tiny Mixtral under ``cpu_only``: 0.702 against 0.703 with fp32 activations (``crisp-bench peer``). Where the
  native kernel cannot run, ``Q8`` takes the ``BF16`` paths below. ``BF16``: the native kernel in fp32, or else the
  activations are rounded to bf16 on the CPU and the 64-neuron blocks of the prefix go through torch's int4pack op
  (bf16 operands and outputs, fp32 sums of the partial products and fp32 accumulation into the partial output); each
  expert's contribution is within 2u of bf16 (2 * 2**-8 = 7.8e-3, the kernels' tolerance) of the float64 reference at
  the served width, in relative norm. ``FP32``: the exact chunked-dequant path on the host rows (1e-5), ~45x slower
  (docs/cpu-kernel.md, 1 thread).
- **prepare**: the int4pack op reads a second layout of the experts (``cpu_expert_prepare``),
  7,040 B per neuron beside the format's 6,720 at H 4096, g 64: host memory for the experts
  x 2.05 when every expert is prepared (Mixtral-8x7B: +25.8 GB on the pack's 24.7 GB), built at
  0.87 s per Mixtral expert (1 thread, this loaded VM). ``LAZY`` (default) builds an expert's copy
  the first time the CPU computes it, on the worker thread (a one-off stall of that step), so
  only the experts the CPU actually runs cost memory (all of them under ``cpu_only``, the
  non-pinned ones under ``static_hybrid``, those the split sends to the CPU under ``hybrid``);
  ``EAGER`` builds every expert of every layer when the runtime is made (no stall, the whole
  x 2.05 up front); ``NONE`` keeps no second copy and computes every CPU expert on the exact
  fp32 path (the only choice with ``FP32``, which never reads the copy). ``stats()["cpu"]["experts"]``
  reports the copies held and their bytes.
- **threads**: the worker's torch intra-op threads. torch's OpenMP thread count is per OS thread
  (``omp_set_num_threads`` sets the calling thread's), so the worker sets its own at start and the
  thread that made it puts torch's process default back (new threads take that default). None:
  one fewer than the calling thread has (at least 1), leaving a core to the thread that drives the
  GPU. On this 2-core VM that is 1, which is also what the kernel wants here: with 2 threads each
  of its ~80 op calls per expert waits on a preempted OpenMP partner (0.14-0.39 GB/s against
  2.2-3.1 GB/s at 1 thread, Mixtral expert, T = 1; docs/cpu-kernel.md).

Experts the kernel does not cover (biases, other activations: gpt-oss) run the torch reference
(``crisp_kernels.expert_mlp``) in fp32 on the host rows. Every path reads only the first ``width``
rows of the expert's neuron-major prefix, and with ``row_start = s`` (the neuron split,
``Placement.SPLIT``: the GPU computes rows [0, s), the CPU rows [s, width)) only rows [s, width).
"""

from __future__ import annotations

import enum
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

from crisp_kernels import Backend, PackedExpert, cpu_native
from crisp_kernels.checks import check_packed
from crisp_kernels.cpu_expert import (
    CpuExpert,
    CpuExpertConfig,
    CpuImpl,
    Int4PackLayout,
    Int4PackUnsupported,
    Precision,
    expert_mlp_cpu_accumulate_,
    int4pack_layout,
    prepare_expert,
    tolerance,
)
from crisp_kernels.expert_mlp import expert_mlp_accumulate_unchecked_


class CpuKernel(enum.Enum):
    """Which kernel computes a covered expert (see the module docstring)."""

    AUTO = "auto"  # the native kernel when it builds on this machine, else TORCH (default)
    NATIVE = "native"  # crisp_kernels/cpu_expert_native.c, fp32 on the host rows; refused where it cannot build
    TORCH = "torch"  # torch's int4pack op on the prepared copy (prepare != none), else the exact dequant path


class CpuPrepare(enum.Enum):
    """When the int4pack copy of an expert (the fast path's layout) is built; see the module docstring."""

    LAZY = "lazy"  # the first time the CPU computes the expert (default)
    EAGER = "eager"  # every expert of every layer when the runtime is made
    NONE = "none"  # never: the exact fp32 path on the host rows


@dataclass(frozen=True)
class CpuExpertsConfig:
    """How the CPU computes its experts (``RuntimeConfig.cpu_experts``); see the module docstring."""

    precision: Precision = Precision.Q8
    prepare: CpuPrepare = CpuPrepare.LAZY
    threads: int | None = None
    kernel: CpuKernel = CpuKernel.AUTO

    def __post_init__(self) -> None:
        for name, kind in (("precision", Precision), ("prepare", CpuPrepare), ("kernel", CpuKernel)):
            value = getattr(self, name)
            if not isinstance(value, kind):
                try:
                    object.__setattr__(self, name, kind(value))
                except ValueError:
                    raise ValueError(f"CpuExpertsConfig.{name}: expected one of {[m.value for m in kind]}, "
                                     f"got {value!r}") from None
        if self.precision is Precision.FP32 and self.prepare is not CpuPrepare.NONE:
            raise ValueError("CpuExpertsConfig: precision 'fp32' runs the exact path on the host rows, which never "
                             "reads the int4pack copy: use prepare='none' (cpu_experts.EXACT)")
        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(self.threads, int)
                                         or self.threads < 1):
            raise ValueError(f"CpuExpertsConfig.threads: expected None or a positive int, got {self.threads!r}")

    @property
    def torch_impl(self) -> CpuImpl:
        """The torch path's implementation of a covered expert's blocks."""
        return CpuImpl.INT4PACK_BF16 if self.prepare is not CpuPrepare.NONE else CpuImpl.DEQUANT_FP32

    @property
    def impl(self) -> CpuImpl:
        """The implementation of a covered expert at decode sizes (<= cpu_native.MAX_TOKENS tokens; more
        take the torch path). AUTO builds the native kernel on first use to know (once per process)."""
        if self.kernel is CpuKernel.NATIVE or (self.kernel is CpuKernel.AUTO and cpu_native.available()):
            return self.native_impl
        return self.torch_impl

    @property
    def native_impl(self) -> CpuImpl:
        """The native kernel's arithmetic: 8-bit activations under ``Precision.Q8``, else fp32."""
        return CpuImpl.NATIVE_Q8 if self.precision is Precision.Q8 else CpuImpl.NATIVE_FP32

    def worker_threads(self) -> int:
        """The worker's intra-op threads: ``threads``, or one fewer than the calling thread has (>= 1)."""
        return self.threads if self.threads is not None else max(1, torch.get_num_threads() - 1)

    def to_dict(self) -> dict:
        return {"precision": self.precision.value, "prepare": self.prepare.value, "threads": self.threads,
                "kernel": self.kernel.value}


EXACT = CpuExpertsConfig(Precision.FP32, CpuPrepare.NONE)  # fp32 on the host rows, no second copy

# Relative error of one CPU expert's contribution against the float64 reference at its served
# width (crisp_kernels.cpu_expert.tolerance): 2u of bf16 with bf16 operands, 1e-5 in fp32, 2**-5 with 8-bit
# activations.
TOLERANCE = {precision: tolerance(precision) for precision in Precision}


def covered(packed: PackedExpert) -> bool:
    """The CPU kernel computes this expert (silu(gate) * up without biases); else the torch reference."""
    return packed.bias is None and packed.activation.kind.value == "silu_glu"


def _set_worker_threads(threads: int) -> None:
    """The worker's initializer: its OpenMP threads. torch initialises a thread's count lazily, on its
    first parallel op, from the process default; ``get_num_threads`` does that initialisation now,
    while the default is still ``threads``, so that putting the default back later cannot undo it."""
    torch.set_num_threads(threads)
    torch.get_num_threads()


def _resolve_kernel(config: CpuExpertsConfig) -> tuple[CpuImpl, Int4PackLayout | None, str | None]:
    """(implementation, int4pack layout, why int4pack is unsupported) for ``config`` on this machine;
    warns where AUTO cannot have the native kernel or int4pack cannot slice this CPU's layout."""
    if config.kernel is not CpuKernel.TORCH:
        try:
            cpu_native.load()
            return config.native_impl, None, None
        except cpu_native.NativeUnavailable as err:
            if config.kernel is CpuKernel.NATIVE:
                raise ValueError(f"CpuExpertsConfig(kernel='native'): {err}") from err
            warnings.warn(f"CPU experts take torch's kernels ({config.torch_impl.value}): {err}", RuntimeWarning,
                          stacklevel=3)
    if config.torch_impl is not CpuImpl.INT4PACK_BF16:
        return config.torch_impl, None, None
    try:
        return CpuImpl.INT4PACK_BF16, int4pack_layout(), None
    except Int4PackUnsupported as err:
        warnings.warn(f"CPU experts run on the exact fp32 path (~30x slower): {err}", RuntimeWarning, stacklevel=3)
        return CpuImpl.DEQUANT_FP32, None, str(err)


class CpuWorker:
    """One lazily created single-thread pool whose thread runs torch at ``threads`` intra-op threads."""

    def __init__(self, threads: int | None = None) -> None:
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self.threads: int | None = None  # the worker's, once started

    @property
    def started(self) -> bool:
        return self._pool is not None

    def submit(self, fn, /, *args) -> Future:
        if self._pool is None:
            self._start()
        return self._pool.submit(fn, *args)

    def _start(self) -> None:
        default = torch.get_num_threads()  # this thread's (initialised here before the worker changes the default)
        threads = self._threads if self._threads is not None else max(1, default - 1)
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="crisp-cpu-experts",
                                  initializer=_set_worker_threads, initargs=(threads,))
        pool.submit(int).result()  # the initializer has run: the worker's OpenMP threads are set
        # torch.set_num_threads also set torch's default for threads not yet initialised; put it back
        # (on this thread it is the count it already had).
        torch.set_num_threads(default)
        self._pool, self.threads = pool, threads

    def close(self) -> None:
        """Wait for a job in flight and stop the thread (a later submit starts a new one)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def handoff_s(self, jobs: int = 200, rounds: int = 5) -> float:
        """Seconds from submitting an empty job to having its result back (the worker's wake-up and the
        caller's), the least mean over ``rounds`` of ``jobs`` jobs in a row: what a layer step with CPU experts
        pays beyond their compute. 20-260 us on the 2-core VM as its load varied (docs/hybrid.md)."""
        if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
            raise ValueError(f"jobs: expected a positive int, got {jobs!r}")
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
            raise ValueError(f"rounds: expected a positive int, got {rounds!r}")
        self.submit(int).result()  # started
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(jobs):
                self.submit(int).result()
            best = min(best, (time.perf_counter() - t0) / jobs)
        return best


class CpuExperts:
    """The CPU side of one runtime: its worker, its config and the int4pack copies it holds.

    ``layers``: ``{layer_id: PackedLayer}`` in host memory (the host store's). ``kernel``: the
    function called per covered expert (``expert_mlp_cpu_accumulate_``'s signature); tests swap it.
    The copies are built and read by one job at a time: on the worker, or on the calling thread for a step with
    no GPU task (``run_here``); ``EAGER``: here, before any job.
    """

    def __init__(self, layers, config: CpuExpertsConfig) -> None:
        if not isinstance(config, CpuExpertsConfig):
            raise TypeError(f"cpu_experts: expected a CpuExpertsConfig, got {type(config).__name__}")
        self.layers = layers
        self.config = config
        self.kernel = expert_mlp_cpu_accumulate_
        self.worker = CpuWorker(config.threads)
        self._prepared: dict[tuple[int, int], CpuExpert] = {}
        self._views: dict[tuple[int, int], tuple[torch.Tensor, PackedExpert]] = {}
        self._bound: dict[tuple[int, int], tuple[torch.Tensor, cpu_native.BoundRows | None]] = {}
        self._prepared_nbytes = 0
        # impl: the kernel at decode sizes (NATIVE_FP32 needs no second copy of the experts); layout: the
        # int4pack layout of this CPU (blocks of 64 rows with AVX-512, 32 with AVX2) when that op is used;
        # unsupported: why int4pack cannot run here, if so (every expert then takes the exact path).
        self.impl, self.layout, self.unsupported = _resolve_kernel(config)
        # impl None for the native kernel: up to its token limit, then the torch path (cpu_expert.choose_impl)
        native = self.impl in (CpuImpl.NATIVE_FP32, CpuImpl.NATIVE_Q8)
        self._kernel_config = CpuExpertConfig(config.precision, impl=None if native else self.impl)
        if config.prepare is CpuPrepare.EAGER and self.impl is CpuImpl.INT4PACK_BF16:
            for layer_id, layer in layers.items():
                for e in range(layer.num_experts):
                    self._expert(layer_id, e)

    @property
    def started(self) -> bool:
        return self.worker.started

    def submit(self, fn, /, *args) -> Future:
        return self.worker.submit(fn, *args)

    def close(self) -> None:
        self.worker.close()

    def _expert(self, layer_id: int, expert: int) -> PackedExpert | CpuExpert:
        """What the kernel reads for this expert: its int4pack copy (built on first use) or its host rows."""
        layer = self.layers[layer_id]
        key = (layer_id, expert)
        # the view of its host rows, kept: making one slices four tensors (~13 us a call on the 2-core VM); kept
        # only while it views the layer's current tensor (a replaced layer is viewed afresh)
        view = self._views.get(key)
        if view is None or view[0] is not layer.qweight:
            view = self._views[key] = (layer.qweight, layer.expert(expert))
        packed = view[1]
        if self.layout is None or not covered(packed):  # native or exact path, or a layout int4pack cannot slice
            return packed
        got = self._prepared.get(key)
        if got is None:
            got = self._prepared[key] = prepare_expert(packed, self.layout)
            self._prepared_nbytes += got.nbytes
        return got

    def bound(self, layer_id: int, expert: int) -> cpu_native.BoundRows | None:
        """The expert's host rows bound to the native kernel (checked once, kept while they view the layer's
        current tensor), or None where a call would take another path (not the native kernel, an expert the
        kernel does not cover, or a kernel swapped in, as tests do)."""
        key = (layer_id, expert)
        layer = self.layers[layer_id]
        got = self._bound.get(key)
        if got is not None and got[0] is layer.qweight:
            return got[1]
        rows = None
        if self.impl in (CpuImpl.NATIVE_FP32, CpuImpl.NATIVE_Q8) and self.kernel is expert_mlp_cpu_accumulate_:
            packed = self._expert(layer_id, expert)
            if isinstance(packed, PackedExpert) and covered(packed):
                check_packed(packed)
                q8 = self.impl is CpuImpl.NATIVE_Q8
                rows = cpu_native.load().bind(packed.qweight, packed.scales, packed.zeros, packed.fmt.group_size, q8)
        self._bound[key] = (layer.qweight, rows)
        return rows

    def accumulate_token_(self, partial: torch.Tensor, x: torch.Tensor, layer_id: int, expert: int, row_start: int,
                          row_stop: int, weights: torch.Tensor, slot: int, threads: int | None = None) -> None:
        """One token's :meth:`accumulate_`: ``partial += weights[slot] * expert_rows(x)`` over neurons
        ``row_start <= j < row_stop``, through the rows bound once (:meth:`bound`), else :meth:`accumulate_`.

        partial, x: (1, H) float32 contiguous on the CPU; weights: (k,) float32 contiguous on the CPU."""
        rows = self.bound(layer_id, expert)
        if rows is None:
            one = torch.tensor([0])
            self.accumulate_(partial, x, layer_id, expert, row_stop, one, weights[slot:slot + 1],
                             torch.tensor([row_stop]), row_start, threads)
            return
        rows.one_token_(x, weights, slot, partial, row_start, row_stop,
                        torch.get_num_threads() if threads is None else threads)

    def run_here(self, job):
        """Run a job (``job(threads)``) on the calling thread, with ``threads`` (else the caller's torch threads)
        for the native kernel: for a step with nothing else to do meanwhile (no GPU task), where the hand-off to
        the worker and back only costs (1.1 ms of 5.2 a token of the tiny Mixtral under ``cpu_only``: 4 layers
        of queue put + the worker's wake-up + the caller's, 2-core VM)."""
        return job(self.config.threads if self.config.threads is not None else torch.get_num_threads())

    def accumulate_(self, partial: torch.Tensor, x: torch.Tensor, layer_id: int, expert: int, width: int,
                    rows: torch.Tensor, weights: torch.Tensor, token_widths: torch.Tensor, row_start: int = 0,
                    threads: int | None = None) -> None:
        """``partial[rows] += weights[:, None] * expert_rows(x[rows])`` on the CPU, over the expert's neurons
        ``row_start <= j < min(width, token_widths)`` (row_start 0: the whole expert at its widths).

        partial: (T, H) float32; x: (T, H) activations on the CPU; rows / weights / token_widths: (n,)
        CPU tensors of this expert's slots. A gpt-oss down bias belongs to the row_start == 0 part.
        """
        source = self._expert(layer_id, expert)
        host = source.packed if isinstance(source, CpuExpert) else source
        if not covered(host):  # the kernel computes silu(gate) * up without biases: gpt-oss goes here
            if row_start:  # rows [row_start, width) as an expert of their own, its down bias left to the prefix
                host = replace(host, qweight=host.qweight[row_start:width], scales=host.scales[row_start:width],
                               zeros=None if host.zeros is None else host.zeros[row_start:width],
                               bias=None if host.bias is None else host.bias[row_start:width],
                               down_bias=None if host.down_bias is None else torch.zeros_like(host.down_bias))
                token_widths = (token_widths - row_start).clamp_min(0)
            expert_mlp_accumulate_unchecked_(partial, x, host, width - row_start, rows, weights, token_widths,
                                             Backend.TORCH)
            return
        one = rows.numel() == 1
        if one:  # one slot (batch-1 decode): the kernel adds into partial's row in place, which saves a gather,
            # a zeroed buffer and a scatter-add; with the kept views (_expert) a batch-1 call of a 4096-wide
            # expert at width 1 went from 63-96 to 42-45 us on the worker (2-core Zen 4 VM)
            r = int(rows[0])
            xs, part = x[r:r + 1], partial[r:r + 1]
        else:
            xs, part = x.index_select(0, rows), torch.zeros((rows.numel(), partial.shape[1]), dtype=torch.float32)
        if xs.dtype not in (torch.float32, torch.bfloat16):  # fp16 from a GPU model: exact in fp32
            xs = xs.float()
        extra = {} if threads is None else {"threads": threads}  # None: the worker's own torch threads
        self.kernel(xs, source, token_widths, width, weights, part, config=self._kernel_config, row_start=row_start,
                    **extra)
        if not one:
            partial.index_add_(0, rows, part)

    def _native_vector_bits(self) -> int | None:
        if self.impl not in (CpuImpl.NATIVE_FP32, CpuImpl.NATIVE_Q8):
            return None
        from crisp_kernels import cpu_native

        return cpu_native.load().vector_bits  # loaded already: the impl resolved to it

    def info(self) -> dict:
        """For ``stats()["cpu"]["experts"]``: the config, the worker's threads, the copies held and their bytes."""
        host = sum(layer.nbytes() for layer in self.layers.values())
        return {**self.config.to_dict(), "impl": self.impl.value,
                "int4pack_block": None if self.layout is None else self.layout.block_n,
                "native_vector_bits": self._native_vector_bits(),
                "int4pack_unsupported": self.unsupported,
                "worker_threads": self.worker.threads if self.worker.started else self.config.worker_threads(),
                "tolerance": TOLERANCE[self.config.precision],
                "prepared_experts": len(self._prepared), "prepared_bytes": self._prepared_nbytes,
                "host_expert_bytes": host,
                "prepared_over_host": self._prepared_nbytes / host if host else 0.0}
