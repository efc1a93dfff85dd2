"""Precision layouts of a pack's neuron rows: the less important neurons at fewer bits.

CRISP stores each expert's neurons in importance order, so that width k reads the first k. The
same order says which neurons tolerate a coarser grid: a *tail layout* keeps the head in the
pack's 4-bit format and stores later row ranges at 3 or 2 bits (groups along H, an fp16 scale
and a uint8 zero point per group, as the 4-bit format). A width-k prefix is still one prefix of
rows; its bytes are piecewise linear in k.

    segments ((start, bits, group_size), ...): rows [start * I, next start * I) at ``bits``;
    rows before the first start are the pack's 4-bit rows.

Measured on the tiny trained Mixtral (docs/serving-and-residency.md; 128 held-out
windows): the full width of ``m432`` (25% 4-bit, 25% 3-bit g64, 50% 2-bit g128: 69.3% of the 4-bit
bytes at H = 4096) loses 0.24% of next-token accuracy against 4-bit; at CRISP's plan widths its tail
costs 0.6-0.8 point on top of the plan's own loss.

Status: every layout is simulated (``crisp-bench simulate --tail-layout``) and its accuracy can be
emulated inside the 4-bit format (``crisp_tools.tail_emulation``). One family is also a pack format:
``2gG@F`` (one 2-bit segment, groups twice the pack's), stored as two neurons per 4-bit row
(``crisp_kernels.format``, "2-bit tail rows"; ``crisp_tools.tail_pack``); 3-bit rows are not stored.
This module is the one definition of the layouts' bytes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .format import BITS, NUM_PROJ, SCALE_DTYPE

TAIL_BITS = (2, 3)
TAIL_GROUP_SIZES = (64, 128)
_ZERO_NBYTES = 1  # one uint8 zero point per group, as the 4-bit format


@dataclass(frozen=True)
class TailSegment:
    """Rows from ``start`` (a fraction of I) to the next segment's start at ``bits``, groups of ``group_size``."""

    start: float
    bits: int
    group_size: int

    def __post_init__(self) -> None:
        if isinstance(self.start, bool) or not isinstance(self.start, (int, float)) or not 0.0 <= self.start < 1.0:
            raise ValueError(f"TailSegment.start: expected a fraction of I in [0, 1), got {self.start!r}")
        if type(self.bits) is not int or self.bits not in TAIL_BITS:
            raise ValueError(f"TailSegment.bits: expected one of {TAIL_BITS}, got {self.bits!r}")
        if type(self.group_size) is not int or self.group_size not in TAIL_GROUP_SIZES:
            raise ValueError(f"TailSegment.group_size: expected one of {TAIL_GROUP_SIZES}, got {self.group_size!r}")


