"""The copy engine's time a prefetch may use: a modeled clock of consecutive layer steps.

A prefetch for layer l+1 is issued after layer l's demanded copies, on the same copy engine. It must
never delay a demanded copy, so only rows that arrive before layer l+1 may start its own demanded
copies (when its router has run) are worth issuing. On a GPU that is a question of time; on the CPU
(where the accuracy decode runs, copies take no time) the runtime would complete every prefetch. This
module models that time, so that the simulator (``bench/simulate.py``) and the runtime in the loop
(``CrispRuntime.prefetch`` with ``PrefetchPolicy.window``) cut the same prefetches at the same rows:

    per layer step (batch-1 decode), starting at the step's start:
      compute engine: lead (other + router)  ->  the step's expert computes
      copy engine:    [previous prefetch, if still copying] -> demanded copies -> prefetch copies
    deadline of the prefetch = the step's end + lead (the next step's router end)

- The step's demanded jobs (one per expert run: the rows it copied, the width it computes) are timed
  as a two-stage flow shop in Johnson's order (:func:`overlap_schedule`, ``scheduler.johnson_order``)
  from ``lead``, the copy engine free from ``copy_free`` (what the previous step's prefetch left).
- The prefetch starts when the demanded copies are done (``demand_done``) and takes its requests in
  order (widest first); a request whose missing rows do not all arrive by the deadline is cut to the
  rows that do (a narrower prefix is still a prefix: ``floor(room * h2d / row_bytes)`` rows after the
  copy latency) and nothing after it is issued, in this phase or a later one of the same step (the
  second phase of ``DominantWiden.AHEAD`` only runs in the time the first left).
- ``copy_free`` of the next step = max(0, last prefetch copy end - this step's end): at most ``lead``,
  so the next step's demanded copies never start later than they would without the prefetch.

Under a CPU placement (``Placement.HYBRID`` / ``SPLIT``; :meth:`CopyClock.hybrid_step`, :func:`hybrid_times`)
a step is the split's makespan (``scheduler.split_makespan``: the GPU's flow shop, copying at the reduced
H2D rate while the CPU streams host memory, beside the CPU's jobs and one join); the prefetch span starts
when the demanded copies are done, at the busy rate until the step ends, then at the full rate (in
attention the CPU computes no expert) until the next router's end. At the full rate that is the span
[end - idle, end + lead), ``idle`` the copy engine's idle time in the step converted to full-rate seconds.
No copy time carries over: every prefetch copy ends by the next router's end.

Times are a model (:class:`PrefetchWindow`: a machine's copy/compute rates and per-layer fixed time,
expressed per neuron row of the model being run, so a tiny model can stand for Mixtral-8x7B: each of
its rows is worth ``row_nbytes`` bytes of the target). Plain Python, deterministic for an input
sequence; nothing here touches a device. The window is built from a hardware profile in bench
(``crisp_bench.profiles.HardwareProfile.prefetch_window``); this package does not import bench.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

from crisp_runtime.scheduling.scheduler import HybridJob, johnson_order, split_makespan


def timed_s(nbytes: int, latency_s: float, bytes_per_s: float) -> float:
    """A copy or a compute over ``nbytes``: a fixed latency plus the bytes at a rate; 0 for nothing."""
    return 0.0 if nbytes <= 0 else latency_s + nbytes / bytes_per_s


class ExpertTiming:
    """The timing formulas of one machine, shared by the simulator's ``HardwareProfile`` and
    :class:`PrefetchWindow` (both frozen dataclasses with these fields): ``h2d_bytes_per_s``,
    ``copy_latency_s``, ``compute_bytes_per_s``, ``compute_latency_s``, ``cpu_bytes_per_s`` (None: no
    CPU), ``cpu_latency_s``, ``h2d_bytes_per_s_cpu_busy`` (None: the copy rate does not drop while the
    CPU streams host memory). ``nbytes`` are bytes of the target machine's experts."""

    __slots__ = ()

    def load_s(self, nbytes: int) -> float:
        """Time to copy ``nbytes`` host -> device (one expert prefix or widening); 0 for 0 bytes."""
        return timed_s(nbytes, self.copy_latency_s, self.h2d_bytes_per_s)

    def compute_s(self, nbytes: int) -> float:
        """Time to run one expert over a prefix of ``nbytes`` bytes; 0 for a skipped expert."""
        return timed_s(nbytes, self.compute_latency_s, self.compute_bytes_per_s)

    @property
    def has_cpu(self) -> bool:
        return self.cpu_bytes_per_s is not None

    @property
    def busy_copy_rate(self) -> float:
        """The H2D rate while the CPU streams host memory (the full rate when none is given)."""
        return self.h2d_bytes_per_s if self.h2d_bytes_per_s_cpu_busy is None else self.h2d_bytes_per_s_cpu_busy

    def load_busy_s(self, nbytes: int) -> float:
        """Copy time while the CPU streams host memory (the reduced H2D rate)."""
        return timed_s(nbytes, self.copy_latency_s, self.busy_copy_rate)

    def cpu_s(self, nbytes: int) -> float:
        """Time for the CPU to run one expert (batch 1) over a prefix of ``nbytes``; inf without a CPU."""
        if self.cpu_bytes_per_s is None:
            return math.inf
        return timed_s(nbytes, self.cpu_latency_s, self.cpu_bytes_per_s)


