"""``crisp-bench kernels``: the expert kernels against what one would use instead.

For each model shape, token count T and width k (a fraction of I), one random packed expert is
timed three ways on the same activations:

- ``crisp``: :func:`crisp_kernels.expert_mlp` (compiled Triton on CUDA; on a CPU the torch
  reference unless ``TRITON_INTERPRET=1``), reading the first k neurons of the packed weights;
- ``dequant_linear``: the torch reference path, dequantize the first k neurons then ``F.linear``;
- ``fp16_linear``: ``F.linear`` on dense fp16 weights of the same first k neurons (gate and up
  concatenated into one matmul): the unquantized baseline, 3.6x the bytes.

Every variant is first checked against a float64 reference on the same packed weights; a
variant off by more than its tolerance aborts the sweep. Then each is timed: CUDA events
around each call, the L2 cache flushed before each call (a 256 MiB write; a just-loaded expert
is not L2-resident in a real offloading step), warmup, median of N. The table reports us per
variant, GB/s of the bytes the kernel must read (``nbytes(k)`` of the prefix + the
activations), that as % of this device's copy bandwidth measured in the same run (a large
``copy_``, counted as read + write), speedups over the baselines, and ``width_scaling`` =
time(k) / (time(I) * k / I): 1.0 when time is proportional to width, above 1 when fixed costs
(launches, tails) dominate narrow widths.

``run_kernel_sweep(...) -> list[dict]`` is the sweep; ``add_parser`` / ``run`` are the subcommand (its JSON is
the crisp-bench document, ``report.write_json``). Shapes come from ``shapes`` (a name, ``tiny`` or ``HxI``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from crisp_kernels import Backend, PackedExpert, QuantFormat, dequantize_expert, expert_mlp, expert_mlp_ref
from crisp_kernels.expert_mlp import select_backend
from crisp_kernels.format import TAIL_QMAX, rows_for_neurons
from crisp_runtime import cli_args as ca

from . import common, report
from .shapes import ModelShape, ShapeError, resolve_shape, shape_names

GPU_SHAPES = ("mixtral", "deepseek", "qwen3")
DEFAULT_WIDTHS = (0.25, 0.5, 0.75, 1.0)
DEFAULT_TOKENS = (1, 4, 16, 128)
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
_UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}
_L2_FLUSH_BYTES = 256 << 20


def sweep_nbytes(shape: ModelShape, fmt: QuantFormat) -> int:
    """About the peak bytes the sweep holds for one expert of ``shape``: its packed rows, its weights dequantized to
    fp16 (gate and up concatenated once more for ``fp16_linear``) and to float64 (the reference)."""
    weights = 3 * shape.hidden_size * shape.intermediate_size
    return shape.intermediate_size * fmt.neuron_nbytes(shape.hidden_size) + weights * (2 + 8) + 2 * weights * 2 // 3


def device_memory_nbytes(device: torch.device) -> int | None:
    """The memory of ``device``: a GPU's total, a CPU's physical memory (None where it cannot be read)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory  # GPU-only
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


def shape_memory_problem(shape: ModelShape, fmt: QuantFormat, device: torch.device) -> str | None:
    """Why one expert of ``shape`` cannot be swept on ``device`` (more memory than it has), or None."""
    need, have = sweep_nbytes(shape, fmt), device_memory_nbytes(device)
    if have is None or need <= have:
        return None
    return (f"one expert of H={shape.hidden_size} x I={shape.intermediate_size} needs about {need / 1e9:,.1f} GB "
            f"for the sweep (its packed rows, fp16 and float64 copies of its weights); {device} has "
            f"{have / 1e9:,.1f} GB")


