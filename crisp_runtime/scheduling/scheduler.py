"""The scheduler: per layer step, what each expert must be resident at, what is missing, and the order.

Pure code on small CPU tensors, separate from issuing copies (``runtime.py``), so it is
tested on the CPU against brute force.

Loading and computing the experts of one layer step one after another is a two-stage flow
shop: stage 1 is the copy engine (host-to-device copy of the missing prefix rows), stage 2 the
SMs (the expert's kernels). Its makespan is minimised by Johnson's rule: first the jobs whose
load is shorter than their compute, by increasing load (cached experts, load 0, come first);
then the others by decreasing compute, i.e. **widest first**, so that the last, unhidden
compute is the narrowest one.

The load/compute times come from a :class:`CostModel` (bytes over measured bandwidths). Only
their order matters; on any real GPU a missing prefix loads far slower than it computes, so
the result is "resident experts first, then widest first".

Three resources (``Placement``): an expert can also be computed on the host CPU from
host memory (its prefix rows only), concurrently with the GPU's copies and kernels; it is then
not copied. Per step :func:`split_step` chooses the CPU subset and the GPU order of minimal
makespan ``max(GPU flow shop, CPU sum + join)`` where, when the CPU works at all, every copy of
the step runs at the reduced H2D rate (the CPU and the copy engine share host memory; modelled
for the whole step, an upper bound on the copy time, so a split is never chosen on a rate it
will not get). For a fixed CPU subset the GPU part is an F2 flow shop with fixed times, so
Johnson's rule is optimal for it, and enumerating the 2^n subsets is an exact search; it runs up
to :data:`EXACT_MAX_EXPERTS` experts (a decode step has top_k), beyond that a greedy local search
(documented in :func:`split_step`). Tests check both against brute force over every split and
every order.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from crisp_runtime.scheduling.slot_values import SlotValues

# Above this many routed (token, expert) slots the grouping runs as tensor ops; below, plain Python
# (decode steps), which is several times faster for a handful of slots.
_PYTHON_PATH_MAX_SLOTS = 64


class TaskOrder(enum.Enum):
    """The order a layer step's experts are issued in."""

    JOHNSON = "widest_first"  # Johnson's rule: resident first, then widest first (minimal makespan)
    ROUTER = "router"  # first appearance in the routing (token-major, slot order): the naive order


class Placement(enum.Enum):
    """Where a layer step's routed experts are computed (the serving policy's ``placement``)."""

    GPU = "gpu"  # every expert on the GPU, resident or after a copy (the default)
    HYBRID = "hybrid"  # per step, the GPU / CPU split of minimal makespan (split_step)
    STATIC = "static_hybrid"  # resident experts on the GPU, every other on the CPU, nothing copied
    CPU = "cpu_only"  # every expert on the CPU from host memory
    # HYBRID plus the neuron split (split_rows): an expert's rows [0, s) on the GPU (a resident prefix,
    # widened by a copy or not) and rows [s, width) on the CPU, the two partial outputs added (exact).
    SPLIT = "hybrid_split"

    @property
    def uses_cpu(self) -> bool:
        return self is not Placement.GPU


# Exact split search (2^n CPU subsets x Johnson) up to this many experts in one step: 2^12 = 4096
# subsets is ~20 ms of Python, still below one prefill step's copies; decode steps have top_k (2-8).
EXACT_MAX_EXPERTS = 12


