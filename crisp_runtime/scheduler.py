"""The scheduler: per layer step, what each expert must be resident at, what is missing, and the order.

Pure code on small CPU tensors, separate from issuing copies (``executor.py``), so it is
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
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# Above this many routed (token, expert) slots the grouping runs as tensor ops; below, plain Python
# (decode steps), which is several times faster for a handful of slots.
_PYTHON_PATH_MAX_SLOTS = 64


class TaskOrder(enum.Enum):
    """The order a layer step's experts are issued in."""

    JOHNSON = "widest_first"  # Johnson's rule: resident first, then widest first (minimal makespan)
    ROUTER = "router"  # first appearance in the routing (token-major, slot order): the naive order


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

    def load_time(self, nbytes: int) -> float:
        return nbytes / self.h2d_bytes_per_s

    def compute_time(self, nbytes: int, tokens: int) -> float:
        return nbytes / self.device_bytes_per_s * max(1.0, tokens / self.ridge_tokens)


@dataclass(frozen=True)
class ExpertTask:
    """One expert of a layer step."""

    expert: int
    width: int  # the width it must be resident at: the largest any of its tokens needs
    resident_width: int  # width resident before the step (0 = not cached)
    copy_bytes: int  # bytes of the missing rows resident_width..width (0 if already wide enough)
    tokens: int
    start: int  # its slots are flat_pos[start:stop] of the StepPlan
    stop: int
    load_time: float
    compute_time: float


@dataclass(frozen=True)
class StepPlan:
    """What one layer step runs, in order.

    ``flat_pos[start:stop]`` are the flat (token * k + slot) positions of each task's routed
    slots, ``flat_widths`` the per-token widths at those positions (all > 0).
    """

    tasks: tuple[ExpertTask, ...]
    flat_pos: torch.Tensor  # (n,) int64
    flat_widths: torch.Tensor  # (n,) int64
    num_tokens: int
    top_k: int
    bytes_missing: int
    bytes_read: int  # Σ over tasks of nbytes(width): what a cache-less offload copies
    bytes_routed: int  # Σ over active slots of nbytes(token width)
    skipped: int  # routed slots of width 0 (or invalid expert ids)
    extra: dict = field(default_factory=dict, compare=False)


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
) -> StepPlan:
    """Group the routed slots of one layer step by expert and order the experts.

    top_k_index: (T, k) expert ids (CPU); widths: (T, k) width each slot needs (CPU int64,
    ``CrispPlan.token_widths``); ids outside [0, E) and widths of 0 are skipped.
    resident_width(e): width of expert e's prefix resident now (0 if none).
    order: Johnson's rule (default) or router order (for benchmarks comparing the two).
    """
    if top_k_index.shape != widths.shape or top_k_index.dim() != 2:
        raise ValueError(
            f"plan_step: top_k_index and widths must both be (T, k), got {tuple(top_k_index.shape)} "
            f"and {tuple(widths.shape)}"
        )
    num_tokens, k = top_k_index.shape
    if num_tokens * k <= _PYTHON_PATH_MAX_SLOTS:
        groups = _group_python(top_k_index, widths, num_experts, k)
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
    if order is TaskOrder.JOHNSON:
        seq = johnson_order(load, compute)
    elif order is TaskOrder.ROUTER:
        seq = sorted(range(len(experts)), key=first.__getitem__)
    else:
        raise ValueError(f"plan_step: order must be a TaskOrder, got {order!r}")

    tasks = []
    start = 0
    for i in seq:
        stop = start + counts[i]
        tasks.append(ExpertTask(experts[i], required[i], residents[i], copy_bytes[i], counts[i], start, stop,
                                load[i], compute[i]))
        start = stop
    if isinstance(pos_parts, list):  # python path: flat lists per expert
        flat_pos = torch.tensor([p for i in seq for p in pos_parts[i]], dtype=torch.int64)
        flat_widths = torch.tensor([w for i in seq for w in w_parts[i]], dtype=torch.int64)
    else:  # tensor path: one permutation of the expert-sorted slots
        flat_pos, flat_widths, seg_start = pos_parts
        if seq == list(range(len(seq))):
            perm = None
        else:
            perm = torch.cat([torch.arange(seg_start[i], seg_start[i] + counts[i]) for i in seq])
        if perm is not None:
            flat_pos, flat_widths = flat_pos[perm], flat_widths[perm]
    return StepPlan(
        tasks=tuple(tasks),
        flat_pos=flat_pos,
        flat_widths=flat_widths,
        num_tokens=num_tokens,
        top_k=k,
        bytes_missing=sum(copy_bytes),
        bytes_read=sum(required) * neuron_nbytes,
        bytes_routed=sum(width_sums) * neuron_nbytes,
        skipped=skipped,
    )


def _group_python(top_k_index, widths, num_experts, k):
    pos_by_e: dict[int, list[int]] = {}
    w_by_e: dict[int, list[int]] = {}
    flat_e = [v for row in top_k_index.tolist() for v in row]  # no reshape: one dispatch less each
    flat_w = [v for row in widths.tolist() for v in row]
    for p, (e, w) in enumerate(zip(flat_e, flat_w, strict=True)):
        if w > 0 and 0 <= e < num_experts:
            if e in pos_by_e:
                pos_by_e[e].append(p)
                w_by_e[e].append(w)
            else:
                pos_by_e[e] = [p]
                w_by_e[e] = [w]
    experts = sorted(pos_by_e)
    required = [max(w_by_e[e]) for e in experts]
    counts = [len(pos_by_e[e]) for e in experts]
    width_sums = [sum(w_by_e[e]) for e in experts]
    first = [pos_by_e[e][0] for e in experts]
    return (experts, required, counts, width_sums, [pos_by_e[e] for e in experts], [w_by_e[e] for e in experts],
            first)


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