def random_packed_expert(shape: ModelShape, fmt: QuantFormat, device, seed: int = 0) -> PackedExpert:
    """Random codes, scales and zero points with outputs of order 1 (no fp16 overflow)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden, inter = shape.hidden_size, shape.intermediate_size
    groups = hidden // fmt.group_size
    q = torch.randint(0, 256, (inter, 3, hidden // 2), generator=gen, device=device, dtype=torch.uint8)
    # (q - z) has std ~4.6; scale so that each dot product has std ~1 (gate/up sum over H, down over I)
    fan_in = torch.tensor([hidden, hidden, inter], device=device, dtype=torch.float32)
    base = (1.0 / (4.6 * fan_in.sqrt())).view(1, 3, 1)
    jitter = 0.5 + torch.rand(inter, 3, groups, generator=gen, device=device)
    scales = (base * jitter).to(torch.float16)
    zeros = None
    if not fmt.symmetric:
        zeros = torch.randint(0, 16, (inter, 3, groups), generator=gen, device=device, dtype=torch.uint8)
    return PackedExpert(fmt, q, scales, zeros)


def random_tail_expert(packed: PackedExpert, tail_start: int, seed: int = 0) -> PackedExpert:
    """``packed``'s first ``tail_start`` rows and random 2-bit tail rows after them (format.py, "2-bit tail
    rows"), holding the same neurons (I = ``packed.width``), outputs of the same order."""
    device, inter = packed.device, packed.width
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    rows = rows_for_neurons(inter, tail_start) - tail_start
    q = torch.randint(0, 256, (rows, *packed.qweight.shape[1:]), generator=gen, device=device, dtype=torch.uint8)
    # 2-bit (q - z) has std ~1.1 against 4-bit's ~4.6: scales x 4 keep each dot product's std near 1
    scales = (packed.scales[tail_start:tail_start + 1].float() * 4).expand(rows, -1, -1).to(torch.float16)
    zeros = torch.randint(0, TAIL_QMAX + 1, (rows, *packed.zeros.shape[1:]), generator=gen, device=device,
                          dtype=torch.uint8)

    def cat(head, tail):
        return torch.cat((head[:tail_start], tail)).contiguous()

    return PackedExpert(packed.fmt, cat(packed.qweight, q), cat(packed.scales, scales), cat(packed.zeros, zeros),
                        tail_start=tail_start)