@dataclass(frozen=True)
class PrefetchWindow(ExpertTiming):
    """A machine's timing per neuron row of the model being run (see the module docstring).

    load(rows)    = copy_latency_s + rows * row_nbytes / h2d_bytes_per_s           (0 for no rows)
    compute(rows) = compute_latency_s + rows * row_nbytes / compute_bytes_per_s    (0 for no rows)
    lead_s: the fixed compute time of a MoE layer before its experts are known (other + router).
    """

    row_nbytes: int  # bytes one neuron row of the run model stands for (the target's bytes)
    h2d_bytes_per_s: float
    copy_latency_s: float
    compute_bytes_per_s: float
    compute_latency_s: float
    lead_s: float
    name: str = ""  # e.g. "rtx4090-pcie4/mixtral-8x7b", for records
    # The host CPU, for a step under a CPU placement (:meth:`CopyClock.hybrid_step`; None: no CPU, GPU-only steps
    # only): its bytes/s and fixed time per expert call (``HardwareProfile.cpu_s``), the H2D rate while it
    # streams host memory (None: unchanged) and the join of its partial output (``scheduler.split_makespan``).
    cpu_bytes_per_s: float | None = None
    cpu_latency_s: float = 0.0
    h2d_bytes_per_s_cpu_busy: float | None = None
    join_s: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.row_nbytes, bool) or not isinstance(self.row_nbytes, int) or self.row_nbytes <= 0:
            raise ValueError(f"PrefetchWindow: row_nbytes must be a positive int, got {self.row_nbytes!r}")
        for f in ("h2d_bytes_per_s", "compute_bytes_per_s"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"PrefetchWindow: {f} must be a positive number, got {v!r}")
        for f in ("cpu_bytes_per_s", "h2d_bytes_per_s_cpu_busy"):
            v = getattr(self, f)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                                  or v <= 0):
                raise ValueError(f"PrefetchWindow: {f} must be a positive number or None, got {v!r}")
        for f in ("copy_latency_s", "compute_latency_s", "lead_s", "cpu_latency_s", "join_s"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"PrefetchWindow: {f} must be a non-negative number, got {v!r}")

    def job(self, expert: int, width: int, copy_rows: int) -> Job:
        """A demanded expert of a step: ``copy_rows`` rows copied, computed at ``width`` rows."""
        return Job(expert, width, self.load_s(copy_rows * self.row_nbytes), self.compute_s(width * self.row_nbytes))

    def hybrid_job(self, width: int, gpu_width: int, copy_bytes: int, on_cpu: bool) -> HybridJob:
        """One task of a step under a CPU placement (``scheduler.HybridJob``): on the CPU whole (``on_cpu``:
        its GPU time is what it would take there), or a GPU prefix ``gpu_width`` that copied ``copy_bytes``
        target bytes, the CPU computing rows [gpu_width, width)."""
        nb = self.row_nbytes
        if on_cpu:
            return HybridJob(0.0, 0.0, self.compute_s(width * nb), self.cpu_s(width * nb))
        return HybridJob(self.load_s(copy_bytes), self.load_busy_s(copy_bytes), self.compute_s(gpu_width * nb),
                         self.cpu_s((width - gpu_width) * nb))

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Job:
    """One routed expert in one layer step."""

    expert: int
    width: int  # neurons computed (> 0)
    load_s: float  # copy time of its missing bytes (0 for a cache hit)
    compute_s: float


@dataclass(frozen=True)
class Slot:
    """When a job's copy and compute ran (copy_start == copy_end for a hit)."""

    expert: int
    copy_start: float
    copy_end: float
    compute_start: float
    compute_end: float


def johnson_jobs(jobs: Sequence[Job]) -> list[Job]:
    """``jobs`` in Johnson's order on their own times (the runtime's widest-first order)."""
    return [jobs[i] for i in johnson_order([j.load_s for j in jobs], [j.compute_s for j in jobs])]