def neuron_nbytes(hidden_size: int, bits: int, group_size: int) -> int:
    """Bytes of one neuron (gate row, up row, down column) at ``bits`` with groups of ``group_size``."""
    if hidden_size <= 0 or hidden_size % group_size or (hidden_size * bits) % 8:
        raise ValueError(f"hidden size H={hidden_size} must be a positive multiple of group_size={group_size} "
                         f"holding whole bytes at {bits} bits")
    groups = hidden_size // group_size
    return NUM_PROJ * (hidden_size * bits // 8 + groups * (SCALE_DTYPE.itemsize + _ZERO_NBYTES))


@dataclass(frozen=True)
class TailLayout:
    """A named precision layout (see the module docstring). No segments = the plain 4-bit pack."""

    name: str
    segments: tuple[TailSegment, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not re.fullmatch(r"[A-Za-z0-9_.+-]+", self.name):
            raise ValueError(f"TailLayout.name: expected letters, digits and _.+- only, got {self.name!r}")
        segs = tuple(self.segments)
        if not all(isinstance(s, TailSegment) for s in segs):
            raise TypeError("TailLayout.segments: expected TailSegment items")
        starts = [s.start for s in segs]
        if any(b <= a for a, b in zip(starts, starts[1:], strict=False)):
            raise ValueError(f"TailLayout.segments: starts must increase strictly, got {starts}")
        object.__setattr__(self, "segments", segs)

    @property
    def is_plain(self) -> bool:
        return not self.segments

    def row_ranges(self, intermediate_size: int) -> list[tuple[int, int, int, int]]:
        """(first row, end row, bits, group_size) covering [0, I), the 4-bit head first (possibly empty
        ranges dropped). A segment's start row is ``round(start * I)``."""
        inter = intermediate_size
        bounds = [round(s.start * inter) for s in self.segments] + [inter]
        out = [(0, bounds[0], BITS, 0)] if self.segments else [(0, inter, BITS, 0)]
        for seg, lo, hi in zip(self.segments, bounds, bounds[1:], strict=False):
            out.append((lo, hi, seg.bits, seg.group_size))
        return [r for r in out if r[1] > r[0]]

    def prefix_nbytes(self, width: int, intermediate_size: int, hidden_size: int, head_nbytes: int) -> int:
        """Bytes of the first ``width`` rows; ``head_nbytes``: one 4-bit neuron of the pack's format."""
        if isinstance(width, bool) or not isinstance(width, int) or not 0 <= width <= intermediate_size:
            raise ValueError(f"width must be an integer in [0, {intermediate_size}], got {width!r}")
        total = 0
        for lo, hi, bits, group in self.row_ranges(intermediate_size):
            rows = max(0, min(width, hi) - lo)
            total += rows * (head_nbytes if bits == BITS else neuron_nbytes(hidden_size, bits, group))
        return total

    def full_fraction(self, intermediate_size: int, hidden_size: int, head_nbytes: int) -> float:
        """A full-width expert's bytes over the 4-bit expert's."""
        return (self.prefix_nbytes(intermediate_size, intermediate_size, hidden_size, head_nbytes)
                / (intermediate_size * head_nbytes))

    def spec(self) -> str:
        """The layout as ``parse_tail_layout`` reads it (``q4`` for the plain pack)."""
        if self.is_plain:
            return "q4"
        return ",".join(f"{s.bits}g{s.group_size}@{s.start:g}" for s in self.segments)

    def to_dict(self) -> dict:
        return {"name": self.name, "segments": [[s.start, s.bits, s.group_size] for s in self.segments]}


PLAIN = TailLayout("q4")
# 25% 4-bit, 25% 3-bit g64, 50% 2-bit g128: 69.3% of the 4-bit bytes at H = 4096, g64.
M432 = TailLayout("m432", (TailSegment(0.25, 3, 64), TailSegment(0.5, 2, 128)))
# 50% 4-bit, 50% 2-bit g128: 75.0%.
M42 = TailLayout("m42", (TailSegment(0.5, 2, 128),))
# Every row at 3 bits, g64 (77.1%): a uniform low-bit pack, the comparison for an importance-ordered tail.
Q3 = TailLayout("q3", (TailSegment(0.0, 3, 64),))
TAIL_LAYOUTS = {layout.name: layout for layout in (PLAIN, M432, M42, Q3)}

_SEGMENT = re.compile(r"([23])g(64|128)@([0-9]*\.?[0-9]+)")


def parse_tail_layout(spec: str) -> TailLayout:
    """A preset name (``q4``, ``m432``, ``m42``, ``q3``) or ``BITSgGROUP@START,...``, e.g. ``3g64@0.25,2g128@0.5``
    (rows before the first start stay 4-bit). ValueError naming what is wrong."""
    if not isinstance(spec, str):
        raise TypeError(f"tail layout: expected a string, got {type(spec).__name__}")
    if spec in TAIL_LAYOUTS:
        return TAIL_LAYOUTS[spec]
    segments = []
    for part in spec.split(","):
        m = _SEGMENT.fullmatch(part.strip())
        if m is None:
            raise ValueError(f"tail layout {spec!r}: {part!r} is not BITSgGROUP@START (bits 2 or 3, group 64 or "
                             f"128, start a fraction in [0, 1)); presets: {', '.join(TAIL_LAYOUTS)}")
        start = float(m.group(3))
        if not math.isfinite(start):
            raise ValueError(f"tail layout {spec!r}: start {m.group(3)!r} is not a number")
        segments.append(TailSegment(start, int(m.group(1)), int(m.group(2))))
    layout = TailLayout("custom", tuple(segments))
    return TailLayout(layout.spec().replace(",", "+").replace("@", "at"), layout.segments)