@dataclass(frozen=True)
class CostModel:
    """Rough times of the two stages, for ordering only.

    load = bytes copied / ``h2d_bytes_per_s``; compute = prefix bytes / ``device_bytes_per_s``
    (decode is memory-bound), scaled by ``tokens / ridge_tokens`` once an expert has more tokens
    than the ridge point (then it is compute-bound).
    """

    h2d_bytes_per_s: float = 25e9
    device_bytes_per_s: float = 1e12
    ridge_tokens: int = 64
    # The host CPU (hybrid placement, ``split_step``): GB/s of prefix bytes its expert kernel
    # streams at batch 1, a fixed time per expert call, its ridge point in tokens, the H2D rate
    # while it streams host memory at the same time (ANCHORS: 25 -> ~15 GB/s on a 4090 desktop;
    # None = unchanged) and the fixed cost of joining its (T, H) partial output into the GPU
    # accumulator (one small copy). ``cpu_bytes_per_s=None``: no CPU (every expert on the GPU).
    cpu_bytes_per_s: float | None = None
    cpu_latency_s: float = 0.0
    # a number of tokens >= 1, not only whole ones: the native kernel measured t(T) / t(1) = 1.26 / 1.78 / 3.21 /
    # 6.28 at T = 2 / 4 / 8 / 16 on a 2-core Zen 4 VM (a ridge of ~2.5; docs/cpu-kernel.md);
    # cpu='on' / 'auto' measures it, with the bandwidth, where the configuration gives no CPU bandwidth
    cpu_ridge_tokens: float = 4.0
    h2d_bytes_per_s_cpu_busy: float | None = None
    join_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("h2d_bytes_per_s", "device_bytes_per_s", "cpu_bytes_per_s", "h2d_bytes_per_s_cpu_busy"):
            v = getattr(self, name)
            if v is None and name in ("cpu_bytes_per_s", "h2d_bytes_per_s_cpu_busy"):
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"CostModel: {name} must be a positive number of bytes per second, got {v!r}")
        for name in ("cpu_latency_s", "join_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"CostModel: {name} must be a non-negative number of seconds, got {v!r}")
        v = self.ridge_tokens
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"CostModel: ridge_tokens must be a positive integer, got {v!r}")
        v = self.cpu_ridge_tokens
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 1:
            raise ValueError(f"CostModel: cpu_ridge_tokens must be a number of tokens >= 1, got {v!r}")

    @property
    def has_cpu(self) -> bool:
        return self.cpu_bytes_per_s is not None

    def load_time(self, nbytes: int) -> float:
        return nbytes / self.h2d_bytes_per_s

    def load_time_cpu_busy(self, nbytes: int) -> float:
        """Copy time while the CPU streams host memory (the reduced H2D rate)."""
        rate = self.h2d_bytes_per_s if self.h2d_bytes_per_s_cpu_busy is None else self.h2d_bytes_per_s_cpu_busy
        return nbytes / rate

    def compute_time(self, nbytes: int, tokens: int) -> float:
        return nbytes / self.device_bytes_per_s * max(1.0, tokens / self.ridge_tokens)

    def cpu_time(self, nbytes: int, tokens: int) -> float:
        """CPU time of one expert over a prefix of ``nbytes`` (inf without a CPU)."""
        if self.cpu_bytes_per_s is None:
            return math.inf
        if nbytes <= 0:
            return 0.0
        return self.cpu_latency_s + nbytes / self.cpu_bytes_per_s * max(1.0, tokens / self.cpu_ridge_tokens)


class ExpertTask(NamedTuple):
    """One expert of a layer step (a NamedTuple: a frozen dataclass of these fields took 4.7 us to
    build on the project's 2-core VM, this 0.9 us, and a decode step builds top_k of them)."""

    expert: int
    width: int  # the width it must be resident at: the largest any of its tokens needs
    resident_width: int  # width resident before the step (0 = not cached)
    copy_bytes: int  # bytes of the missing rows resident_width..width (0 if already wide enough)
    tokens: int
    start: int  # its slots are flat_pos[start:stop] of the StepPlan
    stop: int
    load_time: float
    compute_time: float
    on_cpu: bool = False  # computed on the host CPU from host memory (then copy_bytes == 0, nothing admitted)
    cpu_time: float = 0.0  # the cost model's CPU time of this expert (when the placement considered the CPU)
    # Neuron split (Placement.SPLIT): rows [0, split_at) on the GPU, rows [split_at, width) on the CPU
    # (0 < split_at < width; then on_cpu is False, copy_bytes/load_time/compute_time are the GPU
    # prefix's and cpu_time the CPU rows'). None: the whole expert on one side (on_cpu says which).
    split_at: int | None = None

    @property
    def gpu_width(self) -> int:
        """Rows [0, gpu_width) run on the GPU: the width the ledger is asked for (0: none)."""
        if self.split_at is not None:
            return self.split_at
        return 0 if self.on_cpu else self.width

    @property
    def cpu_rows(self) -> tuple[int, int] | None:
        """Rows [start, stop) the CPU computes (``row_start``/``width`` of the CPU kernel), or None."""
        g = self.gpu_width
        return (g, self.width) if g < self.width else None


class StepPlan(NamedTuple):
    """What one layer step runs, in order.

    ``flat_pos[start:stop]`` are the flat (token * k + slot) positions of each task's routed
    slots, ``flat_widths`` the per-token widths at those positions (all > 0): (n,) int64 tensors,
    built on first use from the Python lists a decode step is planned in (``pos_list`` and
    ``widths_list``, what the executor's decode path reads; ``slot_values.SlotValues``).
    A NamedTuple, like :class:`ExpertTask`: built once per layer step (a frozen dataclass of
    these fields took ~3.5 us to build on the project's 2-core VM).
    """

    tasks: tuple[ExpertTask, ...]
    slot_pos: SlotValues
    slot_widths: SlotValues
    num_tokens: int
    top_k: int
    bytes_missing: int
    bytes_read: int  # Σ over tasks of nbytes(width): what a cache-less offload copies
    bytes_routed: int  # Σ over active slots of nbytes(token width)
    skipped: int  # routed slots of width 0 (or invalid expert ids)
    extra: dict  # placement details (makespan, exact, split_rows); {} on the GPU placement

    @property
    def flat_pos(self) -> torch.Tensor:
        return self.slot_pos.tensor()

    @property
    def flat_widths(self) -> torch.Tensor:
        return self.slot_widths.tensor()

    @property
    def pos_list(self) -> list[int]:
        """``flat_pos`` as a Python list (do not modify it)."""
        return self.slot_pos.values()

    @property
    def widths_list(self) -> list[int]:
        """``flat_widths`` as a Python list (do not modify it)."""
        return self.slot_widths.values()