def overlap_schedule(seq: Sequence[Job], start: float = 0.0, copy_free: float = 0.0) -> tuple[float, list[Slot]]:
    """Times of ``seq`` (in the order they run) from ``start`` as a two-stage flow shop: copies back to
    back from max(start, copy_free); each compute after its copy and the previous compute. (end, slots)."""
    slots: list[Slot] = []
    copy_at = max(start, copy_free)
    compute_free = start
    for j in seq:
        if j.load_s > 0:
            copy_start, copy_end = copy_at, copy_at + j.load_s
            copy_at = copy_end
        else:
            copy_start = copy_end = start
        compute_start = max(copy_end, compute_free)
        compute_free = compute_start + j.compute_s
        slots.append(Slot(j.expert, copy_start, copy_end, compute_start, compute_free))
    return max(copy_at, compute_free), slots


class PrefetchSpan:
    """The copy time one step leaves a prefetch: from ``start`` (demanded copies done) to ``deadline``.

    ``rows(missing)`` says how many of a request's missing rows arrive in time; ``took(rows)`` advances
    the copy cursor by an admitted copy; ``cut`` is set by :func:`admit_requests` once a request was
    cut short (or got no row): nothing more is admitted in this step.
    """

    def __init__(self, window: PrefetchWindow, start: float, deadline: float) -> None:
        self.window = window
        self.start = start
        self.deadline = deadline
        self.cursor = start  # when the copy engine is free for the next prefetch copy
        self.cut = False

    def rows(self, missing: int) -> int:
        """Rows of ``missing`` that arrive by the deadline after the copy latency (0 once cut)."""
        if self.cut:
            return 0
        w = self.window
        room = self.deadline - self.cursor - w.copy_latency_s
        return min(missing, math.floor(room * w.h2d_bytes_per_s / w.row_nbytes)) if room > 0 else 0

    def took(self, copy_rows: int) -> tuple[float, float]:
        """An admitted prefetch copied ``copy_rows`` rows: (its copy start, end) on the modeled clock."""
        begin = self.cursor
        self.cursor = begin + self.window.load_s(copy_rows * self.window.row_nbytes)
        return begin, self.cursor


@dataclass(frozen=True)
class StepTimes:
    """A step on the modeled clock (times from the step's start)."""

    end: float
    slots: list[Slot]
    demand_done: float  # the demanded copies are done (the prefetch may start)
    deadline: float  # end + lead: the next step's demanded copies may start


@dataclass(frozen=True)
class HybridTimes:
    """A step under a CPU placement (:func:`hybrid_times`), in seconds from the router's end."""

    span: float  # the expert phase: the split's makespan (GPU flow shop beside the CPU's jobs and join)
    copied: float  # the demanded copies back to back (at the busy rate when the CPU computes a job)
    idle: float  # the copy engine's time left in the span after them, converted to full-rate seconds


def hybrid_times(window: PrefetchWindow, jobs: Sequence[HybridJob], gpu: Sequence[int],
                 cpu: Sequence[int]) -> HybridTimes:
    """Time one step's ``jobs`` (``gpu``: indices on the GPU in issue order, ``cpu``: indices with rows on the
    CPU): the makespan of ``scheduler.split_makespan``; the copy engine is idle after the demanded copies until
    the step ends, copying at the busy rate while the CPU streams host memory, so its idle time holds
    ``idle * h2d_bytes_per_s`` bytes (the full-rate seconds a prefetch span may use)."""
    span = split_makespan(gpu, cpu, jobs, window.join_s) if jobs else 0.0
    busy = bool(cpu)
    copied = sum(jobs[i].load_busy_s if busy else jobs[i].load_s for i in gpu)
    idle = max(0.0, span - copied) * (window.busy_copy_rate / window.h2d_bytes_per_s if busy else 1.0)
    return HybridTimes(span, copied, idle)


def hybrid_jobs(window: PrefetchWindow, tasks: Sequence, copy_bytes: Callable[[object], int]
                ) -> tuple[list[HybridJob], list[int], list[int]]:
    """A step's ``scheduler.ExpertTask`` s under a CPU placement as :func:`hybrid_times` takes them: the jobs, the
    indices on the GPU (issue order) and those with rows on the CPU (a CPU task, or a split task's rows
    [gpu_width, width)). ``copy_bytes(task)``: the target bytes a GPU task's prefix [0, gpu_width) copied, asked
    once per GPU task in issue order (the simulator asks its ledger there, the runtime reads the plan)."""
    jobs, gpu, cpu = [], [], []
    for i, task in enumerate(tasks):
        if task.on_cpu:
            jobs.append(window.hybrid_job(task.width, 0, 0, on_cpu=True))
            cpu.append(i)
            continue
        gpu_width = task.gpu_width
        jobs.append(window.hybrid_job(task.width, gpu_width, copy_bytes(task), on_cpu=False))
        gpu.append(i)
        if gpu_width < task.width:
            cpu.append(i)
    return jobs, gpu, cpu