def time_us(fn: Callable[[], object], device: torch.device, *, warmup: int, iters: int, flush: bool = True) -> float:
    """Median microseconds per call: CUDA events (L2 flushed before each call) or perf_counter."""
    for _ in range(warmup):
        fn()
    common.sync(device)
    times = []
    if device.type == "cuda":
        scratch = torch.empty(_L2_FLUSH_BYTES, dtype=torch.uint8, device=device) if flush else None
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in events:
            if scratch is not None:
                scratch.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        times = [start.elapsed_time(end) * 1e3 for start, end in events]
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def copy_bandwidth_gbps(device: torch.device, *, nbytes: int, warmup: int, iters: int) -> float:
    """Device-to-device ``copy_`` bandwidth, counting bytes read + bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src), device, warmup=warmup, iters=iters, flush=False)
    return 2 * nbytes / (us * 1e-6) / 1e9


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def _variants(x, packed: PackedExpert, width: int, backend) -> dict[str, Callable[[], torch.Tensor]]:
    gate, up, down = dequantize_expert(packed, width, dtype=torch.float16)
    gate_up = torch.cat((gate, up)).contiguous()  # (2k, H): one matmul for both
    down = down.contiguous()  # (H, k)
    x16 = x.to(torch.float16)

    def fp16_linear():
        g, u = F.linear(x16, gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(g) * u, down)

    return {
        "crisp": lambda: expert_mlp(x, packed, width, backend=backend),
        "dequant_linear": lambda: expert_mlp(x, packed, width, backend=Backend.TORCH),
        "fp16_linear": fp16_linear,
    }


def _tolerance(variant: str, dtype: torch.dtype) -> float:
    # crisp / the reference path: output rounding plus one rounding of the dot operands (2u,
    # see tests/test_expert_mlp.py); fp16_linear also rounds the dequantized weights to fp16.
    u = _UNIT_ROUNDOFF[dtype] if variant != "fp16_linear" else _UNIT_ROUNDOFF[torch.float16]
    return max(4 * u if variant == "fp16_linear" else 2 * u, 1e-5)


def run_kernel_sweep(
    shapes: Sequence[str] = ("tiny",),
    widths: Sequence[float] = DEFAULT_WIDTHS,
    tokens: Sequence[int] = DEFAULT_TOKENS,
    *,
    device: str | torch.device | None = None,
    dtype: str = "fp16",
    group_size: int = 64,
    symmetric: bool = False,
    warmup: int | None = None,
    iters: int | None = None,
    quick: bool = False,
    backend: Backend | str | None = None,
    copy_bytes: int | None = None,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
    tail_start: float | None = None,
) -> list[dict]:
    """One record per (shape, T, width); see the module docstring for the fields' meaning.

    tail_start: also time the same neurons stored with a 2-bit tail from this fraction of I on
    (``crisp_tail``: the 4-bit head's kernels then the 2-bit tail's, checked against its own float64
    reference), e.g. 0.25 for ``crisp_tools.tail_pack --layout 2g128@0.25``; None: not timed."""
    if tail_start is not None and not 0.0 <= float(tail_start) < 1.0:
        raise ValueError(f"tail_start {tail_start}: must lie in [0, 1) (the fraction of I kept 4-bit)")
    if tail_start is not None and symmetric:
        raise ValueError("tail_start: a 2-bit tail needs the asymmetric format (zero points)")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose from {', '.join(_DTYPES)}")
    act_dtype = _DTYPES[dtype]
    fmt = QuantFormat(group_size=group_size, symmetric=symmetric)
    resolved = [resolve_shape(s, allow_hxi=True) for s in shapes]
    for f in widths:
        if not 0.0 < float(f) <= 1.0:
            raise ValueError(f"width fraction {f}: must lie in (0, 1]")
    for t in tokens:
        if int(t) < 1:
            raise ValueError(f"token count {t}: must be >= 1")
    for s in resolved:
        fmt.check_hidden_size(s.hidden_size, f"shape {s.name}: hidden size")
        if (why := shape_memory_problem(s, fmt, device)) is not None:
            raise ValueError(f"shape {s.name}: {why}")
    if warmup is None:
        warmup = 2 if quick else 10
    if iters is None:
        iters = 5 if quick else (50 if device.type == "cuda" else 20)
    chosen = Backend(backend) if backend is not None else select_backend(device)
    copy_bytes = copy_bytes or ((1 << 30) if device.type == "cuda" else (64 << 20))
    copy_gbps = copy_bandwidth_gbps(device, nbytes=copy_bytes, warmup=2, iters=max(5, iters // 2))

    fractions = sorted({float(f) for f in widths})
    total = len(resolved) * len(tokens) * len(fractions)
    done = 0
    records = []
    for shape in resolved:
        packed = random_packed_expert(shape, fmt, device, seed)
        tail = None
        if tail_start is not None:
            tail = random_tail_expert(packed, round(float(tail_start) * shape.intermediate_size), seed)
        for num_tokens in tokens:
            gen = torch.Generator(device=device).manual_seed(seed + num_tokens)
            x = torch.randn(int(num_tokens), shape.hidden_size, generator=gen, device=device).to(act_dtype)
            full_us: dict[str, float] = {}
            rows = []
            # full width first: every narrower row is compared with it
            for frac in sorted(set(fractions) | {1.0}, reverse=True):
                width = max(1, round(frac * shape.intermediate_size))
                variants = _variants(x, packed, width, chosen)
                ref = expert_mlp_ref(x, packed, width, compute_dtype=torch.float64)
                errs = {}
                for name, fn in variants.items():
                    errs[name] = _rel_err(fn(), ref)
                    if not errs[name] <= _tolerance(name, act_dtype):
                        raise ValueError(
                            f"{name} is wrong at {shape.name} T={num_tokens} k={width}: relative error "
                            f"{errs[name]:.2e} > {_tolerance(name, act_dtype):.1e}"
                        )
                us = {name: time_us(fn, device, warmup=warmup, iters=iters) for name, fn in variants.items()}
                del variants
                if frac == 1.0:
                    full_us = us
                bytes_read = packed.nbytes(width) + x.numel() * x.element_size()
                gbps = bytes_read / (us["crisp"] * 1e-6) / 1e9
                row = {
                    "shape": shape.name,
                    "hidden": shape.hidden_size,
                    "intermediate": shape.intermediate_size,
                    "tokens": int(num_tokens),
                    "width_fraction": frac,
                    "width": width,
                    "dtype": dtype,
                    "backend": chosen.value,
                    "device": str(device),
                    "bytes_read": bytes_read,
                    "us_crisp": us["crisp"],
                    "us_dequant_linear": us["dequant_linear"],
                    "us_fp16_linear": us["fp16_linear"],
                    "gb_per_s": gbps,
                    "copy_gb_per_s": copy_gbps,
                    "pct_copy_bw": 100.0 * gbps / copy_gbps,
                    "x_vs_dequant_linear": us["dequant_linear"] / us["crisp"],
                    "x_vs_fp16_linear": us["fp16_linear"] / us["crisp"],
                    "width_scaling": us["crisp"] / (full_us["crisp"] * width / shape.intermediate_size),
                    "err_crisp": errs["crisp"],
                    "err_dequant_linear": errs["dequant_linear"],
                    "err_fp16_linear": errs["fp16_linear"],
                }
                if tail is not None:
                    row.update(_tail_timing(x, tail, width, chosen, act_dtype, device, warmup, iters, us["crisp"],
                                            shape, num_tokens))
                if frac in fractions:
                    rows.append(row)
                    done += 1
                    if progress is not None:
                        progress(done, total)
            records.extend(sorted(rows, key=lambda r: r["width_fraction"]))
        del packed
    return records


def _tail_timing(x, tail: PackedExpert, width: int, backend, act_dtype, device, warmup, iters, us_4bit, shape,
                 num_tokens) -> dict:
    """The ``crisp_tail`` fields of one row: the same ``width`` neurons read from the tail expert's rows."""
    rows = rows_for_neurons(width, tail.tail_start)
    ref = expert_mlp_ref(x, tail, rows, compute_dtype=torch.float64)
    err = _rel_err(expert_mlp(x, tail, rows, backend=backend), ref)
    if not err <= _tolerance("crisp", act_dtype):
        raise ValueError(f"crisp_tail is wrong at {shape.name} T={num_tokens} k={width}: relative error {err:.2e} > "
                         f"{_tolerance('crisp', act_dtype):.1e}")
    us = time_us(lambda: expert_mlp(x, tail, rows, backend=backend), device, warmup=warmup, iters=iters)
    nbytes = tail.nbytes(rows) + x.numel() * x.element_size()
    return {"tail_start": tail.tail_start, "tail_rows": rows, "bytes_read_tail": nbytes, "us_crisp_tail": us,
            "gb_per_s_tail": nbytes / (us * 1e-6) / 1e9, "x_tail_vs_4bit": us_4bit / us, "err_crisp_tail": err}