@dataclass(frozen=True)
class HybridJob:
    """One expert of a step for :func:`split_step` (seconds)."""

    load_s: float  # its copy at the full H2D rate (0 when resident wide enough)
    load_busy_s: float  # its copy while the CPU streams host memory (reduced rate)
    gpu_s: float  # its GPU kernels
    cpu_s: float  # its CPU kernel over its prefix rows in host memory


@dataclass(frozen=True)
class StepSplit:
    """A step's placement: GPU jobs in issue order, CPU jobs (run one after another), the makespan."""

    gpu: tuple[int, ...]
    cpu: tuple[int, ...]
    makespan: float
    exact: bool  # found by the exact search (False: the greedy heuristic beyond EXACT_MAX_EXPERTS)


def split_makespan(gpu_order, cpu_jobs, jobs, join_s: float = 0.0) -> float:
    """Makespan of one split: ``gpu_order`` as a flow shop (copies at the reduced rate when the CPU
    works), in parallel with the CPU's jobs back to back plus one join of its partial output."""
    busy = len(cpu_jobs) > 0
    load = [j.load_busy_s if busy else j.load_s for j in jobs]
    gpu = flow_shop_makespan(gpu_order, load, [j.gpu_s for j in jobs])
    cpu = sum(jobs[i].cpu_s for i in cpu_jobs) + join_s if busy else 0.0
    return max(gpu, cpu)


def _best_gpu_order(gpu: list[int], jobs, busy: bool) -> list[int]:
    load = [jobs[i].load_busy_s if busy else jobs[i].load_s for i in gpu]
    return [gpu[i] for i in johnson_order(load, [jobs[i].gpu_s for i in gpu])]


