"""The packed expert format: 4-bit, group-wise along H, stored neuron-major.

Neuron j of an expert owns three H-vectors: row j of gate, row j of up and column j of
down. Everything neuron j needs sits in row j of each tensor below, so the first k neurons
(the most important ones after CRISP's reordering) are one contiguous byte range per tensor:

    qweight  (W, 3, H // 2) uint8    [:, 0] gate row, [:, 1] up row, [:, 2] down column
    scales   (W, 3, H // g) fp16
    zeros    (W, 3, H // g) uint8    absent for the symmetric format (zero point 8)

A width-k load is three plain copies of ``nbytes(k)`` bytes in all; widening a resident
prefix from k to k' copies rows k..k' only. Groups run along H for all three vectors (down
is stored transposed), so reordering neurons never mixes quantization groups.

Nibble order: the low nibble holds the even element, the high nibble the odd one (the
convention of vLLM's W4A16 MoE kernels and of compressed-tensors).

Optional biases (gpt-oss): ``bias (W, 2) float32`` holds neuron j's gate bias and up bias in row
j, so a width-k prefix reads the first k rows like every other tensor; ``down_bias (H,) float32``
belongs to the expert, not to a neuron. A narrowed width drops neurons, not the down bias: an
expert slot run at any width k >= 1 adds its down bias once in full (the bias is the output at
k = 0 of the neurons' sum, ``down(h) + b``), while a slot at width 0 is skipped and adds nothing,
exactly as for the SiLU families. Packs without biases are unchanged, bit for bit.

The activation between the two stages is a property of the model, :class:`Activation`:
``SILU_GLU`` (``silu(gate) * up``, Mixtral / Qwen / DeepSeek) or gpt-oss's clamped SwiGLU
(``gate = min(gate, limit)``, ``up = clamp(up, -limit, limit)``,
``(up + 1) * gate * sigmoid(alpha * gate)``, alpha 1.702 and limit 7.0 in its config).

**2-bit tail rows** (``tail_start``, optional): CRISP's order says which neurons matter least, so
a pack may store its rows from ``tail_start`` on at 2 bits, groups of ``2 g``, asymmetric. Each such
*storage row* holds two neurons in exactly the bytes of one 4-bit row: row r >= tail_start of
qweight (3, H/2), scales (3, H/g) and zeros (3, H/g), read flat, is neurons 2(r - tail_start) and
2(r - tail_start) + 1 of the tail, each (3, H/4) codes, (3, H/2g) scales, (3, H/2g) zeros. So the
tail is a neuron-major 2-bit tensor (``PackedExpert.tail_tensors``) and every row of the pack
costs the same ``neuron_nbytes``: budgets, ledgers and copies count storage rows unchanged. A
width is then a number of storage rows: ``r`` rows hold ``neurons_in_rows(r, tail_start)`` neurons
(a last odd tail neuron is padded with zero weights, which add exactly 0). Byte b of a 2-bit
H-vector holds elements 4b + i in bits [2i, 2i + 2). Measured on the tiny trained Mixtral
(docs/serving-and-residency.md): 25% of the neurons 4-bit and the rest 2-bit g128 is
62.5% of the 4-bit bytes; tails are for asymmetric packs without biases (gpt-oss is refused).

Zero points are kept as one byte per group rather than packed to 4 bits: at H=4096, g=64
they are 192 of 6,720 bytes per neuron (2.9%); packing would save 1.4% of the bytes and
cost an extra unpack in every kernel.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

import torch

BITS = 4
BIAS_DTYPE = torch.float32
QMAX = (1 << BITS) - 1  # 15
SYMMETRIC_ZERO = 1 << (BITS - 1)  # 8
GROUP_SIZES = (32, 64, 128)
SCALE_DTYPE = torch.float16
# Smallest scale stored, so that an all-zero group never divides by zero. It must survive the
# cast to fp16: 2**-24 is fp16's smallest subnormal (a floor of 1e-8 rounded to a 0 scale).
_MIN_SCALE = 2.0**-24
_BIAS_ROW_NBYTES = 2 * BIAS_DTYPE.itemsize  # a neuron's gate and up bias
TAIL_BITS = 2
TAIL_QMAX = (1 << TAIL_BITS) - 1  # 3
TAIL_NEURONS_PER_ROW = BITS // TAIL_BITS  # 2: one storage row holds two tail neurons
# Clip ratios tried per 2-bit group (least squared error wins): at 2 bits min-max wastes most of its
# four levels on outliers; on the tiny Mixtral the search cut the tail's SQNR loss (emulated inside 4-bit codes).
TAIL_CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6)


class Proj(enum.IntEnum):
    """Position of each projection in the middle axis of the packed tensors."""

    GATE = 0
    UP = 1
    DOWN = 2


NUM_PROJ = len(Proj)


class ActivationKind(enum.Enum):
    """The gated activation between an expert's gate/up and down projections."""

    SILU_GLU = "silu_glu"  # silu(gate) * up
    GPT_OSS_CLAMPED_SWIGLU = "gpt_oss_clamped_swiglu"  # (clamp(up) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)


@dataclass(frozen=True)
class Activation:
    """One activation with its constants (``alpha`` / ``limit`` only for the clamped SwiGLU)."""

    kind: ActivationKind = ActivationKind.SILU_GLU
    alpha: float | None = None
    limit: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ActivationKind):
            raise TypeError(f"Activation.kind: expected an ActivationKind, got {type(self.kind).__name__} "
                            f"{self.kind!r}")
        if self.kind is ActivationKind.SILU_GLU:
            if self.alpha is not None or self.limit is not None:
                raise ValueError("Activation: SILU_GLU takes no alpha / limit")
            return
        for name in ("alpha", "limit"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < float("inf")):
                raise ValueError(f"Activation.{name}: expected a positive finite number for {self.kind.name}, "
                                 f"got {value!r}")
            object.__setattr__(self, name, float(value))

    def to_json(self) -> dict:
        return {"kind": self.kind.value, "alpha": self.alpha, "limit": self.limit}

    @classmethod
    def from_json(cls, data) -> Activation:
        """Inverse of :meth:`to_json`; None (an older pack, which has no activation) is SILU_GLU."""
        if data is None:
            return SILU_GLU
        if not isinstance(data, dict) or set(data) != {"kind", "alpha", "limit"}:
            raise ValueError(f"activation: expected {{'kind', 'alpha', 'limit'}}, got {data!r}")
        try:
            kind = ActivationKind(data["kind"])
        except ValueError:
            raise ValueError(f"activation.kind: expected one of {[k.value for k in ActivationKind]}, "
                             f"got {data['kind']!r}") from None
        return cls(kind, data["alpha"], data["limit"])


