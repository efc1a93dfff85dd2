"""The CPU expert kernel: one expert over the first k neurons of its 4-bit prefix, on the host.

Public entry points:

- ``cpu_expert_prepare(layer) -> CpuPreparedLayer``: the second layout (torch's int4pack CPU
  layout) of a host layer, built once; ``prepared.expert(e)`` -> :class:`CpuExpert`;
- ``expert_mlp_cpu_accumulate_(x, packed, token_widths, width, weights, out)``:
  ``out += weights[:, None] * expert_k(x)`` in float32, where ``packed`` is a :class:`CpuExpert`
  (fast path) or a bare :class:`PackedExpert` (the chunked-dequant path, no second copy);
- ``CpuKernelInfo`` / :func:`kernel_info`: which implementation a call takes, and its extra bytes.

Implementations (:class:`CpuImpl`), chosen per call by :func:`choose_impl` (see ``docs/cpu-kernel.md``
for the figures behind the choice):

- ``NATIVE_FP32`` (the default where it builds): ``cpu_expert_native.c`` (``crisp_kernels.cpu_native``),
  compiled on first use with the host's C compiler, reads the format's own rows in one fused pass per
  neuron (no second copy), fp32 throughout (within 1e-5 of the float64 reference), threads over
  neurons. On an AVX2-only host (AMD EPYC, 2 cores) it is 1.3-1.9x faster than the int4pack op at
  T = 1 and 1.2-1.5x at T = 4 (that op's AVX2 kernel is compute-bound at ~3 GB/s per core, and its down
  projection runs one call per 32 rows of H on one thread); on an AVX-512 Zen 4 host 1.25x at T = 1 and
  1.03-1.29x at T = 2..16 (full width, both cores; its AVX512-BF16 dots had been faster at T >= 4 before the
  multi-token gate/up pass); up to ``cpu_native.MAX_TOKENS`` tokens a call.
- ``INT4PACK_BF16``: ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (torch's own AVX-512/AVX2
  4-bit kernel, the one torchao's int4 CPU path uses) with bf16 activations. Its layout stores
  blocks of B rows, K-major inside a block, B the CPU's (64 with AVX-512, 32 with AVX2; probed by
  :func:`int4pack_layout`, checked in the tests), so
  * gate and up are one matrix of 2I rows interleaved per B-neuron block (gate block b, then up
    block b): the first ``B n`` neurons are the first ``2 B n`` rows, one call;
  * down is cut into one (R, I) matrix per R = min(B, group) rows of H: its K (neuron) prefix is
    a byte prefix of each block. The format's down scales run along H (one per neuron and group
    of H), which the op cannot express (its scales run along K), so each block is packed with
    unit scales (weight q - 8, exact) and the neuron's scale is folded into the activation
    (``h * s[:, group]``); the zero point's term ``sum_j h_j s_j (z_j - 8)`` is one fp32 matmul.
  Neurons past the last whole B-block (< B of them) run on the dequant path, from the host
  rows themselves. Cost: a second copy of the experts, 3 I H / 2 bytes of int4pack weights plus
  bf16 gate/up scales and zero terms (4 bytes per group per gate/up row) and the down scales (fp16)
  and zero terms (fp32) transposed (6 bytes per group): at H 4096, g 64 that is 7,040 bytes per
  neuron beside the format's 6,720, i.e. host memory for the experts doubles (x 2.05).
- ``DEQUANT_FP32``: the host rows dequantized in chunks of ``chunk`` neurons (format's
  ``dequantize_rows``) and fp32 matmuls. Exact (fp32), no second copy, ~30x slower. Taken at
  Precision.FP32, for a bare PackedExpert, and for the < B neurons past the last B-block.

Precision: ``Precision.FP32`` (default for fp32 activations) equals the float64 reference within
1e-5; ``Precision.BF16`` (default for bf16 activations; also selectable for fp32 ones) rounds the
activations, the intermediate and the gate/up scales to bf16 and the op's outputs are bf16, as the
GPU prefill path rounds its dot operands: within 2u of bf16 (7.8e-3), the kernels' tolerance.

Every torch op releases the GIL, so a worker thread runs this while the main thread drives the
GPU; the Python between the ops (about H / R + 20 ops per call) holds it. Threads: the ops use
torch's intra-op pool (``torch.get_num_threads()``, process-wide, not set here).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import cpu_native
from .checks import INDEX_DTYPES, check_activations, check_packed, check_token_vector, check_width
from .format import SYMMETRIC_ZERO, PackedExpert, PackedLayer, Proj, dequantize_rows, unpack_nibbles

# ----------------------------------------------------------------------------- constants

# torch's CPU int4pack layout (_convert_weight_to_int4pack_for_cpu, torch 2.13) stores rows in
# blocks of B rows, K-major inside a block: a prefix of B n rows and a K range of a B-row matrix are
# byte ranges. B is the CPU's: 64 with AVX-512 (an Intel Xeon VM), 32 with AVX2
# only (an AMD EPYC VM), so it is probed on the machine (int4pack_layout), never assumed:
# a 64 assumed on an AVX2 host gave relative errors of ~1.0, silently. The candidates are the
# op's K groups (>= 32), because a down matrix's unit scales come in K groups of DOWN_K_GROUP.
BLOCK_N_CANDIDATES = (32, 64, 128)
# The op's smallest group along K: the down matrices' (unit) scales come in groups of 32 neurons.
DOWN_K_GROUP = 32
# The probe's matrix: K = 256 elements, rows for two blocks of the largest candidate.
_PROBE_K = 256
# The op reads its (K/g, N, 2) scale tensor as if contiguous (a strided N prefix gives wrong
# results, checked in the tests), so gate/up scales are stored per chunk of neurons: a width calls
# the op once per chunk and copies only a partial last chunk's scales (<= 0.5 MB at H 4096, g 64).
# 1024 neurons are 4 MB of gate/up weights at H 4096: ~1.5 ms each at 2.7 GB/s, against ~20 us
# of per-call overhead measured on the loaded 2-core VM.
GATE_UP_CHUNK = 1024
# Elements of the bf16 buffer of h * s (all groups of H at once when it fits): 4 MB of bf16, all
# 64 groups at T = 1 and I = 14336.
_HS_ELEMENTS = 2 * 2**20
# Rows of the host layer converted at once while preparing: 1024 rows x H int32 is 16 MB at H 4096.
_PREPARE_ROWS = 1024
# Neurons dequantized at once on the fp32 path: (256, 3, H) fp32 is 12 MB at H 4096, and per-op
# overhead (~10 ops per chunk) stays under 5% of a chunk's time.
DEFAULT_CHUNK = 256


class Precision(enum.Enum):
    FP32 = "fp32"  # fp32 compute, exact to 1e-5 (DEQUANT_FP32)
    BF16 = "bf16"  # bf16 operands, fp32 accumulation (INT4PACK_BF16 when prepared)
    # 8-bit activations and integer dots, llama.cpp's Q8_0 arithmetic (NATIVE_Q8; crisp_kernels.cpu_expert_q8);
    # where the native kernel cannot run, the BF16 paths (closer to fp32 than Q8)
    Q8 = "q8"


class CpuImpl(enum.Enum):
    NATIVE_FP32 = "native-fp32"  # cpu_expert_native.c on the host rows, fp32 (crisp_kernels.cpu_native)
    NATIVE_Q8 = "native-q8"  # the same kernel with 8-bit activations (Precision.Q8)
    INT4PACK_BF16 = "int4pack-bf16"  # torch.ops.aten._weight_int4pack_mm_for_cpu, bf16
    DEQUANT_FP32 = "dequant-fp32"  # chunked dequant of the host rows + fp32 matmul


@dataclass(frozen=True)
class CpuExpertConfig:
    """How a call computes. ``precision`` None: FP32 for fp32 activations, BF16 for bf16 ones.

    ``impl`` None: the native kernel when it builds on this machine (fp32, so within either
    precision's tolerance), else int4pack for BF16 with a prepared expert, else the dequant path.
    An explicit ``impl`` is taken or refused (NATIVE_FP32 where it cannot build: NativeUnavailable;
    INT4PACK_BF16 without a prepared expert: ValueError)."""

    precision: Precision | None = None
    chunk: int = DEFAULT_CHUNK
    impl: CpuImpl | None = None

    def __post_init__(self) -> None:
        if self.precision is not None and not isinstance(self.precision, Precision):
            raise TypeError(f"CpuExpertConfig.precision: expected a Precision or None, got {self.precision!r}")
        if self.impl is not None and not isinstance(self.impl, CpuImpl):
            raise TypeError(f"CpuExpertConfig.impl: expected a CpuImpl or None, got {self.impl!r}")
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or self.chunk < 1:
            raise ValueError(f"CpuExpertConfig.chunk: expected a positive int, got {self.chunk!r}")

    def resolve(self, x_dtype: torch.dtype) -> Precision:
        if self.precision is not None:
            return self.precision
        return Precision.FP32 if x_dtype == torch.float32 else Precision.BF16


DEFAULT_CONFIG = CpuExpertConfig()


@dataclass(frozen=True)
class CpuKernelInfo:
    """Which implementation a call takes, the extra host bytes it needs, and (when a benchmark
    measured it) its GB/s of prefix bytes."""

    impl: CpuImpl
    extra_nbytes: int
    measured_gbps: float | None = None


# ----------------------------------------------------------------------------- second layout


@dataclass(frozen=True)
class CpuExpert:
    """One expert for the CPU: its host rows (``packed``) and their int4pack copy.

    gate_up: (2 Ib, H/2) uint8, int4pack of gate/up rows interleaved per block of ``block_n``
    neurons (the op's block on this CPU, :func:`int4pack_layout`);
    gate_up_sz: per chunk of GATE_UP_CHUNK neurons, (H/g, 2 n, 2) bf16, the op's (scale, zero
    term) per group and row;
    down: (H / R, R Ib / 2) uint8, one int4pack (R, Ib) matrix per R rows of H, unit scales;
    down_scales: (H/g, Ib) fp16, the down scales transposed (row g contiguous: read as one vector
    per block; the strided column of the host rows cost 490 us per block at I 14336, as much as
    the block's matmul);
    down_zero: (H/g, Ib) fp32, ``(z - 8) * s`` (exact in fp32), None for the symmetric format;
    Ib = I rounded down to a multiple of ``block_n`` (the rest runs from ``packed``);
    block_n: the int4pack layout's block rows on the CPU that built the copy (the layout is the
    machine's: a copy is never stored or moved between machines).
    """

    packed: PackedExpert
    gate_up: torch.Tensor
    gate_up_sz: tuple[torch.Tensor, ...]
    down: torch.Tensor
    down_scales: torch.Tensor
    down_zero: torch.Tensor | None
    block_n: int

    @property
    def blocked_width(self) -> int:
        return self.gate_up.shape[0] // 2

    @property
    def down_rows(self) -> int:
        return min(self.block_n, self.packed.fmt.group_size)

    @property
    def nbytes(self) -> int:
        """Bytes of the int4pack copy (beside the host rows)."""
        extra = (self.down_scales, *(() if self.down_zero is None else (self.down_zero,)))
        return self.gate_up.nbytes + sum(t.nbytes for t in (*self.gate_up_sz, self.down, *extra))


@dataclass(frozen=True)
class CpuPreparedLayer:
    """The int4pack copy of every expert of one host layer (see :func:`cpu_expert_prepare`)."""

    layer: PackedLayer
    experts: tuple[CpuExpert, ...]

    def expert(self, index: int) -> CpuExpert:
        return self.experts[index]

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.experts)


def _int4pack(q: torch.Tensor) -> torch.Tensor:
    """(N, K) uint8 in [0, 15] -> torch's CPU int4pack (N, K/2) uint8."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)


class Int4PackUnsupported(RuntimeError):
    """torch's CPU int4pack layout on this machine is not one the fast path can slice by prefix."""


@dataclass(frozen=True)
class Int4PackLayout:
    """What the fast path relies on in torch's CPU int4pack layout, as measured on this machine."""

    block_n: int  # rows per block: prefixes of block_n n rows, K ranges of a block_n-row matrix are byte ranges


def int4pack_layout() -> Int4PackLayout:
    """Probe the op's layout on this CPU (a few conversions of a (2 * 128, 256) matrix, ~1 ms).

    The block B is the candidate for which the first B and 2B rows convert to the first B and 2B
    rows of the whole matrix, and K prefixes and K ranges (from multiples of DOWN_K_GROUP) of a
    B-row matrix convert to byte ranges of its conversion: exactly the slicing the fast path does.
    Raises :class:`Int4PackUnsupported` when no candidate has those properties (a torch build or a
    CPU whose layout differs: the runtime then computes on the exact path, ``CpuPrepare.NONE``)."""
    gen = torch.Generator().manual_seed(0)
    rows = 2 * max(BLOCK_N_CANDIDATES)
    q = torch.randint(0, 16, (rows, _PROBE_K), generator=gen, dtype=torch.uint8)
    try:
        full = _int4pack(q)
        for block in BLOCK_N_CANDIDATES:
            if not all(torch.equal(_int4pack(q[:n]), full[:n]) for n in (block, 2 * block)):
                continue
            matrix = _int4pack(q[:block]).flatten()
            k_ranges = ((0, DOWN_K_GROUP), (0, _PROBE_K // 2), (DOWN_K_GROUP, _PROBE_K),
                        (2 * DOWN_K_GROUP, _PROBE_K // 2))
            if all(torch.equal(_int4pack(q[:block, k0:k1]).flatten(), matrix[block * k0 // 2: block * k1 // 2])
                   for k0, k1 in k_ranges):
                return Int4PackLayout(block)
    except RuntimeError as err:  # the op missing or refusing on this build
        raise Int4PackUnsupported(f"torch's CPU int4pack op failed on this machine: {err}") from err
    raise Int4PackUnsupported(
        f"torch's CPU int4pack layout on this machine (torch {torch.__version__}, CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}) has none of the row blocks {BLOCK_N_CANDIDATES} that the fast "
        "path slices by prefix; use the exact path (CpuExpertsConfig(prepare='none'))")


def prepare_expert(packed: PackedExpert, layout: Int4PackLayout | None = None) -> CpuExpert:
    """The int4pack copy of one host expert (reads it once; the host rows are kept as they are).

    layout: this machine's :func:`int4pack_layout` (probed here when None; pass it to prepare many)."""
    check_packed(packed)
    _check_supported(packed)
    if packed.device.type != "cpu":
        raise ValueError(f"packed: the CPU kernel needs a host expert, got one on {packed.device}")
    if layout is None:
        layout = int4pack_layout()
    elif not isinstance(layout, Int4PackLayout):
        raise TypeError(f"layout: expected an Int4PackLayout or None, got {type(layout).__name__}")
    block_n = layout.block_n
    fmt, hidden = packed.fmt, packed.hidden_size
    blocked = packed.width // block_n * block_n
    groups = hidden // fmt.group_size
    gate_up = torch.empty(2 * blocked, hidden // 2, dtype=torch.uint8)
    sz = torch.empty(groups, 2 * blocked, 2, dtype=torch.bfloat16)
    for start in range(0, blocked, _PREPARE_ROWS // 2):
        stop = min(blocked, start + _PREPARE_ROWS // 2)
        rows = packed.qweight[start:stop, : Proj.UP + 1]  # (n, 2, H/2)
        n = stop - start
        # Interleave per block of block_n neurons: gate rows of block b, then its up rows.
        q = unpack_nibbles(rows).view(n // block_n, block_n, 2, hidden).transpose(1, 2).reshape(2 * n, hidden)
        gate_up[2 * start: 2 * stop] = _int4pack(q)
        s = packed.scales[start:stop, : Proj.UP + 1].float()
        z = (packed.zeros[start:stop, : Proj.UP + 1].float() if packed.zeros is not None
             else torch.full_like(s, SYMMETRIC_ZERO))
        # The op dequantizes (q - 8) * S + Z; the format is (q - z) * s = (q - 8) * s + (8 - z) * s.
        pair = torch.stack((s, (SYMMETRIC_ZERO - z) * s), dim=-1)  # (n, 2, G, 2)
        pair = pair.view(n // block_n, block_n, 2, groups, 2).transpose(1, 2).reshape(2 * n, groups, 2)
        sz[:, 2 * start: 2 * stop] = pair.transpose(0, 1).to(torch.bfloat16)
    sz_chunks = tuple(sz[:, 2 * c: 2 * min(blocked, c + GATE_UP_CHUNK)].contiguous()
                      for c in range(0, blocked, GATE_UP_CHUNK))
    rows_per = min(block_n, fmt.group_size)
    down = torch.empty(hidden // rows_per, rows_per * blocked // 2, dtype=torch.uint8)
    if blocked:
        down_q = unpack_nibbles(packed.qweight[:blocked, Proj.DOWN])  # (Ib, H): column n of down^T
        for b in range(hidden // rows_per):
            down[b] = _int4pack(down_q[:, b * rows_per:(b + 1) * rows_per].t()).view(-1)
    down_scales = packed.scales[:blocked, Proj.DOWN].t().contiguous()
    down_zero = None
    if packed.zeros is not None:
        down_zero = ((packed.zeros[:blocked, Proj.DOWN].float() - SYMMETRIC_ZERO)
                     * packed.scales[:blocked, Proj.DOWN].float()).t().contiguous()
    return CpuExpert(packed, gate_up, sz_chunks, down, down_scales, down_zero, block_n)


def cpu_expert_prepare(layer: PackedLayer) -> CpuPreparedLayer:
    """The int4pack copy of a host layer, for the fast path (memory cost: see the module doc)."""
    if not isinstance(layer, PackedLayer):
        raise TypeError(f"layer: expected a PackedLayer, got {type(layer).__name__}")
    layout = int4pack_layout()
    return CpuPreparedLayer(layer, tuple(prepare_expert(layer.expert(e), layout) for e in range(layer.num_experts)))


def _check_supported(packed: PackedExpert) -> None:
    bias = getattr(packed, "bias", None)
    activation = getattr(packed, "activation", None)
    kind = getattr(activation, "kind", None)
    if bias is not None or (kind is not None and kind.value != "silu_glu"):
        raise ValueError("packed: the CPU expert kernel computes silu(gate) * up without biases; this expert has "
                         f"biases or another activation ({activation!r})")


# ----------------------------------------------------------------------------- implementation


def choose_impl(packed: PackedExpert | CpuExpert, x_dtype: torch.dtype, tokens: int,
                config: CpuExpertConfig = DEFAULT_CONFIG) -> CpuImpl:
    """The implementation a call takes (see :class:`CpuExpertConfig`)."""
    impl = config.impl
    precision = config.resolve(x_dtype)
    if impl is None:
        if tokens <= cpu_native.MAX_TOKENS and cpu_native.available():
            return CpuImpl.NATIVE_Q8 if precision is Precision.Q8 else CpuImpl.NATIVE_FP32
        if precision is not Precision.FP32 and isinstance(packed, CpuExpert):
            return CpuImpl.INT4PACK_BF16
        return CpuImpl.DEQUANT_FP32
    if impl in (CpuImpl.NATIVE_FP32, CpuImpl.NATIVE_Q8):
        cpu_native.load()  # raises NativeUnavailable with the reason
        if tokens > cpu_native.MAX_TOKENS:
            raise ValueError(f"x: the native CPU kernel takes at most {cpu_native.MAX_TOKENS} tokens, got {tokens}")
    elif impl is CpuImpl.INT4PACK_BF16 and not isinstance(packed, CpuExpert):
        raise ValueError("packed: CpuImpl.INT4PACK_BF16 reads the int4pack copy: pass prepare_expert(packed)")
    return impl


def kernel_info(packed: PackedExpert | CpuExpert, x_dtype: torch.dtype = torch.bfloat16,
                config: CpuExpertConfig = DEFAULT_CONFIG) -> CpuKernelInfo:
    """The implementation a call with these arguments (one token) takes, and the extra host bytes it reads."""
    impl = choose_impl(packed, x_dtype, 1, config)
    return CpuKernelInfo(impl, packed.nbytes if impl is CpuImpl.INT4PACK_BF16 else 0)


def expert_mlp_cpu_accumulate_(
    x: torch.Tensor,
    packed: PackedExpert | CpuExpert,
    token_widths: torch.Tensor | None,
    width: int | None,
    weights: torch.Tensor,
    out: torch.Tensor,
    *,
    config: CpuExpertConfig = DEFAULT_CONFIG,
    row_start: int = 0,
    threads: int | None = None,
) -> None:
    """``out += weights[:, None] * expert_k(x)`` on the CPU, reading the first ``width`` rows only.

    x: (T, H) fp32 or bf16 on the CPU; packed: a :class:`CpuExpert` (``cpu_expert_prepare``) or a
    host :class:`PackedExpert`; token_widths: (T,) int32/int64, token t uses neurons
    j < min(width, token_widths[t]) (clamped, as in ``expert_mlp``), None = all ``width``;
    weights: (T,) float32; out: (T, H) float32, contiguous.

    row_start: the neuron split (the neuron-split hybrid): only neurons
    ``row_start <= j < min(width, token_widths[t])`` are computed and read. An expert's output is a
    sum over its neurons, so ``rows [0, s)`` (e.g. on the GPU) plus ``rows [s, width)`` here is the
    expert at ``width``, up to the summation order. A bias of the down projection belongs to the
    part with ``row_start == 0`` (the GPU's in a split), added once there; this kernel refuses
    biased experts anyway (see ``_check_supported``). 0 <= row_start <= width; row_start == width
    adds nothing.

    threads: the native kernel's threads (None: this thread's torch intra-op threads); the torch paths use
    this thread's torch threads.
    """
    prepared = packed if isinstance(packed, CpuExpert) else None
    host = prepared.packed if prepared is not None else packed
    check_packed(host)
    _check_supported(host)
    check_activations(x, host)
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"x: expected fp32 or bf16 on the CPU, got {x.dtype} on {x.device}")
    width = check_width(width, host)
    tokens = x.shape[0]
    check_token_vector(token_widths, "token_widths", tokens, x.device, INDEX_DTYPES)
    check_token_vector(weights, "weights", tokens, x.device, (torch.float32,), required=True)
    if (not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or tuple(out.shape) != tuple(x.shape)
            or not out.is_contiguous() or out.device != x.device):
        got = f"{out.dtype} {tuple(out.shape)} on {out.device}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"out: expected a contiguous float32 (T, H) = {tuple(x.shape)} on the CPU, got {got}")
    if not isinstance(config, CpuExpertConfig):
        raise TypeError(f"config: expected a CpuExpertConfig, got {type(config).__name__}")
    if isinstance(row_start, bool) or not isinstance(row_start, int) or not 0 <= row_start <= width:
        raise ValueError(f"row_start: expected an int in [0, width = {width}], got {row_start!r}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads: expected None or a positive int, got {threads!r}")
    if row_start == width or tokens == 0:
        return
    impl = choose_impl(packed, x.dtype, tokens, config)
    if impl in (CpuImpl.NATIVE_FP32, CpuImpl.NATIVE_Q8):
        stop, kt = width, None
        if token_widths is not None and tokens == 1:  # one token: its width is the rows' end (no tensor op)
            stop = max(row_start, min(width, int(token_widths[0])))
        elif token_widths is not None:
            kt = token_widths.to(torch.int64).clamp(0, width).contiguous()
        # the host rows are contiguous (check_packed), so row j sits at offset j
        kernel = cpu_native.load()
        rows = kernel.rows_q8 if impl is CpuImpl.NATIVE_Q8 else kernel.rows_f32
        rows(x.float().contiguous(), host.qweight, host.scales, host.zeros, host.fmt.group_size,
             kt, row_start, stop, weights.contiguous(), out, torch.get_num_threads() if threads is None else threads)
        return
    keep = None  # (T, width - row_start): token t uses neuron row_start + j
    if token_widths is not None:
        k_t = token_widths.to(torch.int64).clamp(0, width)
        keep = torch.arange(row_start, width).unsqueeze(0) < k_t.unsqueeze(1)
    scale = weights.unsqueeze(1)

    def kept(a, b):
        return None if keep is None else keep[:, a - row_start:b - row_start]

    # The int4pack op runs whole B-neuron blocks: [b0, b1); the fp32 path the < B neurons before
    # b0 (a split inside a block) and after b1 (past the last block), from the host rows.
    b0 = b1 = row_start
    if impl is CpuImpl.INT4PACK_BF16:
        block = prepared.block_n
        b0 = min(width, -(-row_start // block) * block)
        b1 = max(b0, min(width // block * block, prepared.blocked_width))
        xb = x.to(torch.bfloat16)  # the operand rounding Precision.BF16 allows (exact for bf16 x)
        x = xb.float()
        if b1 > b0:
            _int4pack_accumulate(xb, prepared, b0, b1, kept(b0, b1), scale, out)
        if b0 > row_start:
            _dequant_accumulate(x, host, row_start, b0, kept(row_start, b0), scale, out, config.chunk)
    if b1 < width:  # the fp32 path; under BF16 only the < B neurons past the last block
        _dequant_accumulate(x.float(), host, b1, width, kept(b1, width), scale, out, config.chunk)


def _dequant_accumulate(x, packed, start, stop, keep, scale, out, chunk) -> None:
    """Neurons start..stop from the host rows, dequantized ``chunk`` at a time, in fp32."""
    dtype = torch.float32
    g = packed.fmt.group_size
    acc = torch.zeros(out.shape, dtype=torch.float32)
    for c0 in range(start, stop, chunk):
        c1 = min(stop, c0 + chunk)
        zeros = None if packed.zeros is None else packed.zeros[c0:c1]
        rows = dequantize_rows(unpack_nibbles(packed.qweight[c0:c1]), packed.scales[c0:c1], zeros, g, dtype)
        gate = F.linear(x, rows[:, Proj.GATE]).float()
        up = F.linear(x, rows[:, Proj.UP]).float()
        hidden = F.silu(gate) * up  # (T, n) fp32
        if keep is not None:
            hidden = hidden * keep[:, c0 - start:c1 - start]
        acc += hidden @ rows[:, Proj.DOWN]
    out.add_(acc * scale)


def _int4pack_accumulate(xb, expert: CpuExpert, start: int, stop: int, keep, scale, out) -> None:
    """Neurons start..stop (multiples of the layout's block B) through torch's int4pack CPU op.

    A neuron range is a row range of the gate/up matrix (B-row blocks) and a K range of each down
    block (K-major: bytes [R start / 2, R stop / 2), checked in the tests)."""
    mm = torch.ops.aten._weight_int4pack_mm_for_cpu
    packed = expert.packed
    g, hidden, tokens = packed.fmt.group_size, packed.hidden_size, xb.shape[0]
    n = stop - start
    gu = torch.empty(tokens, 2 * n, dtype=torch.bfloat16)
    for i in range(start // GATE_UP_CHUNK, -(-stop // GATE_UP_CHUNK)):
        c0, c1 = max(start, i * GATE_UP_CHUNK), min(stop, (i + 1) * GATE_UP_CHUNK)
        sz = expert.gate_up_sz[i]
        lo, hi = 2 * (c0 - i * GATE_UP_CHUNK), 2 * (c1 - i * GATE_UP_CHUNK)
        if (lo, hi) != (0, sz.shape[1]):  # the op reads its scales as contiguous: copy a partial chunk's
            sz = sz[:, lo:hi].contiguous()
        gu[:, 2 * (c0 - start): 2 * (c1 - start)] = mm(xb, expert.gate_up[2 * c0: 2 * c1], g, sz)
    gu = gu.view(tokens, n // expert.block_n, 2, expert.block_n).float()
    h = (F.silu(gu[:, :, 0]) * gu[:, :, 1]).reshape(tokens, n)  # fp32
    if keep is not None:
        h = h * keep
    s = expert.down_scales[:, start:stop]  # (G, n): neuron j's scale per group of H
    rows = expert.down_rows
    per_group = g // rows  # down blocks sharing one scale column (2 at g 128)
    unit = torch.zeros(n // DOWN_K_GROUP, rows, 2, dtype=torch.bfloat16)
    unit[..., 0] = 1.0  # weight = (q - 8) * 1 + 0, exact
    blocks = hidden // rows
    # each block's K range is contiguous (a view of its byte range)
    weights_b = expert.down[:, rows * start // 2: rows * stop // 2].view(blocks, rows, n // 2)
    # h * s[g] for the groups at once into one bf16 buffer (one op, not one per block: the per-call
    # overhead dominated at small widths), in batches of at most _HS_ELEMENTS.
    groups = hidden // g
    per_batch = max(1, _HS_ELEMENTS // (tokens * n))
    ys = []
    for g0 in range(0, groups, per_batch):
        g1 = min(groups, g0 + per_batch)
        hs = torch.empty(g1 - g0, tokens, n, dtype=torch.bfloat16)
        torch.mul(s[g0:g1].unsqueeze(1), h.unsqueeze(0), out=hs)
        ys += [mm(hs[b // per_group - g0], weights_b[b], DOWN_K_GROUP, unit)
               for b in range(g0 * per_group, g1 * per_group)]
    y = torch.stack(ys, dim=1)  # (T, blocks, rows) bf16
    # The zero points: (q - z) s = (q - 8) s - (z - 8) s, the second term per neuron and group.
    y = y.view(tokens, hidden // g, g).float()
    if expert.down_zero is not None:
        y -= (h @ expert.down_zero[:, start:stop].t()).unsqueeze(-1)
    out.add_(y.view(tokens, hidden) * scale)


# ----------------------------------------------------------------------------- reference check


def reference_check(x, packed: PackedExpert | CpuExpert, token_widths, width, weights,
                    config: CpuExpertConfig = DEFAULT_CONFIG, row_start: int = 0) -> float:
    """Relative error ``||out - ref|| / ||ref||`` of one call against the float64 reference
    (``expert_mlp_ref``) on the same host rows; what ``crisp-bench cpu`` checks before timing.
    With ``row_start`` the reference is the float64 expert at ``width`` minus at ``row_start``
    (the rows [row_start, width), same token widths)."""
    from .expert_mlp import expert_mlp_ref

    host = packed.packed if isinstance(packed, CpuExpert) else packed
    out = torch.zeros(x.shape, dtype=torch.float32)
    expert_mlp_cpu_accumulate_(x, packed, token_widths, width, weights, out, config=config, row_start=row_start)
    ref = expert_mlp_ref(x, host, width, token_widths=token_widths, compute_dtype=torch.float64)
    if row_start:
        ref = ref - expert_mlp_ref(x, host, row_start, token_widths=token_widths, compute_dtype=torch.float64)
    ref = ref * weights.double().unsqueeze(1)
    norm = ref.norm()
    if norm == 0:
        return 0.0 if torch.count_nonzero(out) == 0 else float("inf")
    return ((out.double() - ref).norm() / norm).item()


def tolerance(precision: Precision) -> float:
    """The kernels' tolerances against the float64 reference (tests/test_expert_mlp.py): 1e-5 in fp32, 2u of
    bf16 when the operands are rounded to bf16, and with 8-bit activations 2**-5 = 8 half-steps of int8
    (8 / 254): x and the down coefficients are each rounded to 1/254 of their block's largest magnitude
    (about 0.6% relative rms for Gaussian blocks), three such roundings in series give 0.85-1.2% on random
    experts (tests/test_cpu_expert_q8.py)."""
    if precision is Precision.FP32:
        return 1e-5
    return 2.0**-5 if precision is Precision.Q8 else 2 * 2.0**-8