class CopyClock:
    """The modeled clock of consecutive layer steps: :meth:`step` per layer step (its demanded jobs),
    then :meth:`span` for that step's prefetches; ``copy_free`` carries to the next step."""

    def __init__(self, window: PrefetchWindow) -> None:
        if not isinstance(window, PrefetchWindow):
            raise TypeError(f"CopyClock: expected a PrefetchWindow, got {type(window).__name__}")
        self.window = window
        self._span: PrefetchSpan | None = None
        self._end = 0.0

    @property
    def copy_free(self) -> float:
        """When the copy engine is free, relative to the next step's start (its last prefetch's spill)."""
        return 0.0 if self._span is None else max(0.0, self._span.cursor - self._end)

    def step(self, jobs: Sequence[Job]) -> StepTimes:
        """Time one layer step's demanded ``jobs`` (router order; run in Johnson's order) and open its
        prefetch span; the previous step's span closes."""
        lead = self.window.lead_s
        copy_free = self.copy_free
        end, slots = overlap_schedule(johnson_jobs(jobs), start=lead, copy_free=copy_free)
        demand_done = max([lead, copy_free] + [s.copy_end for s in slots if s.copy_end > s.copy_start])
        deadline = end + lead
        self._span = PrefetchSpan(self.window, demand_done, deadline)
        self._end = end
        return StepTimes(end, slots, demand_done, deadline)

    def hybrid_step(self, jobs: Sequence[HybridJob], gpu: Sequence[int], cpu: Sequence[int]) -> HybridTimes:
        """Time one layer step under a CPU placement (:func:`hybrid_times`) and open its prefetch span: from
        the step's end less its idle copy time (``lead + span - idle``: at the full rate the span holds what the
        engine copies at the busy rate while the step lasts, then at the full rate in attention, where the CPU
        computes no expert) to the next router's end (``lead + span + lead``). The previous span closes;
        no copy time carries into the next step (every prefetch copy ends by its router's end, where the next
        step's demanded copies start)."""
        if not self.window.has_cpu:
            raise ValueError(f"CopyClock.hybrid_step: window {self.window.name!r} has no CPU (cpu_bytes_per_s)")
        times = hybrid_times(self.window, jobs, gpu, cpu)
        lead = self.window.lead_s
        self._span = PrefetchSpan(self.window, lead + times.span - times.idle, lead + times.span + lead)
        self._end = lead + times.span
        return times

    @property
    def span(self) -> PrefetchSpan | None:
        """The prefetch span of the last step (None before the first)."""
        return self._span


@dataclass
class Admission:
    """What one batch of prefetch requests got (:func:`admit_requests`)."""

    issued: list[tuple[int, int, float, float]]  # (expert, new width, copy start, copy end); times 0 without span
    cut: bool = False  # the span ran out (in this batch or before it)
    cut_requests: int = 0  # requests copied short or not at all because the span ran out
    cut_rows: int = 0  # their rows not copied


def admit_requests(requests: Iterable[tuple[int, int]], have: Callable[[int], int],
                   issue: Callable[[int, int], object | None], span: PrefetchSpan | None) -> Admission:
    """Issue prefetch ``requests`` [(expert, width)] in order: each missing prefix through
    ``issue(expert, width)`` (a ``Decision`` with ``old_width`` / ``new_width``, or None when the
    budget rejected it). ``have(expert)``: the resident width now.

    With a ``span`` only the rows that arrive before its deadline are asked: a request that gets no
    row, or is admitted short, cuts the span and ends the batch (a span already cut admits nothing);
    a request the budget rejects used no copy time, so the next one is still tried. Without a span
    every request is asked in full (what the CPU, where copies take no time, did before windows).
    """
    out = Admission([])
    pending = list(requests)
    for i, (e, width) in enumerate(pending):
        old = have(e)
        if old >= width:
            continue
        missing = width - old
        rows = missing if span is None else span.rows(missing)
        if rows <= 0:
            _cut(out, span, missing, pending[i + 1:], have)
            return out
        decision = issue(e, old + rows)
        if decision is None:
            continue
        begin, end = (0.0, 0.0) if span is None else span.took(decision.new_width - decision.old_width)
        out.issued.append((e, decision.new_width, begin, end))
        if rows < missing:
            _cut(out, span, missing - rows, pending[i + 1:], have)
            return out
    return out


def _cut(out: Admission, span: PrefetchSpan, short: int, rest: list[tuple[int, int]],
         have: Callable[[int], int]) -> None:
    """The span ran out: the request in hand lacks ``short`` rows, every later one all it misses."""
    span.cut = out.cut = True
    out.cut_requests, out.cut_rows = 1, short
    for e, width in rest:
        missing = width - have(e)
        if missing > 0:
            out.cut_requests += 1
            out.cut_rows += missing