SILU_GLU = Activation()
# gpt-oss's constants (GptOssConfig.swiglu_limit = 7.0; alpha 1.702 in GptOssExperts).
GPT_OSS_SWIGLU = Activation(ActivationKind.GPT_OSS_CLAMPED_SWIGLU, 1.702, 7.0)


def apply_activation(gate: torch.Tensor, up: torch.Tensor, activation: Activation) -> torch.Tensor:
    """The reference activation on (pre-activation, bias included) gate and up, elementwise."""
    if activation.kind is ActivationKind.SILU_GLU:
        return torch.nn.functional.silu(gate) * up
    gate = gate.clamp(max=activation.limit)
    up = up.clamp(-activation.limit, activation.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * activation.alpha))


@dataclass(frozen=True)
class QuantFormat:
    """How expert weights are quantized: 4 bits, groups of ``group_size`` along H."""

    bits: int = BITS
    group_size: int = 64
    symmetric: bool = False

    def __post_init__(self) -> None:
        for name, kind in (("bits", int), ("group_size", int), ("symmetric", bool)):
            value = getattr(self, name)
            if type(value) is not kind:  # True is not a group size, "64" is not 64
                raise TypeError(f"QuantFormat.{name}: expected {kind.__name__}, got {type(value).__name__} {value!r}")
        if self.bits != BITS:
            raise ValueError(f"QuantFormat.bits: only {BITS}-bit is supported, got {self.bits}")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"QuantFormat.group_size: expected one of {GROUP_SIZES}, got {self.group_size}")

    def check_hidden_size(self, hidden_size: int, what: str = "hidden size") -> None:
        if hidden_size <= 0 or hidden_size % self.group_size != 0:
            raise ValueError(
                f"{what} H={hidden_size} must be a positive multiple of group_size={self.group_size}"
            )

    def neuron_nbytes(self, hidden_size: int) -> int:
        """Bytes one neuron occupies in the packed format (weights, scales, zero points)."""
        groups = hidden_size // self.group_size
        per_proj = hidden_size // 2 + groups * SCALE_DTYPE.itemsize + (0 if self.symmetric else groups)
        return NUM_PROJ * per_proj


def check_format(fmt, what: str = "fmt") -> QuantFormat:
    """``fmt`` itself if it is a QuantFormat; a TypeError naming the argument otherwise (a string
    such as "int4-g64" is not parsed: the dataclass is the one spelling of a format)."""
    if not isinstance(fmt, QuantFormat):
        raise TypeError(f"{what}: expected a crisp_kernels.QuantFormat, e.g. QuantFormat(group_size=64, "
                        f"symmetric=False), got {type(fmt).__name__} {fmt!r}")
    return fmt


# ----------------------------------------------------------------------------- quantization