def split_step(jobs, *, placement: Placement = Placement.HYBRID, join_s: float = 0.0,
               exact_max: int = EXACT_MAX_EXPERTS) -> StepSplit:
    """The GPU / CPU split and GPU order of one step's ``jobs`` (list of :class:`HybridJob`).

    GPU: all on the GPU, Johnson order. CPU: all on the CPU. STATIC: the jobs with nothing to
    copy (``load_s == 0``) on the GPU, the others on the CPU. HYBRID: the split of minimal
    makespan (:func:`split_makespan`): with ``n <= exact_max`` jobs every CPU subset is tried with
    its GPU part in Johnson order (exact); ties go to fewer CPU jobs, then the smaller subset mask.
    Beyond, a greedy local search from each of four starts (all-GPU, all-CPU, STATIC's split, and the
    best prefix of the jobs by CPU / GPU time ratio): move the one job (GPU -> CPU or back) that lowers
    the makespan most, until no move does; the best result wins (so never worse than any of the fixed
    placements; a single start gets stuck
    because the first job moved to the CPU slows every copy; a test checks it against the exact
    search: on 900 random instances of 7-9 jobs it was optimal in 94%, at worst 1.27x the optimum).
    """
    n = len(jobs)
    if not isinstance(placement, Placement):
        raise ValueError(f"split_step: placement must be a Placement, got {placement!r}")
    if placement is Placement.GPU:
        order = _best_gpu_order(list(range(n)), jobs, False)
        return StepSplit(tuple(order), (), split_makespan(order, (), jobs, join_s), True)
    if placement is Placement.CPU:
        cpu = tuple(range(n))
        return StepSplit((), cpu, split_makespan((), cpu, jobs, join_s), True)
    if placement is Placement.STATIC:
        cpu = tuple(i for i in range(n) if jobs[i].load_s > 0)
        order = _best_gpu_order([i for i in range(n) if jobs[i].load_s <= 0], jobs, bool(cpu))
        return StepSplit(tuple(order), cpu, split_makespan(order, cpu, jobs, join_s), True)
    if n <= exact_max:
        # Johnson's rule orders each job by a key of its own (and its group by load < compute), so the
        # Johnson order of any subset is the whole set's Johnson order restricted to it: two orders
        # (idle / busy copy rate) computed once, then each subset costs O(n) with no sort (docs/hybrid.md).
        order_idle = _best_gpu_order(list(range(n)), jobs, False)
        order_busy = _best_gpu_order(list(range(n)), jobs, True)
        load_idle = [j.load_s for j in jobs]
        load_busy = [j.load_busy_s for j in jobs]
        gpu_s = [j.gpu_s for j in jobs]
        cpu_s = [j.cpu_s for j in jobs]
        best = None
        for mask in range(1 << n):
            if mask:
                order, load = order_busy, load_busy
                cpu_span = join_s + sum(cpu_s[i] for i in range(n) if mask >> i & 1)
            else:
                order, load, cpu_span = order_idle, load_idle, 0.0
            copy_done = compute_done = 0.0
            for i in order:
                if not mask >> i & 1:
                    copy_done += load[i]
                    compute_done = max(compute_done, copy_done) + gpu_s[i]
            key = (max(compute_done, cpu_span), mask.bit_count(), mask)
            if best is None or key < best:
                best = key
        span, _, mask = best
        order = order_busy if mask else order_idle
        return StepSplit(tuple(i for i in order if not mask >> i & 1),
                         tuple(i for i in range(n) if mask >> i & 1), span, True)

    def span_of(flags):
        cpu = [i for i in range(n) if flags[i]]
        order = _best_gpu_order([i for i in range(n) if not flags[i]], jobs, bool(cpu))
        return split_makespan(order, cpu, jobs, join_s), order, cpu

    def descend(on_cpu):
        span, order, cpu = span_of(on_cpu)
        while True:
            best = None
            for i in range(n):
                on_cpu[i] = not on_cpu[i]
                cand = span_of(on_cpu)
                on_cpu[i] = not on_cpu[i]
                if cand[0] < span and (best is None or cand[0] < best[1][0]):
                    best = (i, cand)
            if best is None:
                return span, order, cpu
            on_cpu[best[0]] = not on_cpu[best[0]]
            span, order, cpu = best[1]

    # Plus the best prefix of the jobs by CPU time over GPU time (copy at the reduced rate + kernels):
    # the jobs the CPU does relatively fastest go there first.
    by_ratio = sorted(range(n), key=lambda i: (jobs[i].cpu_s / max(jobs[i].load_busy_s + jobs[i].gpu_s, 1e-12), i))
    prefixes = []
    for m in range(n + 1):
        flags = [False] * n
        for i in by_ratio[:m]:
            flags[i] = True
        prefixes.append(flags)
    best_prefix = min(prefixes, key=lambda f: (span_of(f)[0], sum(f)))
    starts = ([False] * n, [True] * n, [j.load_s > 0 for j in jobs], best_prefix)
    span, order, cpu = min((descend(list(s)) for s in starts), key=lambda r: (r[0], len(r[2])))
    return StepSplit(tuple(order), tuple(cpu), span, False)


# ----------------------------------------------------------------------------- neuron split

# Neuron split search (split_rows) up to this many experts in one step (a Mixtral decode step has 2):
# 3^n anchor combinations plus n 3^(n-1) bisections; beyond, plan_step splits whole experts only.
SPLIT_MAX_EXPERTS = 3
# Split points are multiples of this many neurons (besides the anchors 0, the resident width and the
# width): the CPU kernel's int4pack block (crisp_kernels.cpu_expert.BLOCK_N). A start inside a block
# runs up to 63 neurons on its fp32 path, ~30x slower per byte (docs/cpu-kernel.md).
SPLIT_GRANULE = 64


@dataclass(frozen=True)
class RowJob:
    """One expert of a step for :func:`split_rows`: its width, resident prefix and per-row costs (s).

    GPU prefix of s rows: copy ``max(0, s - resident)`` rows (``load_row_s`` each, ``load_row_busy_s``
    while the CPU streams), then ``s * gpu_row_s`` of kernels. CPU suffix: ``cpu_fixed_s +
    (width - s) * cpu_row_s`` when ``s < width``, else nothing."""

    width: int
    resident: int
    load_row_s: float
    load_row_busy_s: float
    gpu_row_s: float
    cpu_row_s: float
    cpu_fixed_s: float = 0.0


@dataclass(frozen=True)
class RowSplit:
    """Per job the GPU prefix width s (0: all on the CPU; width: all on the GPU), the GPU issue order
    (jobs with s > 0), and the makespan."""

    gpu_widths: tuple[int, ...]
    gpu_order: tuple[int, ...]
    makespan: float


def row_split_makespan(jobs, widths, join_s: float = 0.0) -> tuple[float, list[int]]:
    """Makespan of GPU prefix widths ``widths`` (one per job) and the GPU order reaching it: the GPU
    part as a flow shop in Johnson order (optimal for fixed times; copies at the busy rate when any
    CPU rows run) in parallel with the CPU's rows back to back plus one join."""
    gpu, cpu, order = _row_times(jobs, widths, join_s)
    return max(gpu, cpu), order