# ---------------------------------------------------------------------------- crisp-bench kernels


def csv_shapes(text: str) -> list[str]:
    """Comma-separated shape specs, each checked with ``resolve_shape`` (an argparse type)."""
    names = [v.strip() for v in str(text).split(",") if v.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected at least one shape")
    for name in names:
        try:
            resolve_shape(name, allow_hxi=True)
        except ShapeError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return names


# (record field, column title) of the subcommand's table
COLUMNS = [("shape", "shape"), ("tokens", "T"), ("width_fraction", "width"), ("backend", "backend"),
                      ("us_crisp", "crisp us"), ("us_dequant_linear", "dequant+linear us"),
                      ("us_fp16_linear", "fp16 linear us"), ("gb_per_s", "crisp GB/s"), ("pct_copy_bw", "% copy bw"),
                      ("x_vs_dequant_linear", "x dequant"), ("x_vs_fp16_linear", "x fp16"),
                      ("width_scaling", "width scaling")]


TAIL_COLUMNS = [("shape", "shape"), ("tokens", "T"), ("width_fraction", "width"), ("tail_rows", "rows"),
                ("us_crisp", "4-bit us"), ("us_crisp_tail", "tail us"), ("gb_per_s_tail", "tail GB/s"),
                ("x_tail_vs_4bit", "x 4-bit")]


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("kernels", help="expert kernels vs dequantize+F.linear and fp16 F.linear",
                              description="The kernels sweep (widths x token counts x model shapes): us, GB/s of "
                              "prefix bytes, % of measured copy bandwidth; every variant is checked against the "
                              "reference first.")
    p.add_argument("--shapes", default=None, type=csv_shapes,
                   help=f"model shapes, comma separated: {', '.join(shape_names())} or HxI (default: "
                   f"{','.join(GPU_SHAPES)} on CUDA, tiny on a CPU)")
    p.add_argument("--widths", type=common.fractions, default="0.25,0.5,1.0",
                   help="width fractions in (0, 1], comma separated")
    p.add_argument("--tokens", type=common.int_list, default="1,4", help="token counts (>= 1), comma separated")
    p.add_argument("--device", default=None, type=ca.device_name, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="fp16", help="activation dtype")
    p.add_argument("--group-size", type=int, choices=(32, 64, 128), default=64, help="quantization group size")
    p.add_argument("--symmetric", action="store_true", help="symmetric format (no zero points)")
    p.add_argument("--backend", choices=[b.value for b in Backend], default=None,
                   help="backend of the crisp variant (default: chosen from the device)")
    p.add_argument("--warmup", type=ca.nonnegative_int, default=None,
                   help="warmup calls per variant (default: 10, quick: 2)")
    p.add_argument("--iters", type=ca.positive_int, default=None,
                   help="timed calls per variant (default: 50 on CUDA, 20 on a CPU, quick: 5)")
    p.add_argument("--quick", action="store_true", help="fewest repetitions")
    p.add_argument("--tail-start", type=ca.float_in(0.0, 1.0, high_open=True), default=None, metavar="F",
                   help="also time the same neurons with a 2-bit tail from fraction F of I on (a crisp_tools.tail_pack "
                   "pack, e.g. 0.25 for 2g128@0.25): its us, GB/s and speed-up over the 4-bit rows")
    common.add_outputs(p)


def run(args) -> int:
    """``run_kernel_sweep`` on the device of this machine, printed, plotted and saved."""
    auto = args.device in (None, "auto")
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if auto else args.device)
    names = args.shapes or (list(GPU_SHAPES) if device.type == "cuda" else ["tiny"])
    fmt = QuantFormat(group_size=args.group_size, symmetric=args.symmetric)
    for name in names:  # before any allocation: a shape larger than this machine
        if (why := shape_memory_problem(resolve_shape(name, allow_hxi=True), fmt, device)) is not None:
            raise common.CliError(f"--shapes {name}: {why}")
    try:
        records = run_kernel_sweep(
            names, args.widths, args.tokens, device=device, dtype=args.dtype, group_size=args.group_size,
            symmetric=args.symmetric, warmup=args.warmup, iters=args.iters, quick=args.quick, backend=args.backend,
            progress=report.Progress("kernels"), tail_start=args.tail_start,
        )
    except (ValueError, KeyError) as exc:
        raise common.CliError(f"kernels: {exc}") from exc
    if records:
        r = records[0]
        print(f"device {r['device']}, backend {r['backend']}, activations {r['dtype']}, "
              f"copy bandwidth {r['copy_gb_per_s']:.1f} GB/s (read + write)")
        print(report.table(records, COLUMNS,
                           title="kernels (us, GB/s of prefix bytes, % of copy bandwidth)"))
        if args.tail_start is not None:
            print(report.table(records, TAIL_COLUMNS, title="the same neurons with a 2-bit tail (us, GB/s of its "
                               "bytes, speed-up over the 4-bit rows)"))
    else:
        print("kernels: the sweep returned no records")
    if args.plot and records:
        plot(args.plot, records)
        print(f"wrote {args.plot}")
    common.emit(args, "kernels", records)
    return 0


def plot(path, records: Sequence[dict]) -> None:
    """GB/s of prefix bytes against width fraction, one line per (shape, tokens)."""
    series: dict = {}
    for r in records:
        series.setdefault(f"{r['shape']} T={r['tokens']}", []).append((r["width_fraction"], r["gb_per_s"]))
    report.plot_lines(path, series, xlabel="width_fraction", ylabel="gb_per_s",
                      title=f"crisp expert kernel ({records[0]['device']})", note=report.environment()["date"])