def quantize_rows(w: torch.Tensor, fmt: QuantFormat) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Quantize ``w`` (..., H) group-wise along the last axis.

    Returns (q (..., H) uint8 in [0, 15], scales (..., H/g) fp16, zeros (..., H/g) uint8 or None).
    The stored (fp16-rounded) scale is the one used to round, so dequantizing reproduces the
    grid exactly and a weight already on the grid round-trips bit for bit.
    """
    hidden = w.shape[-1]
    fmt.check_hidden_size(hidden)
    groups = w.float().reshape(*w.shape[:-1], hidden // fmt.group_size, fmt.group_size)
    if fmt.symmetric:
        absmax = groups.abs().amax(dim=-1)
        scales = (absmax / (SYMMETRIC_ZERO - 1)).clamp_min(_MIN_SCALE).to(SCALE_DTYPE)
        zero = torch.full_like(scales, SYMMETRIC_ZERO, dtype=torch.float32)
        zeros_out = None
    else:
        # The grid (q - z) * s with an integer z in [0, 15] always contains 0, so the range
        # must too (as in GPTQ); a group of one sign would otherwise clip to [0, wmax - wmin].
        wmin = groups.amin(dim=-1).clamp(max=0)
        wmax = groups.amax(dim=-1).clamp(min=0)
        scales = ((wmax - wmin) / QMAX).clamp_min(_MIN_SCALE).to(SCALE_DTYPE)
        zero = torch.round(-wmin / scales.float()).clamp(0, QMAX)
        zeros_out = zero.to(torch.uint8)
    q = torch.round(groups / scales.float().unsqueeze(-1)) + zero.unsqueeze(-1)
    q = q.clamp(0, QMAX).to(torch.uint8).reshape(w.shape)
    return q, scales, zeros_out


def dequantize_rows(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int, dtype=torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize_rows`: ``(q - z) * s`` in ``dtype``; q (..., H) unpacked."""
    hidden = q.shape[-1]
    groups = q.to(dtype).reshape(*q.shape[:-1], hidden // group_size, group_size)
    zero = zeros.to(dtype) if zeros is not None else torch.full_like(scales, SYMMETRIC_ZERO, dtype=dtype)
    return ((groups - zero.unsqueeze(-1)) * scales.to(dtype).unsqueeze(-1)).reshape(q.shape)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """(..., H) uint8 in [0, 15] -> (..., H/2) uint8, low nibble = even element."""
    if q.shape[-1] % 2:
        raise ValueError(f"pack_nibbles: last dimension must be even, got {q.shape[-1]}")
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """(..., H/2) uint8 -> (..., H) uint8, inverse of :func:`pack_nibbles`."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def pack_crumbs(q: torch.Tensor) -> torch.Tensor:
    """(..., H) uint8 in [0, 3] -> (..., H/4) uint8, element 4b + i in bits [2i, 2i + 2) of byte b."""
    if q.shape[-1] % 4:
        raise ValueError(f"pack_crumbs: last dimension must be a multiple of 4, got {q.shape[-1]}")
    return q[..., 0::4] | (q[..., 1::4] << 2) | (q[..., 2::4] << 4) | (q[..., 3::4] << 6)


def unpack_crumbs(packed: torch.Tensor) -> torch.Tensor:
    """(..., H/4) uint8 -> (..., H) uint8, inverse of :func:`pack_crumbs`."""
    parts = [(packed >> shift) & TAIL_QMAX for shift in (0, 2, 4, 6)]
    return torch.stack(parts, dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 4)


def tail_group_size(fmt: QuantFormat) -> int:
    """The 2-bit tail's group size: twice the head's, so that two tail neurons fill one row's scales."""
    return TAIL_NEURONS_PER_ROW * fmt.group_size


def neurons_in_rows(rows: int, tail_start: int | None) -> int:
    """Neurons the first ``rows`` storage rows hold (``tail_start`` None: one per row)."""
    if tail_start is None or rows <= tail_start:
        return rows
    return tail_start + TAIL_NEURONS_PER_ROW * (rows - tail_start)


def rows_for_neurons(neurons: int, tail_start: int | None) -> int:
    """Storage rows that hold the first ``neurons`` neurons (the least r with neurons_in_rows(r) >= neurons)."""
    if tail_start is None or neurons <= tail_start:
        return neurons
    return tail_start + -(-(neurons - tail_start) // TAIL_NEURONS_PER_ROW)


def quantize_tail_rows(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``w`` (..., H) to 2 bits, asymmetric, groups of ``group_size`` along the last axis: per group
    the clip ratio of ``TAIL_CLIP_RATIOS`` with the least squared error. Returns (q (..., H) uint8 in [0, 3],
    scales (..., H/g) fp16, zeros (..., H/g) uint8 in [0, 3]); the stored fp16 scale is the one rounded with,
    so a weight on the grid round-trips exactly."""
    hidden = w.shape[-1]
    if group_size <= 0 or hidden % group_size or group_size % 4:
        raise ValueError(f"quantize_tail_rows: group_size={group_size} must be a positive multiple of 4 dividing "
                         f"H={hidden}")
    groups = w.float().reshape(*w.shape[:-1], hidden // group_size, group_size)
    lo_all = groups.amin(-1, keepdim=True).clamp(max=0)  # the grid contains 0, as the 4-bit format's
    hi_all = groups.amax(-1, keepdim=True).clamp(min=0)
    best = None
    for ratio in TAIL_CLIP_RATIOS:
        scale = ((hi_all - lo_all) * ratio / TAIL_QMAX).clamp_min(_MIN_SCALE).to(SCALE_DTYPE)
        zero = torch.round(-lo_all * ratio / scale.float()).clamp(0, TAIL_QMAX)
        q = torch.round(groups / scale.float() + zero).clamp(0, TAIL_QMAX)
        err = ((q - zero) * scale.float() - groups).square().sum(-1, keepdim=True)
        if best is None:
            best = [err, q, zero, scale]
            continue
        better = err < best[0]
        best = [torch.where(better, new, old) for new, old in zip((err, q, zero, scale), best, strict=True)]
    _, q, zero, scale = best
    return (q.to(torch.uint8).reshape(w.shape), scale.squeeze(-1).contiguous(),
            zero.squeeze(-1).to(torch.uint8).contiguous())


def _tail_view(t: torch.Tensor, tail_start: int) -> torch.Tensor:
    """Storage rows [tail_start, W) of one expert's (W, 3, n) tensor as (2 (W - tail_start), 3, n / 2)."""
    rows = t[tail_start:]
    return rows.reshape(rows.shape[0] * TAIL_NEURONS_PER_ROW, NUM_PROJ, rows.shape[-1] // TAIL_NEURONS_PER_ROW)


def tail_rows_from_neurons(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """2-bit tail neurons (..., N, 3, H) codes, (..., N, 3, H/gt) scales and zeros -> storage rows
    (..., ceil(N/2), 3, H/2) uint8, (..., ceil(N/2), 3, H/g) fp16 and uint8: the layout of the module docstring.
    An odd last neuron is padded with a zero-weight neuron (codes = zero point 0, the smallest scale)."""
    n = q.shape[-3]
    if n % TAIL_NEURONS_PER_ROW:
        pad = [0, 0, 0, 0, 0, 1]  # one more neuron along the N axis
        q = torch.nn.functional.pad(q, pad)
        zeros = torch.nn.functional.pad(zeros, pad)
        scales = torch.cat((scales, torch.full_like(scales[..., :1, :, :], _MIN_SCALE)), dim=-3)
    lead = q.shape[:-3]
    rows = q.shape[-3] // TAIL_NEURONS_PER_ROW

    def to_rows(t):  # (..., 2 r, 3, n) -> (..., r, 3, 2 n): two neurons' bytes, one after the other
        return t.reshape(*lead, rows, TAIL_NEURONS_PER_ROW * NUM_PROJ * t.shape[-1]).reshape(
            *lead, rows, NUM_PROJ, TAIL_NEURONS_PER_ROW * t.shape[-1])

    return to_rows(pack_crumbs(q)).contiguous(), to_rows(scales).contiguous(), to_rows(zeros).contiguous()


# ----------------------------------------------------------------------------- containers


def _check_prefix_width(width: int | None, full: int, what: str = "width") -> int:
    if width is None:
        return full
    if isinstance(width, bool) or not isinstance(width, int):
        raise TypeError(f"{what}: expected an int in [0, {full}] or None, got {type(width).__name__}")
    if not 0 <= width <= full:
        raise ValueError(f"{what}={width} is out of range: expected 0 <= {what} <= {full} (the full width)")
    return width


@dataclass(frozen=True)
class PackedExpert:
    """One expert in the neuron-major 4-bit format (see the module docstring for shapes)."""

    fmt: QuantFormat
    qweight: torch.Tensor  # (W, 3, H/2) uint8
    scales: torch.Tensor  # (W, 3, H/g) fp16
    zeros: torch.Tensor | None  # (W, 3, H/g) uint8, None when symmetric
    bias: torch.Tensor | None = None  # (W, 2) float32: [gate bias, up bias] of neuron j in row j
    down_bias: torch.Tensor | None = None  # (H,) float32, the expert's (not a neuron's)
    activation: Activation = SILU_GLU
    tail_start: int | None = None  # storage row where 2-bit neuron pairs begin (module docstring); None: none

    def __post_init__(self) -> None:
        _check_packed_tensors(self.fmt, self.qweight, self.scales, self.zeros, leading=1, what="PackedExpert")
        _check_biases(self.qweight, self.bias, self.down_bias, self.activation, leading=1, what="PackedExpert")
        _check_tail(self.fmt, self.qweight, self.bias, self.tail_start, "PackedExpert")

    @property
    def has_tail(self) -> bool:
        """Whether any stored row holds 2-bit tail neurons."""
        return self.tail_start is not None and self.qweight.shape[0] > self.tail_start

    def neurons(self, width: int | None = None) -> int:
        """Neurons held by the first ``width`` storage rows (all rows: None)."""
        return neurons_in_rows(_check_prefix_width(width, self.width), self.tail_start)

    def head_width(self, width: int | None = None) -> int:
        """4-bit rows among the first ``width``."""
        width = _check_prefix_width(width, self.width)
        return width if self.tail_start is None else min(width, self.tail_start)

    def tail_tensors(self, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The 2-bit neurons of the first ``width`` rows, neuron-major (views when the rows are contiguous):
        codes (N, 3, H/4) uint8, scales (N, 3, H/2g) fp16, zeros (N, 3, H/2g) uint8, N = 2 x tail rows."""
        width = _check_prefix_width(width, self.width)
        start = self.head_width(width)
        return tuple(_tail_view(t[:width], start) for t in (self.qweight, self.scales, self.zeros))

    @property
    def width(self) -> int:
        """Neurons held (the full width of the expert, or of this prefix)."""
        return self.qweight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.qweight.shape[-1] * 2

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @property
    def neuron_nbytes(self) -> int:
        """Bytes per neuron: the format's, plus 8 for a (gate, up) fp32 bias pair."""
        return self.fmt.neuron_nbytes(self.hidden_size) + (0 if self.bias is None else _BIAS_ROW_NBYTES)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The per-neuron tensors (row j = neuron j): qweight, scales[, zeros][, bias]."""
        return tuple(t for t in (self.qweight, self.scales, self.zeros, self.bias) if t is not None)

    def nbytes(self, width: int | None = None) -> int:
        """Exact bytes of the first ``width`` neurons (all per-neuron tensors; the down bias, per
        expert, is not included: ``down_bias.nbytes`` more)."""
        width = _check_prefix_width(width, self.width)
        return width * self.neuron_nbytes

    def prefix(self, width: int | None = None) -> PackedExpert:
        """Zero-copy view of the first ``width`` neurons (the down bias whole)."""
        width = _check_prefix_width(width, self.width)
        return replace(self, qweight=self.qweight[:width], scales=self.scales[:width],
                       zeros=None if self.zeros is None else self.zeros[:width],
                       bias=None if self.bias is None else self.bias[:width])

    def to(self, device, non_blocking: bool = False) -> PackedExpert:
        def move(t):
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return replace(self, qweight=move(self.qweight), scales=move(self.scales), zeros=move(self.zeros),
                       bias=move(self.bias), down_bias=move(self.down_bias))


@dataclass(frozen=True)
class PackedLayer:
    """All experts of one MoE layer, stacked: the leading axis is the expert.

    ``neuron_order[e, j]`` is the original index of stored neuron j of expert e, so the
    original weights can be reconstructed (and checked) from the pack. ``bias`` (E, I, 2) and
    ``down_bias`` (E, H) float32 are present together or not at all (gpt-oss has both).
    """

    fmt: QuantFormat
    qweight: torch.Tensor  # (E, I, 3, H/2) uint8
    scales: torch.Tensor  # (E, I, 3, H/g) fp16
    zeros: torch.Tensor | None  # (E, I, 3, H/g) uint8
    neuron_order: torch.Tensor  # (E, I) int64
    bias: torch.Tensor | None = None  # (E, I, 2) float32, stored neuron order like qweight
    down_bias: torch.Tensor | None = None  # (E, H) float32
    activation: Activation = SILU_GLU
    tail_start: int | None = None  # storage row where 2-bit neuron pairs begin (module docstring); None: none

    def __post_init__(self) -> None:
        _check_packed_tensors(self.fmt, self.qweight, self.scales, self.zeros, leading=2, what="PackedLayer")
        _check_biases(self.qweight, self.bias, self.down_bias, self.activation, leading=2, what="PackedLayer")
        _check_tail(self.fmt, self.qweight, self.bias, self.tail_start, "PackedLayer")
        rows = self.qweight.shape[1]
        if self.tail_start is not None and self.tail_start > rows:
            raise ValueError(f"PackedLayer.tail_start={self.tail_start} is past the {rows} stored rows")
        order = self.neuron_order
        if order.dtype != torch.int64 or order.dim() != 2 or order.shape[0] != self.qweight.shape[0] or (
                rows_for_neurons(order.shape[1], self.tail_start) != rows):
            want = (f"({self.qweight.shape[0]}, I) with I neurons in {rows} rows (tail from row {self.tail_start})"
                    if self.tail_start is not None else str(tuple(self.qweight.shape[:2])))
            raise ValueError(f"PackedLayer.neuron_order: expected int64 of shape {want}, "
                             f"got {order.dtype} {tuple(order.shape)}")

    @property
    def num_neurons(self) -> int:
        """Neurons per expert (I of the model); equal to ``intermediate_size`` without a 2-bit tail."""
        return self.neuron_order.shape[1]

    def neurons(self, width: int) -> int:
        """The model's neurons a width of ``width`` storage rows computes (a last padding neuron not counted)."""
        return min(neurons_in_rows(width, self.tail_start), self.num_neurons)

    @property
    def num_experts(self) -> int:
        return self.qweight.shape[0]

    @property
    def intermediate_size(self) -> int:
        """Stored rows per expert: the full width every width here counts in (I, or fewer with a 2-bit tail)."""
        return self.qweight.shape[1]

    @property
    def hidden_size(self) -> int:
        return self.qweight.shape[-1] * 2

    @property
    def neuron_nbytes(self) -> int:
        """Bytes per neuron: the format's, plus 8 for a (gate, up) fp32 bias pair."""
        return self.fmt.neuron_nbytes(self.hidden_size) + (0 if self.bias is None else _BIAS_ROW_NBYTES)

    def expert(self, index: int) -> PackedExpert:
        """Zero-copy view of expert ``index``."""
        if not 0 <= index < self.num_experts:
            raise IndexError(f"expert index {index} out of range for {self.num_experts} experts")
        return self.expert_from_rows(
            index, tuple(t[index] for t in (self.qweight, self.scales, self.zeros, self.bias) if t is not None))

    def expert_rows(self, index: int, start: int, stop: int) -> tuple[torch.Tensor, ...]:
        """Neurons ``start..stop`` of expert ``index``: views of each per-neuron tensor, in the order
        of :meth:`PackedExpert.tensors`."""
        return tuple(t[index, start:stop] for t in (self.qweight, self.scales, self.zeros, self.bias)
                     if t is not None)

    def expert_from_rows(self, index: int, rows: tuple[torch.Tensor, ...]) -> PackedExpert:
        """The PackedExpert of expert ``index`` over per-neuron tensors ``rows`` (e.g. copies of
        :meth:`expert_rows` on a device); its down bias is moved to their device."""
        rows = list(rows)
        qweight, scales = rows[0], rows[1]
        zeros = None if self.zeros is None else rows[2]
        bias = None if self.bias is None else rows[-1]
        down_bias = None if self.down_bias is None else self.down_bias[index].to(qweight.device)
        return PackedExpert(self.fmt, qweight, scales, zeros, bias, down_bias, self.activation, self.tail_start)

    def nbytes(self) -> int:
        """Bytes of all experts at full width (excluding ``neuron_order`` and the down biases)."""
        return self.num_experts * self.intermediate_size * self.neuron_nbytes

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"qweight": self.qweight, "scales": self.scales, "neuron_order": self.neuron_order}
        for name in ("zeros", "bias", "down_bias"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    def to(self, device) -> PackedLayer:
        """Every tensor on ``device`` except ``neuron_order`` (host bookkeeping)."""
        def move(t):
            return None if t is None else t.to(device)

        return replace(self, qweight=move(self.qweight), scales=move(self.scales), zeros=move(self.zeros),
                       bias=move(self.bias), down_bias=move(self.down_bias))

    def pin_memory(self) -> PackedLayer:
        """Copy into page-locked host memory (CUDA only), for asynchronous host-to-device copies."""
        def pin(t):
            return None if t is None else t.pin_memory()

        return replace(self, qweight=pin(self.qweight), scales=pin(self.scales), zeros=pin(self.zeros),
                       bias=pin(self.bias), down_bias=pin(self.down_bias))


def _check_tail(fmt: QuantFormat, qweight: torch.Tensor, bias, tail_start, what: str) -> None:
    if tail_start is None:
        return
    if isinstance(tail_start, bool) or not isinstance(tail_start, int) or tail_start < 0:
        raise ValueError(f"{what}.tail_start: expected a non-negative int (a storage row) or None, got {tail_start!r}")
    if fmt.symmetric:
        raise ValueError(f"{what}.tail_start: 2-bit tail rows need an asymmetric format (zero points), got "
                         f"symmetric")
    if bias is not None:
        raise ValueError(f"{what}.tail_start: 2-bit tail rows are not supported with biases (gpt-oss)")
    hidden = qweight.shape[-1] * 2
    if hidden % tail_group_size(fmt):
        raise ValueError(f"{what}.tail_start: the 2-bit tail's groups of {tail_group_size(fmt)} must divide "
                         f"H={hidden}")


def _check_biases(qweight, bias, down_bias, activation, *, leading: int, what: str) -> None:
    if not isinstance(activation, Activation):
        raise TypeError(f"{what}.activation: expected a crisp_kernels.Activation, got {type(activation).__name__}")
    if (bias is None) != (down_bias is None):
        raise ValueError(f"{what}: bias and down_bias come together (gate/up biases per neuron and the down bias "
                         f"per expert), got only {'bias' if down_bias is None else 'down_bias'}")
    if bias is None:
        return
    want_bias = (*qweight.shape[:-2], 2)
    want_down = (*qweight.shape[:leading - 1], qweight.shape[-1] * 2)
    for name, t, want in (("bias", bias, want_bias), ("down_bias", down_bias, want_down)):
        if not isinstance(t, torch.Tensor) or t.dtype != BIAS_DTYPE or tuple(t.shape) != want:
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{what}.{name}: expected {BIAS_DTYPE} of shape {want}, got {got}")
        if t.device != qweight.device:
            raise ValueError(f"{what}.{name} is on {t.device}, the packed weights on {qweight.device}")


def check_layer_values(layer: PackedLayer, what: str = "layer") -> None:
    """Cheap value checks on a packed layer (one pass over scales and zero points, ~1/10 of its
    bytes): every scale finite and > 0 (the quantizer stores at least 2**-24) and every zero point
    <= 15. A NaN / inf scale or an out-of-range zero point (a flipped bit) would otherwise reach
    the logits. Raises ValueError naming the tensor."""
    # On the fp16 bit patterns: positive finite <=> sign bit clear, not zero, exponent not all ones,
    # i.e. 0 < bits < 0x7C00 as int16 (NaN / inf are >= 0x7C00, negatives < 0): one min/max pass.
    # Measured on 3.1M scales (a 110 MB file): fp16 compares on this CPU 450 ms, this < 1 ms.
    bits = layer.scales.view(torch.int16)
    lo, hi = torch.aminmax(bits) if bits.numel() else (torch.tensor(1), torch.tensor(1))
    if int(lo) < 1 or int(hi) >= 0x7C00:
        bad = int(((bits < 1) | (bits >= 0x7C00)).sum())
        raise ValueError(f"{what}.scales: {bad} value(s) are NaN, infinite or <= 0 (a scale must be a positive, "
                         f"finite fp16)")
    if layer.tail_start is not None and layer.zeros[:, layer.tail_start:].numel() and (
            int(layer.zeros[:, layer.tail_start:].max()) > TAIL_QMAX):
        raise ValueError(f"{what}.zeros: a 2-bit tail zero point is {int(layer.zeros[:, layer.tail_start:].max())}, "
                         f"above {TAIL_QMAX} (rows from tail_start={layer.tail_start} hold 2-bit groups)")
    if layer.zeros is not None and layer.zeros.numel() and int(layer.zeros.max()) > QMAX:
        raise ValueError(f"{what}.zeros: zero point {int(layer.zeros.max())} is above {QMAX} (4-bit zero points lie "
                         f"in [0, {QMAX}])")
    for name in ("bias", "down_bias"):
        t = getattr(layer, name)
        if t is not None and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{what}.{name}: {int((~torch.isfinite(t)).sum())} value(s) are NaN or infinite")


def _check_packed_tensors(fmt, qweight, scales, zeros, *, leading: int, what: str) -> None:
    check_format(fmt, f"{what}.fmt")
    for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}.{name}: expected a torch.Tensor, got {type(t).__name__}")
    if qweight.dtype != torch.uint8 or qweight.dim() != leading + 2 or qweight.shape[-2] != NUM_PROJ:
        raise ValueError(
            f"{what}.qweight: expected uint8 of shape ({'E, ' if leading == 2 else ''}W, 3, H/2), "
            f"got {qweight.dtype} {tuple(qweight.shape)}"
        )
    hidden = qweight.shape[-1] * 2
    fmt.check_hidden_size(hidden, f"{what} hidden size")
    groups_shape = (*qweight.shape[:-1], hidden // fmt.group_size)
    if scales.dtype != SCALE_DTYPE or tuple(scales.shape) != groups_shape:
        raise ValueError(
            f"{what}.scales: expected {SCALE_DTYPE} of shape {groups_shape}, got {scales.dtype} {tuple(scales.shape)}"
        )
    if fmt.symmetric:
        if zeros is not None:
            raise ValueError(f"{what}.zeros: the symmetric format stores no zero points, got a tensor")
    elif zeros is None or zeros.dtype != torch.uint8 or tuple(zeros.shape) != groups_shape:
        got = "None" if zeros is None else f"{zeros.dtype} {tuple(zeros.shape)}"
        raise ValueError(f"{what}.zeros: expected uint8 of shape {groups_shape}, got {got}")
    devices = {t.device for t in (qweight, scales, zeros) if t is not None}
    if len(devices) > 1:
        raise ValueError(f"{what}: tensors are on different devices {sorted(map(str, devices))}")


# ----------------------------------------------------------------------------- pack / unpack


def _check_expert_weights(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> tuple[int, int]:
    if gate.dim() != 2:
        raise ValueError(f"gate: expected (I, H), got shape {tuple(gate.shape)}")
    inter, hidden = gate.shape
    if tuple(up.shape) != (inter, hidden):
        raise ValueError(f"up: expected (I, H) = {(inter, hidden)} like gate, got {tuple(up.shape)}")
    if tuple(down.shape) != (hidden, inter):
        raise ValueError(f"down: expected (H, I) = {(hidden, inter)} as in nn.Linear, got {tuple(down.shape)}")
    for name, t in (("gate", gate), ("up", up), ("down", down)):
        if not t.is_floating_point():
            raise ValueError(f"{name}: expected a floating-point tensor, got {t.dtype}")
        _check_finite(t, name)
    return inter, hidden


def _check_finite(t: torch.Tensor, name: str) -> None:
    """NaN / inf weights would quantize to NaN scales (or clip to garbage) without a word."""
    if t.is_meta:
        raise ValueError(f"{name}: the weights are not loaded (meta tensor)")
    finite = torch.isfinite(t)
    if not bool(finite.all()):
        raise ValueError(f"{name}: {int((~finite).sum())} weight(s) are NaN or infinite; cannot quantize them")


def pack_expert(
    gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, fmt: QuantFormat = QuantFormat()
) -> PackedExpert:
    """Quantize one expert, neurons in the order given (most important first).

    gate, up: (I, H) as ``nn.Linear(H, I).weight``; down: (H, I) as ``nn.Linear(I, H).weight``.
    """
    fmt = check_format(fmt)
    _, hidden = _check_expert_weights(gate, up, down)
    fmt.check_hidden_size(hidden)
    rows = torch.stack((gate.detach(), up.detach(), down.detach().t()), dim=1)  # (I, 3, H)
    q, scales, zeros = quantize_rows(rows, fmt)
    return PackedExpert(fmt, pack_nibbles(q).contiguous(), scales.contiguous(), _contig(zeros))


def pack_layer(
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    fmt: QuantFormat = QuantFormat(),
    neuron_order: torch.Tensor | None = None,
    *,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    activation: Activation = SILU_GLU,
) -> PackedLayer:
    """Quantize all experts of a layer in the transformers v5 layout.

    gate_up_proj: (E, 2I, H), gate half first; down_proj: (E, H, I).
    neuron_order: (E, I) permutation per expert; stored neuron j of expert e is original
    neuron ``neuron_order[e, j]``. None keeps the present order.
    gate_up_bias (E, 2I) (gate half first) and down_bias (E, H): optional, together; kept in
    float32 (not quantized), the gate/up biases permuted with their neurons.
    activation: the model's (see :class:`Activation`), recorded with the layer.
    gpt-oss's own layout goes through :func:`gpt_oss_to_v5` first.
    """
    fmt = check_format(fmt)
    for name, t in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if gate_up_proj.dim() != 3 or gate_up_proj.shape[1] % 2:
        raise ValueError(f"gate_up_proj: expected (E, 2I, H), got shape {tuple(gate_up_proj.shape)}")
    num_experts, two_inter, hidden = gate_up_proj.shape
    inter = two_inter // 2
    if tuple(down_proj.shape) != (num_experts, hidden, inter):
        raise ValueError(
            f"down_proj: expected (E, H, I) = {(num_experts, hidden, inter)}, got {tuple(down_proj.shape)}"
        )
    fmt.check_hidden_size(hidden)
    _check_finite(gate_up_proj, "gate_up_proj")
    _check_finite(down_proj, "down_proj")
    if (gate_up_bias is None) != (down_bias is None):
        raise ValueError("gate_up_bias and down_bias: pass both or neither")
    if gate_up_bias is not None:
        for name, t, want in (("gate_up_bias", gate_up_bias, (num_experts, two_inter)),
                              ("down_bias", down_bias, (num_experts, hidden))):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != want or not t.is_floating_point():
                got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name}: expected a floating-point tensor of shape {want}, got {got}")
            _check_finite(t, name)
    if not isinstance(activation, Activation):
        raise TypeError(f"activation: expected a crisp_kernels.Activation, got {type(activation).__name__}")
    if neuron_order is None:
        neuron_order = torch.arange(inter).expand(num_experts, inter)
    neuron_order = check_permutations(neuron_order, num_experts, inter)
    gate = gate_up_proj[:, :inter].detach()
    up = gate_up_proj[:, inter:].detach()
    down_t = down_proj.detach().transpose(1, 2)  # (E, I, H)
    order = neuron_order.to(gate.device)
    idx = order.unsqueeze(-1).expand(num_experts, inter, hidden)
    rows = torch.stack((gate.gather(1, idx), up.gather(1, idx), down_t.gather(1, idx)), dim=2)  # (E, I, 3, H)
    q, scales, zeros = quantize_rows(rows, fmt)
    bias = out_down_bias = None
    if gate_up_bias is not None:
        gub = gate_up_bias.detach().to(device=gate.device, dtype=BIAS_DTYPE)
        bias = torch.stack((gub[:, :inter].gather(1, order), gub[:, inter:].gather(1, order)), dim=-1).contiguous()
        out_down_bias = down_bias.detach().to(device=gate.device, dtype=BIAS_DTYPE).contiguous()
    return PackedLayer(
        fmt, pack_nibbles(q).contiguous(), scales.contiguous(), _contig(zeros), neuron_order.cpu().clone(),
        bias, out_down_bias, activation,
    )


def gpt_oss_to_v5(
    gate_up_proj: torch.Tensor, gate_up_bias: torch.Tensor, down_proj: torch.Tensor, down_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """gpt-oss's expert layout -> the v5 layout :func:`pack_layer` takes (views, no copy).

    gpt-oss stores ``gate_up_proj (E, H, 2I)`` transposed with gate and up INTERLEAVED along the
    last axis (gate j at 2j, up j at 2j + 1: ``_apply_gate`` reads ``[..., ::2]`` / ``[..., 1::2]``),
    ``gate_up_proj_bias (E, 2I)`` interleaved the same way, ``down_proj (E, I, H)`` transposed and
    ``down_proj_bias (E, H)``. Returns (gate_up_proj (E, 2I, H) gate half first, gate_up_bias (E, 2I)
    gate half first, down_proj (E, H, I), down_bias (E, H)).
    """
    if gate_up_proj.dim() != 3 or gate_up_proj.shape[2] % 2:
        raise ValueError(f"gate_up_proj: expected gpt-oss's (E, H, 2I), got {tuple(gate_up_proj.shape)}")
    num_experts, hidden, two_inter = gate_up_proj.shape
    for name, t, want in (("gate_up_proj_bias", gate_up_bias, (num_experts, two_inter)),
                          ("down_proj", down_proj, (num_experts, two_inter // 2, hidden)),
                          ("down_proj_bias", down_bias, (num_experts, hidden))):
        if tuple(t.shape) != want:
            raise ValueError(f"{name}: expected gpt-oss's {want}, got {tuple(t.shape)}")
    gate_up = torch.cat((gate_up_proj[..., 0::2], gate_up_proj[..., 1::2]), dim=2).transpose(1, 2)
    bias = torch.cat((gate_up_bias[:, 0::2], gate_up_bias[:, 1::2]), dim=1)
    return gate_up, bias, down_proj.transpose(1, 2), down_bias


def with_tail(layer: PackedLayer, stored_rows: torch.Tensor, tail_start: int) -> PackedLayer:
    """``layer`` with neurons from ``tail_start`` on stored at 2 bits (module docstring), quantized from
    ``stored_rows`` (E, I, 3, H) float, the ORIGINAL weights' (gate row, up row, down column) in the layer's
    stored neuron order; the 4-bit rows before ``tail_start`` are the layer's, bit for bit."""
    if not isinstance(layer, PackedLayer):
        raise TypeError(f"layer: expected a PackedLayer, got {type(layer).__name__}")
    if layer.tail_start is not None:
        raise ValueError(f"layer: already has a 2-bit tail from row {layer.tail_start}")
    inter = layer.num_neurons
    if isinstance(tail_start, bool) or not isinstance(tail_start, int) or not 0 <= tail_start < inter:
        raise ValueError(f"tail_start: expected an int in [0, {inter}) (the first 2-bit neuron), got {tail_start!r}")
    want = (layer.num_experts, inter, NUM_PROJ, layer.hidden_size)
    if not isinstance(stored_rows, torch.Tensor) or tuple(stored_rows.shape) != want:
        got = tuple(stored_rows.shape) if isinstance(stored_rows, torch.Tensor) else type(stored_rows).__name__
        raise ValueError(f"stored_rows: expected (E, I, 3, H) = {want}, got {got}")
    _check_finite(stored_rows, "stored_rows")
    _check_tail(layer.fmt, layer.qweight, layer.bias, tail_start, "with_tail")
    tail = stored_rows[:, tail_start:].to(layer.qweight.device)
    q, scales, zeros = quantize_tail_rows(tail, tail_group_size(layer.fmt))
    q_rows, s_rows, z_rows = tail_rows_from_neurons(q, scales, zeros)
    cat = lambda head, tail: torch.cat((head[:, :tail_start], tail), dim=1).contiguous()  # noqa: E731
    return replace(layer, qweight=cat(layer.qweight, q_rows), scales=cat(layer.scales, s_rows),
                   zeros=cat(layer.zeros, z_rows), tail_start=tail_start)


def check_permutations(order: torch.Tensor, num_experts: int, inter: int) -> torch.Tensor:
    """Validate an (E, I) tensor of per-expert permutations of range(I); returns it as int64."""
    if tuple(order.shape) != (num_experts, inter) or order.is_floating_point():
        raise ValueError(
            f"neuron_order: expected an integer tensor of shape {(num_experts, inter)}, "
            f"got {order.dtype} {tuple(order.shape)}"
        )
    order = order.to(torch.int64)
    expected = torch.arange(inter, device=order.device).expand(num_experts, inter)
    if not torch.equal(order.sort(dim=1).values, expected):
        raise ValueError("neuron_order: each row must be a permutation of range(I)")
    return order


def _contig(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()


def dequantize_expert(
    packed: PackedExpert, width: int | None = None, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference dequantization of the first ``width`` neurons.

    Returns (gate (k, H), up (k, H), down (H, k)) in ``dtype`` (float32 by default; the
    tests use float64).
    """
    p = packed.prefix(width)
    head = p.head_width()
    rows = dequantize_rows(unpack_nibbles(p.qweight[:head]), p.scales[:head],
                           None if p.zeros is None else p.zeros[:head], p.fmt.group_size, dtype)
    if p.has_tail:  # the 2-bit neurons after the head, in order: (2 x tail rows, 3, H)
        q2, s2, z2 = p.tail_tensors()
        rows = torch.cat((rows, dequantize_rows(unpack_crumbs(q2), s2, z2, tail_group_size(p.fmt), dtype)))
    return rows[:, Proj.GATE], rows[:, Proj.UP], rows[:, Proj.DOWN].t()


def layer_neuron_rows(layer: PackedLayer, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Every neuron's dequantized (gate row, up row, down column) in STORED order: (E, I, 3, H) in ``dtype``
    (a 2-bit tail's neurons after the head, its padding neuron dropped)."""
    head = layer.intermediate_size if layer.tail_start is None else layer.tail_start
    zeros = None if layer.zeros is None else layer.zeros[:, :head]
    rows = dequantize_rows(unpack_nibbles(layer.qweight[:, :head]), layer.scales[:, :head], zeros,
                           layer.fmt.group_size, dtype)
    if head == layer.intermediate_size:
        return rows
    num_experts = layer.num_experts

    def tail(t):  # (E, R_t, 3, n) storage rows -> (E, 2 R_t, 3, n / 2) neurons
        return t[:, head:].reshape(num_experts, -1, NUM_PROJ, t.shape[-1] // TAIL_NEURONS_PER_ROW)

    q2, s2, z2 = tail(layer.qweight), tail(layer.scales), tail(layer.zeros)
    tail_rows = dequantize_rows(unpack_crumbs(q2), s2, z2, tail_group_size(layer.fmt), dtype)
    return torch.cat((rows, tail_rows), dim=1)[:, :layer.num_neurons]


def dequantize_layer(layer: PackedLayer, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantize a layer back to the transformers v5 layout in the ORIGINAL neuron order.

    Returns (gate_up_proj (E, 2I, H), down_proj (E, H, I)).
    """
    rows = layer_neuron_rows(layer, dtype)
    inverse = torch.argsort(layer.neuron_order.to(rows.device), dim=1)  # (E, I)
    idx = inverse.unsqueeze(-1).unsqueeze(-1).expand_as(rows)
    rows = rows.gather(1, idx)  # (E, I, 3, H) in original order
    gate_up = torch.cat((rows[:, :, Proj.GATE], rows[:, :, Proj.UP]), dim=1)
    down = rows[:, :, Proj.DOWN].transpose(1, 2).contiguous()
    return gate_up, down


def layer_biases(layer: PackedLayer) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The layer's biases in the v5 layout and ORIGINAL neuron order, or None when it has none:
    (gate_up_bias (E, 2I) gate half first, down_bias (E, H)), float32."""
    if layer.bias is None:
        return None
    inverse = torch.argsort(layer.neuron_order.to(layer.bias.device), dim=1)  # (E, I)
    bias = layer.bias.gather(1, inverse.unsqueeze(-1).expand_as(layer.bias))
    return torch.cat((bias[..., 0], bias[..., 1]), dim=1), layer.down_bias


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB, ``10 log10(|w|^2 / |w - w_q|^2)``, in float64."""
    reference, approx = reference.double(), approx.double()
    noise = (reference - approx).pow(2).sum()
    return float("inf") if noise == 0 else (10 * torch.log10(reference.pow(2).sum() / noise)).item()


def layer_sqnr_db(layer: PackedLayer, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> dict[str, float]:
    """SQNR (dB) of a packed layer against the weights it was packed from, in the v5 layout
    (``gate_up_proj (E, 2I, H)`` gate half first, ``down_proj (E, H, I)``; gpt-oss's through
    :func:`gpt_oss_to_v5`): per projection and over all three. Biases are stored exactly (fp32)."""
    gate_up, down = dequantize_layer(layer, torch.float64)
    inter = layer.intermediate_size
    pairs = {"gate": (gate_up_proj[:, :inter], gate_up[:, :inter]), "up": (gate_up_proj[:, inter:], gate_up[:, inter:]),
             "down": (down_proj, down)}
    out = {name: sqnr_db(ref, approx) for name, (ref, approx) in pairs.items()}
    out["all"] = sqnr_db(torch.cat([ref.reshape(-1).double() for ref, _ in pairs.values()]),
                         torch.cat([approx.reshape(-1) for _, approx in pairs.values()]))
    return out