def _row_times(jobs, widths, join_s):
    """(GPU flow shop makespan, CPU time (0 when no CPU rows), GPU order) of one split."""
    busy = False
    cpu = join_s
    for j, s in zip(jobs, widths, strict=True):
        if s < j.width:
            busy = True
            cpu += j.cpu_fixed_s + (j.width - s) * j.cpu_row_s
    first, second = [], []  # Johnson's rule, inline (the search evaluates ~50 splits per step)
    for i, (j, s) in enumerate(zip(jobs, widths, strict=True)):
        if s > 0:
            ld = (s - j.resident) * (j.load_row_busy_s if busy else j.load_row_s) if s > j.resident else 0.0
            gp = s * j.gpu_row_s
            if ld < gp:
                first.append((ld, -gp, i, ld, gp))
            else:
                second.append((-gp, i, ld, gp))
    first.sort()
    second.sort()
    copy_done = compute_done = 0.0
    order = []
    for *_, i, ld, gp in first:
        copy_done += ld
        compute_done = max(compute_done, copy_done) + gp
        order.append(i)
    for _, i, ld, gp in second:
        copy_done += ld
        compute_done = max(compute_done, copy_done) + gp
        order.append(i)
    return compute_done, (cpu if busy else 0.0), order


@functools.lru_cache(maxsize=1 << 14)
def split_rows(jobs: tuple[RowJob, ...], *, join_s: float = 0.0, granule: int = SPLIT_GRANULE,
               max_copy_rows: int | None = None) -> RowSplit:
    """The GPU prefix width of each job (the rest of its rows on the CPU) of small makespan.

    Candidates per job: the anchors 0 (all on the CPU), its resident width (no copy, the CPU the
    suffix) and its width (all on the GPU), and multiples of ``granule`` in between. The search:

    1. every combination of anchors (3^n): this includes every whole-expert split, so the result is
       never worse than :func:`split_step`'s HYBRID optimum on the same times;
    2. for each job f and each anchor combination of the others, the best s_f on the grid: on
       (0, width) the copy rate is the busy one, the GPU flow shop is nondecreasing in s_f (a longer
       job never shortens an optimal F2 schedule) and the CPU time decreasing, so the makespan is
       minimal where they cross; both are piecewise linear in s_f, so the crossing is found by
       regula falsi on the grid (a bracket of grid points, 2 evaluations per round);
    3. from the best so far, step 2 per job with the others at their best values (coordinate descent,
       at most 3 rounds).

    Step 2 finds optima with at most one job split at an interior point; an optimum with two (both
    paths of the flow shop and the CPU tight) is missed by coordinate descent: the search is **not
    exact**. Measured against brute force over the whole grid (tests/test_hybrid_scheduler.py): at the
    profile's rates within 2.5% of the optimum, on random rates within 16% (docs/hybrid.md).

    jobs: a tuple of :class:`RowJob` (hashable: results are memoised, a pure function; decode steps
    repeat the same widths and residencies).
    max_copy_rows: None, or at most this many rows copied in the step, over all jobs (the sum of
    ``max(0, s - resident)``): the neuron split's transient buffer (``ServingPolicy.transient_buffer``).
    A job's "all on the GPU" anchor is then its widest prefix the cap allows alone (a multiple of
    ``granule``, at least its resident width), and splits over the cap are never chosen. Splitting only
    the copied rows keeps the all-on-the-CPU split always feasible.
    """
    n = len(jobs)
    if not isinstance(granule, int) or isinstance(granule, bool) or granule < 1:
        raise ValueError(f"split_rows: granule must be a positive int, got {granule!r}")
    cap = max_copy_rows
    if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 0):
        raise ValueError(f"split_rows: max_copy_rows must be None or an int >= 0, got {cap!r}")
    if n == 0:
        return RowSplit((), (), 0.0)
    resident = [min(max(j.resident, 0), j.width) for j in jobs]

    def widest(j, r):
        """The widest GPU prefix of one job the cap allows alone."""
        if cap is None or j.width - r <= cap:
            return j.width
        return max(r, (r + cap) // granule * granule)

    anchors = [sorted({0, r, widest(j, r)}) for j, r in zip(jobs, resident, strict=True)]
    best_span, best = math.inf, None

    def copied(widths, skip=-1):
        return sum(max(0, s - r) for i, (s, r) in enumerate(zip(widths, resident, strict=True)) if i != skip)

    def consider(widths):
        """Evaluate a split, keep it if best (and within the cap); returns GPU - CPU (the crossing's sign)."""
        nonlocal best_span, best
        gpu, cpu, _ = _row_times(jobs, widths, join_s)
        span = max(gpu, cpu)
        if cap is not None and copied(widths) > cap:
            return gpu - cpu
        if span < best_span - 1e-15 or (span <= best_span + 1e-15 and best is not None
                                         and sum(widths) > sum(best)):  # ties: more rows on the GPU
            best_span, best = span, list(widths)
        return gpu - cpu

    def line(widths, f):
        """Job f's crossing on the grid points granule * m, 1 <= m <= top (all < width), others fixed."""
        top = (jobs[f].width - 1) // granule
        if cap is not None:  # no further than the rows the others leave in the cap
            top = min(top, (resident[f] + cap - copied(widths, skip=f)) // granule)
        if top < 1:
            return
        widths = list(widths)

        def h(m):
            widths[f] = m * granule
            return consider(widths)

        lo, hi = 1, top
        h_lo = h(lo)
        if h_lo >= 0 or lo == hi:
            return
        h_hi = h(hi)
        while h_hi >= 0 and hi - lo > 1:  # h(lo) < 0 <= h(hi): the first m with h(m) >= 0 is in (lo, hi]
            m = lo + int((hi - lo) * (-h_lo) / (h_hi - h_lo))
            m = min(max(m, lo + 1), hi - 1)
            h_m = h(m)
            if h_m >= 0:
                hi, h_hi = m, h_m
                continue
            lo, h_lo = m, h_m
            if hi - lo > 1:
                h_n = h(m + 1)
                if h_n >= 0:
                    return
                lo, h_lo = m + 1, h_n

    for combo in _product(anchors):
        consider(combo)
    for f in range(n):
        for combo in _product([a if i != f else [0] for i, a in enumerate(anchors)]):
            line(combo, f)
    for _ in range(3):
        before = best_span
        for f in range(n):
            line(best, f)
        if best_span >= before - 1e-15:
            break
    span, order = row_split_makespan(jobs, best, join_s)
    return RowSplit(tuple(best), tuple(order), span)


def _product(choices):
    out = [[]]
    for c in choices:
        out = [p + [v] for p in out for v in c]
    return out


def johnson_order(load: list[float], compute: list[float]) -> list[int]:
    """Johnson's rule for the two-stage flow shop F2||Cmax: an order of minimal makespan."""
    n = len(load)
    first = [i for i in range(n) if load[i] < compute[i]]
    second = [i for i in range(n) if load[i] >= compute[i]]
    first.sort(key=lambda i: (load[i], -compute[i], i))
    second.sort(key=lambda i: (-compute[i], i))
    return first + second


def flow_shop_makespan(order, load, compute) -> float:
    """Makespan of ``order``: copies back to back; each compute after its copy and the previous compute."""
    copy_done = 0.0
    compute_done = 0.0
    for i in order:
        copy_done += load[i]
        compute_done = max(compute_done, copy_done) + compute[i]
    return compute_done


def plan_step(
    top_k_index: torch.Tensor,
    widths: torch.Tensor,
    *,
    num_experts: int,
    neuron_nbytes: int,
    resident_width: Callable[[int], int],
    cost: CostModel = CostModel(),
    order: TaskOrder = TaskOrder.JOHNSON,
    placement: Placement = Placement.GPU,
    split_granule: int = SPLIT_GRANULE,
    max_copy_rows: int | None = None,
) -> StepPlan:
    """Group the routed slots of one layer step by expert and order the experts.

    top_k_index: (T, k) expert ids (CPU); widths: (T, k) width each slot needs (CPU int64,
    ``CrispPlan.token_widths``); ids outside [0, E) and widths of 0 are skipped. Both may instead be
    ``SlotValues`` of shape (T, k) holding Python lists (a decode step planned in Python by
    ``serving.plan_served_step``: no tensor is built for it).
    resident_width(e): width of expert e's prefix resident now (0 if none).
    order: Johnson's rule (default) or router order (for benchmarks comparing the two).
    placement: GPU (default: every expert on the GPU) or a placement using the host CPU
    (:func:`split_step` on the cost model's times; needs ``cost.cpu_bytes_per_s``): the GPU tasks
    come first in issue order, then the CPU tasks (``on_cpu``, nothing copied for them).
    Placement.SPLIT (up to :data:`SPLIT_MAX_EXPERTS` experts; whole experts as HYBRID beyond): per
    expert the GPU prefix width of :func:`split_rows`; a task split inside (``split_at``) is a GPU
    task (its prefix, ``copy_bytes`` the rows missing below ``split_at``) whose rows
    ``[split_at, width)`` the CPU computes (``ExpertTask.cpu_rows``). split_granule: split points
    are multiples of it, in this call's neuron units (:data:`SPLIT_GRANULE`). max_copy_rows: under
    Placement.SPLIT, at most this many rows copied in the step (the transient buffer; ``split_rows``).
    """
    if not isinstance(placement, Placement):
        raise ValueError(f"plan_step: placement must be a Placement, got {placement!r}")
    uses_cpu = placement.uses_cpu  # an enum property (~0.8 us): read once per step
    if uses_cpu and not cost.has_cpu:
        raise ValueError(f"plan_step: placement {placement.value!r} needs a CostModel with cpu_bytes_per_s")
    if top_k_index.shape != widths.shape or len(top_k_index.shape) != 2:
        raise ValueError(
            f"plan_step: top_k_index and widths must both be (T, k), got {tuple(top_k_index.shape)} "
            f"and {tuple(widths.shape)}"
        )
    num_tokens, k = top_k_index.shape
    if isinstance(widths, SlotValues) and isinstance(top_k_index, SlotValues):  # planned in Python: no tensors
        groups = _group_python(top_k_index.values(), widths.values(), num_experts)
    elif num_tokens * k <= _PYTHON_PATH_MAX_SLOTS:
        # nested tolist + flatten in Python: a reshape per tensor is one more dispatch (~1 us each)
        groups = _group_python([v for row in top_k_index.tolist() for v in row],
                               [v for row in widths.tolist() for v in row], num_experts)
    else:
        groups = _group_tensor(top_k_index, widths, num_experts)
    # groups: experts (ascending ids), required width, slot count, routed width sum, positions, widths, first slot
    experts, required, counts, width_sums, pos_parts, w_parts, first = groups
    active = sum(counts)
    skipped = num_tokens * k - active
    residents = [resident_width(e) for e in experts]
    copy_bytes = [max(0, w - r) * neuron_nbytes for w, r in zip(required, residents, strict=True)]
    load = [cost.load_time(b) for b in copy_bytes]
    compute = [cost.compute_time(w * neuron_nbytes, n) for w, n in zip(required, counts, strict=True)]
    cpu_set: frozenset = frozenset()
    cpu_times = None
    split_at: dict[int, int] = {}  # Placement.SPLIT: group index -> GPU prefix width, for the split ones
    extra = {}
    if placement is Placement.SPLIT and len(experts) <= SPLIT_MAX_EXPERTS:
        lat = cost.cpu_latency_s
        busy_rate = cost.h2d_bytes_per_s if cost.h2d_bytes_per_s_cpu_busy is None else cost.h2d_bytes_per_s_cpu_busy
        jobs = [RowJob(w, r, neuron_nbytes / cost.h2d_bytes_per_s, neuron_nbytes / busy_rate,
                       cost.compute_time(neuron_nbytes, n), cost.cpu_time(neuron_nbytes, n) - lat, lat)
                for w, r, n in zip(required, residents, counts, strict=True)]
        rsplit = split_rows(tuple(jobs), join_s=cost.join_s, granule=split_granule, max_copy_rows=max_copy_rows)
        gw = rsplit.gpu_widths
        cpu_set = frozenset(i for i in range(len(experts)) if gw[i] == 0)
        split_at = {i: gw[i] for i in range(len(experts)) if 0 < gw[i] < required[i]}
        for i, g in split_at.items():
            copy_bytes[i] = max(0, g - residents[i]) * neuron_nbytes
            load[i] = cost.load_time(copy_bytes[i])
            compute[i] = cost.compute_time(g * neuron_nbytes, counts[i])
        cpu_times = [0.0 if gw[i] >= required[i] else cost.cpu_time((required[i] - gw[i]) * neuron_nbytes, counts[i])
                     for i in range(len(experts))]
        extra = {"makespan": rsplit.makespan, "exact": False, "split_rows": True}
        if order is TaskOrder.JOHNSON:
            seq = list(rsplit.gpu_order) + sorted(cpu_set)
        else:
            seq = sorted(range(len(experts)), key=first.__getitem__)
            seq = [i for i in seq if i not in cpu_set] + [i for i in seq if i in cpu_set]
    elif uses_cpu:
        cpu_times = [cost.cpu_time(w * neuron_nbytes, n) for w, n in zip(required, counts, strict=True)]
        jobs = [HybridJob(lt, cost.load_time_cpu_busy(b), ct, pt)
                for lt, b, ct, pt in zip(load, copy_bytes, compute, cpu_times, strict=True)]
        # SPLIT beyond SPLIT_MAX_EXPERTS (prefill): whole experts, as HYBRID
        split = split_step(jobs, placement=Placement.HYBRID if placement is Placement.SPLIT else placement,
                           join_s=cost.join_s)
        cpu_set = frozenset(split.cpu)
        extra = {"makespan": split.makespan, "exact": split.exact}
        if order is TaskOrder.JOHNSON:
            seq = list(split.gpu) + list(split.cpu)
        else:
            seq = sorted(range(len(experts)), key=first.__getitem__)
            seq = [i for i in seq if i not in cpu_set] + [i for i in seq if i in cpu_set]
    elif order is TaskOrder.JOHNSON:
        seq = johnson_order(load, compute)
    elif order is TaskOrder.ROUTER:
        seq = sorted(range(len(experts)), key=first.__getitem__)
    else:
        raise ValueError(f"plan_step: order must be a TaskOrder, got {order!r}")

    tasks = []
    start = 0
    for i in seq:
        stop = start + counts[i]
        if i in cpu_set:
            tasks.append(ExpertTask(experts[i], required[i], residents[i], 0, counts[i], start, stop, 0.0,
                                    compute[i], True, cpu_times[i]))
        else:
            tasks.append(ExpertTask(experts[i], required[i], residents[i], copy_bytes[i], counts[i], start, stop,
                                    load[i], compute[i], False, 0.0 if cpu_times is None else cpu_times[i],
                                    split_at.get(i)))
        start = stop
    if isinstance(pos_parts, list):  # python path: flat lists per expert (tensors built when first read)
        flat_pos = [p for i in seq for p in pos_parts[i]]
        flat_widths = [w for i in seq for w in w_parts[i]]
    else:  # tensor path: one permutation of the expert-sorted slots
        flat_pos, flat_widths, seg_start = pos_parts
        if seq == list(range(len(seq))):
            perm = None
        else:
            perm = torch.cat([torch.arange(seg_start[i], seg_start[i] + counts[i]) for i in seq])
        if perm is not None:
            flat_pos, flat_widths = flat_pos[perm], flat_widths[perm]
    return StepPlan(  # positional (a NamedTuple's keyword call: 1.9 us against 0.9), in field order
        tuple(tasks),  # tasks
        SlotValues(flat_pos),  # slot_pos
        SlotValues(flat_widths),  # slot_widths
        num_tokens,
        k,  # top_k
        sum(b for i, b in enumerate(copy_bytes) if i not in cpu_set) if cpu_set else sum(copy_bytes),  # bytes_missing
        sum(required) * neuron_nbytes,  # bytes_read
        sum(width_sums) * neuron_nbytes,  # bytes_routed
        skipped,
        extra,
    )


def _group_python(flat_e: list[int], flat_w: list[int], num_experts: int):
    # One pass over the slots, one over the experts (each list comprehension is ~0.4 us more).
    groups: dict[int, tuple[list[int], list[int]]] = {}
    for p, e in enumerate(flat_e):
        w = flat_w[p]
        if w > 0 and 0 <= e < num_experts:
            g = groups.get(e)
            if g is None:
                groups[e] = ([p], [w])
            else:
                g[0].append(p)
                g[1].append(w)
    experts = sorted(groups)
    required, counts, width_sums, pos_parts, w_parts, first = [], [], [], [], [], []
    for e in experts:
        ps, ws = groups[e]
        required.append(max(ws))
        counts.append(len(ps))
        width_sums.append(sum(ws))
        pos_parts.append(ps)
        w_parts.append(ws)
        first.append(ps[0])
    return experts, required, counts, width_sums, pos_parts, w_parts, first


def _group_tensor(top_k_index, widths, num_experts):
    flat_e = top_k_index.reshape(-1).to(torch.int64)
    flat_w = widths.reshape(-1).to(torch.int64)
    active = (flat_w > 0) & (flat_e >= 0) & (flat_e < num_experts)
    pos = active.nonzero().squeeze(1)
    e_act = flat_e[pos]
    order = e_act.argsort(stable=True)
    pos_sorted = pos[order]
    e_sorted = e_act[order]
    w_sorted = flat_w[pos_sorted]
    experts_t, counts_t = torch.unique_consecutive(e_sorted, return_counts=True)
    required_t = torch.zeros(num_experts, dtype=torch.int64).scatter_reduce_(0, e_sorted, w_sorted, "amax")
    sums_t = torch.zeros(num_experts, dtype=torch.int64).index_add_(0, e_sorted, w_sorted)
    experts = experts_t.tolist()
    counts = counts_t.tolist()
    required = required_t[experts_t].tolist()
    width_sums = sums_t[experts_t].tolist()
    seg_start = [0]
    for c in counts[:-1]:
        seg_start.append(seg_start[-1] + c)
    # The stable sort keeps each expert's slots in position order: its first slot opens its segment.
    first = pos_sorted[seg_start].tolist() if counts else []
    return experts, required, counts, width_sums, (pos_sorted, w_sorted, seg_start), None, first
