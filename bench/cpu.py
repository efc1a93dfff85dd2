"""``crisp-bench cpu``: the CPU expert kernel in GB/s of prefix bytes against this machine's memcpy.

For each model shape, width and token count, one call of
``crisp_kernels.cpu_expert.expert_mlp_cpu_accumulate_`` (the runtime's code, not a copy) is
checked against the float64 reference, then timed with the host memcpy and a read-only
reduction interleaved in the same rounds (a shared, loaded machine drifts: medians of rounds).
Each call reads one of several copies of the expert in turn (:func:`cold_copies`, 256 MB in all), so the
kernel streams its bytes from memory as in a decode, never from what the previous call left in the cache.

Prefix bytes are the packed format's bytes of the first k neurons (``PackedExpert.nbytes(k)``,
6,720 B per neuron at H 4096, g 64), whatever layout the implementation reads (the int4pack copy
holds 6,656 B per neuron). memcpy GB/s counts bytes copied (each read once and written once);
read GB/s is ``sum`` over an fp32 buffer.

``--candidates`` also times the other implementations measured for docs/cpu-kernel.md on one
gate-like matrix (I x H): torch's int4pack op with fp32 and bf16 activations, and a chunked
dequant + matmul in fp32 and bf16.

:func:`measure_cpu_expert` is the entry the measured hardware profile calls: CPU seconds
against width at one token.
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
from dataclasses import replace

import torch

from crisp_kernels import cpu_native
from crisp_kernels.cpu_expert import (
    CpuExpertConfig,
    CpuImpl,
    CpuKernelInfo,
    Precision,
    expert_mlp_cpu_accumulate_,
    kernel_info,
    prepare_expert,
    reference_check,
    tolerance,
)
from crisp_kernels.format import PackedExpert, QuantFormat, dequantize_rows, unpack_nibbles
from crisp_runtime import cli_args as ca
from crisp_runtime.cpu.experts import EXACT, CpuExpertsConfig

from . import common, report
from .common import CliError
from .shapes import ModelShape, resolve_shapes

# 256 MB: far beyond any cache of this class of machine (L3 tens of MB), small enough for a laptop.
MEMCPY_BYTES = 256 * 2**20
# Each timed call reads a copy of the expert that no call has read for at least this many bytes of the other
# copies (the copies are taken in turn by every point of a run): an expert smaller than the last-level cache is
# not timed from it. One H 2048 x I 5632 expert (19 MB) timed call after call ran partly from a 32 MB L3: 108% of
# a streaming read on two cores of a 2-core AMD EPYC VM (Zen 4), where its decode reads each expert from DRAM.
COLD_BYTES = MEMCPY_BYTES
MAX_COPIES = 64  # a tiny test shape needs no more to be out of L2
DEFAULT_REPEATS = 5


class CpuBenchError(CliError):
    pass


def random_expert(shape: ModelShape, seed: int = 0) -> PackedExpert:
    """A packed expert of ``shape`` with random codes, scales and zero points (quantizing real fp32
    weights of a Mixtral expert would need ~4 GB and minutes on a 2-core VM; the kernel's time does
    not depend on the values)."""
    fmt = QuantFormat(group_size=shape.group_size, symmetric=shape.symmetric)
    gen = torch.Generator().manual_seed(seed)
    inter, hidden, groups = shape.intermediate_size, shape.hidden_size, shape.hidden_size // shape.group_size
    qweight = torch.randint(0, 256, (inter, 3, hidden // 2), generator=gen, dtype=torch.uint8)
    # Scales around 1 / (15 sqrt(H)): outputs of order one, as with trained weights.
    scales = ((torch.rand(inter, 3, groups, generator=gen) + 0.5) / (15 * hidden**0.5)).half()
    zeros = None if fmt.symmetric else torch.randint(4, 12, (inter, 3, groups), generator=gen, dtype=torch.uint8)
    return PackedExpert(fmt, qweight, scales, zeros)


class _Rounds:
    """Named thunks timed in interleaved rounds; medians per name."""

    def __init__(self) -> None:
        self.thunks: dict[str, callable] = {}
        self.times: dict[str, list[float]] = {}

    def add(self, name, fn) -> None:
        fn()  # warm-up (allocations, first-call dispatch)
        self.thunks[name] = fn
        self.times[name] = []

    def run(self, repeats: int) -> dict[str, float]:
        for _ in range(repeats):
            for name, fn in self.thunks.items():
                t0 = time.perf_counter()
                fn()
                self.times[name].append(time.perf_counter() - t0)
        return {name: statistics.median(ts) for name, ts in self.times.items()}


def _memory_thunks(rounds: _Rounds, nbytes: int) -> None:
    src = torch.empty(nbytes // 4, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    rounds.add("memcpy", lambda: dst.copy_(src))
    rounds.add("read", lambda: src.sum())


def _width_neurons(shape: ModelShape, fraction: float) -> int:
    return max(1, round(fraction * shape.intermediate_size))


def cold_copies(packed: PackedExpert, nbytes: int = COLD_BYTES) -> list[PackedExpert]:
    """``packed`` and copies of it in memory of their own, enough that reading each in turn covers ``nbytes``
    (at most :data:`MAX_COPIES`)."""
    count = max(1, min(MAX_COPIES, -(-nbytes // packed.nbytes())))
    return [packed] + [replace(packed, qweight=packed.qweight.clone(), scales=packed.scales.clone(),
                               zeros=None if packed.zeros is None else packed.zeros.clone())
                       for _ in range(count - 1)]


def _call(x, experts, width, weights, config, turns):
    """One point's timed call; ``turns``: the copy indices, one iterator shared by every point of a run, so two
    calls in a row never read the same copy."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    return lambda: expert_mlp_cpu_accumulate_(x, experts[next(turns)], None, width, weights, out, config=config)


def validated_inputs(expert, hidden, width, tokens, config, seed=1):
    """Activations and routing weights for one point, after checking the call against the reference
    (the native and dequant paths compute in fp32: held to the fp32 tolerance)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)  # bf16 values, as the runtime passes
    x = x.float() if config.precision is Precision.FP32 else x
    weights = torch.rand(tokens, generator=gen) + 0.5
    err = reference_check(x, expert, None, width, weights, config)
    fp32 = config.impl in (CpuImpl.NATIVE_FP32, CpuImpl.DEQUANT_FP32)
    q8 = config.impl is CpuImpl.NATIVE_Q8
    tol = tolerance(Precision.FP32 if fp32 else Precision.Q8 if q8 else config.resolve(x.dtype))
    if not err <= tol:
        raise CpuBenchError(f"the CPU kernel differs from the reference at width {width}, T={tokens}: relative "
                            f"error {err:.2e} > {tol:.1e}; not timing it")
    return x, weights, err


def default_impl(precision: Precision) -> CpuImpl:
    """What the runtime's CPU experts take by default at this precision (its own rule,
    ``CpuExpertsConfig.impl``: the native kernel where it builds, else int4pack for bf16 and the
    exact dequant path for fp32)."""
    return (EXACT if precision is Precision.FP32 else CpuExpertsConfig()).impl


def measure(shape: ModelShape, fractions, tokens_list, repeats: int, *, precision: Precision = Precision.BF16,
            impls=None, memcpy_bytes: int = MEMCPY_BYTES) -> tuple[list[dict], dict]:
    """Records per (implementation, width, tokens) and the memory figures, all timed in the same
    interleaved rounds (the machine's drift hits every implementation alike: a fair A/B).
    impls: CpuImpl values, None = [:func:`default_impl`]; INT4PACK_BF16 times the int4pack copy
    (built before timing). ``memory["extra_nbytes"]``: per implementation, its second copy's bytes."""
    copies = cold_copies(random_expert(shape))
    turns = itertools.cycle(range(len(copies)))
    impls = [default_impl(precision)] if impls is None else list(dict.fromkeys(impls))
    rounds = _Rounds()
    _memory_thunks(rounds, memcpy_bytes)
    points, extra = [], {}
    for impl in impls:
        experts = [prepare_expert(c) for c in copies] if impl is CpuImpl.INT4PACK_BF16 else copies
        expert = experts[0]
        config = CpuExpertConfig(precision, impl=impl)
        extra[impl.value] = kernel_info(expert, torch.bfloat16 if precision is Precision.BF16 else torch.float32,
                                        config).extra_nbytes
        for fraction in fractions:
            width = _width_neurons(shape, fraction)
            for tokens in tokens_list:
                x, weights, err = validated_inputs(expert, shape.hidden_size, width, tokens, config)
                name = f"{impl.value}/{width}/{tokens}"
                rounds.add(name, _call(x, experts, width, weights, config, turns))
                points.append((name, impl.value, width, tokens, err))
    load_before = os.getloadavg()
    med = rounds.run(repeats)
    load_after = os.getloadavg()
    memcpy_gbps = memcpy_bytes / med["memcpy"] / 1e9
    read_gbps = memcpy_bytes / med["read"] / 1e9
    full = {(impl, tokens): med[name] for name, impl, w, tokens, _ in points if w == shape.intermediate_size}
    records = []
    for name, impl, width, tokens, err in points:
        seconds = med[name]
        nbytes = copies[0].nbytes(width)
        gbps = nbytes / seconds / 1e9
        rec = {"shape": shape.name, "impl": impl, "width": width, "width_frac": width / shape.intermediate_size,
               "tokens": tokens, "ms": seconds * 1e3, "prefix_mb": nbytes / 1e6, "gbps": gbps,
               "memcpy_gbps": memcpy_gbps, "pct_memcpy": 100 * gbps / memcpy_gbps, "read_gbps": read_gbps,
               "pct_read": 100 * gbps / read_gbps, "rel_err": err}
        if (impl, tokens) in full:
            rec["time_frac"] = seconds / full[impl, tokens]  # against k / I: the prefix's proportionality
        records.append(rec)
    memory = {"memcpy_gbps": memcpy_gbps, "read_gbps": read_gbps, "memcpy_bytes": memcpy_bytes,
              "extra_nbytes": extra, "loadavg_before": load_before, "loadavg_after": load_after,
              "threads": torch.get_num_threads(), "repeats": repeats, "expert_copies": len(copies)}
    return records, memory


def measure_cpu_expert(shape: ModelShape, widths, *, repeats: int = DEFAULT_REPEATS,
                       impl: CpuImpl | None = None) -> dict:
    """CPU seconds of one token through one expert of ``shape`` at each width (neurons), by the
    kernel the runtime uses (:func:`default_impl`, or ``impl``), with this machine's memcpy measured alongside.

    Returns ``{"impl", "widths", "seconds", "prefix_bytes", "gbps", "memcpy_gbps", "read_gbps",
    "loadavg", "threads", "info"}`` (``info``: a CpuKernelInfo with the full-width GB/s); each width
    is checked against the reference before it is timed.
    """
    widths = [int(w) for w in widths]
    if not widths or any(not 1 <= w <= shape.intermediate_size for w in widths):
        raise CpuBenchError(f"widths: expected neuron counts in [1, {shape.intermediate_size}], got {widths}")
    fractions = sorted({w / shape.intermediate_size for w in widths} | {1.0})
    records, memory = measure(shape, fractions, [1], repeats, impls=None if impl is None else [impl])
    by_width = {r["width"]: r for r in records}
    chosen = [by_width[_width_neurons(shape, w / shape.intermediate_size)] for w in widths]
    return {"impl": chosen[0]["impl"], "widths": [r["width"] for r in chosen],
            "seconds": [r["ms"] / 1e3 for r in chosen], "prefix_bytes": [round(r["prefix_mb"] * 1e6) for r in chosen],
            "gbps": [r["gbps"] for r in chosen], "memcpy_gbps": memory["memcpy_gbps"],
            "read_gbps": memory["read_gbps"], "loadavg": memory["loadavg_after"], "threads": memory["threads"],
            "info": CpuKernelInfo(CpuImpl(chosen[0]["impl"]), memory["extra_nbytes"][chosen[0]["impl"]],
                                  by_width[shape.intermediate_size]["gbps"])}


# ----------------------------------------------------------------------------- candidates


def measure_candidates(shape: ModelShape, repeats: int, chunk: int = 64) -> list[dict]:
    """One gate-like (I x H) matrix at T=1 by each candidate, GB/s of its 4-bit format bytes."""
    conv = torch.ops.aten._convert_weight_to_int4pack_for_cpu
    mm = torch.ops.aten._weight_int4pack_mm_for_cpu
    packed = random_expert(shape)
    g, inter, hidden = shape.group_size, shape.intermediate_size, shape.hidden_size
    qw, sc = packed.qweight[:, 0].contiguous(), packed.scales[:, 0].contiguous()
    zz = packed.zeros[:, 0].contiguous() if packed.zeros is not None else None
    w4 = conv(unpack_nibbles(qw).to(torch.int32), 1)
    z = zz.float() if zz is not None else torch.full(sc.shape, 8.0)
    sz = torch.stack((sc.float(), (8 - z) * sc.float()), -1).transpose(0, 1).contiguous()
    x = torch.randn(1, hidden)
    nbytes = qw.nbytes + sc.nbytes + (zz.nbytes if zz is not None else 0)

    def dequant(dtype):
        xd = x.to(dtype)

        def run():
            for c in range(0, inter, chunk):
                rows = dequantize_rows(unpack_nibbles(qw[c:c + chunk]), sc[c:c + chunk],
                                       None if zz is None else zz[c:c + chunk], g, dtype)
                torch.nn.functional.linear(xd, rows)
        return run

    rounds = _Rounds()
    _memory_thunks(rounds, MEMCPY_BYTES)
    szb = sz.bfloat16()
    rounds.add("int4pack-fp32", lambda: mm(x, w4, g, sz))
    rounds.add("int4pack-bf16", lambda: mm(x.bfloat16(), w4, g, szb))
    rounds.add(f"dequant-fp32 (chunks of {chunk})", dequant(torch.float32))
    rounds.add(f"dequant-bf16 (chunks of {chunk})", dequant(torch.bfloat16))
    med = rounds.run(repeats)
    memcpy = MEMCPY_BYTES / med.pop("memcpy") / 1e9
    read = MEMCPY_BYTES / med.pop("read") / 1e9
    return [{"candidate": name, "rows": inter, "hidden": hidden, "ms": s * 1e3, "gbps": nbytes / s / 1e9,
             "pct_memcpy": 100 * nbytes / s / 1e9 / memcpy, "memcpy_gbps": memcpy, "read_gbps": read,
             "loadavg": os.getloadavg()[0]} for name, s in med.items()]


# ----------------------------------------------------------------------------- CLI


def add_parser(subparsers) -> None:
    """The ``crisp-bench cpu`` subcommand's options."""
    p = subparsers.add_parser(
        "cpu", help="the CPU expert kernel: GB/s of prefix bytes against memcpy",
        description="The CPU expert kernel (crisp_kernels.cpu_expert) per width and token count, "
        "checked against the reference, then timed with the host memcpy in the same rounds. Each call reads one of "
        "several copies of the expert in turn (256 MB of host memory in all), so no call runs from what the previous "
        "one left in the cache, as in a decode.")
    p.add_argument("--shapes", type=common.csv_choices(("tiny", "mixtral")), default=["tiny", "mixtral"],
                   help="model shapes: tiny, mixtral (comma separated)")
    p.add_argument("--widths", type=common.fractions, default="0.25,0.5,1.0", help="width fractions in (0, 1]")
    p.add_argument("--tokens", type=common.int_list, default="1,4,16", help="token counts (>= 1), comma separated")
    p.add_argument("--repeats", type=common.positive_int, default=5, help="interleaved timed rounds")
    p.add_argument("--impl", type=common.csv_choices(("auto", *(i.value for i in CpuImpl))), default=["auto"],
                   help="kernels, comma separated, timed in the same rounds: auto (the runtime's choice at "
                   "--precision: native-q8 with bf16, native-fp32 with fp32, where the native kernel builds), "
                   "native-q8 (the C kernel with 8-bit activations), native-fp32 (the C kernel on the format's rows, "
                   "fp32), int4pack-bf16 (torch's op on a second copy), dequant-fp32")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                   help="what auto takes: bf16 (default) the native kernel with 8-bit activations, else torch's "
                   "int4pack op; fp32 the native kernel in fp32, else the exact dequant path")
    p.add_argument("--candidates", action="store_true",
                   help="also time the other candidate implementations on one gate matrix")
    p.add_argument("--model", metavar="DIR", default=str(common.DEFAULT_MODEL), type=ca.nonempty_path,
                   help="model whose shape is 'tiny' (default: the committed models/tiny-mixtral)")
    p.add_argument("--json", metavar="PATH", type=ca.nonempty_path,
                   help="write the records as JSON to PATH (atomically)")
    ca.add_force(p)
    p.add_argument("--threads", type=ca.threads_int, default=None, help="torch CPU threads (default: torch's)")


def run(args) -> int:
    shapes = resolve_shapes(args.shapes, getattr(args, "model", None))
    precision = Precision(args.precision)
    impls = [default_impl(precision) if name == "auto" else CpuImpl(name) for name in args.impl]
    if CpuImpl.NATIVE_FP32 in impls:
        try:
            cpu_native.load()
        except cpu_native.NativeUnavailable as err:
            raise CpuBenchError(f"--impl native-fp32: {err}") from err
    native = [i.value for i in impls if i in (CpuImpl.NATIVE_FP32, CpuImpl.NATIVE_Q8)]
    if native and max(args.tokens) > cpu_native.MAX_TOKENS:
        raise CpuBenchError(f"--tokens: {native[0]} takes at most {cpu_native.MAX_TOKENS} tokens a call (the "
                            f"runtime sends it 1-16); got {max(args.tokens)}")
    records, memories = [], {}
    for shape in shapes:
        recs, memory = measure(shape, args.widths, args.tokens, args.repeats, precision=precision, impls=impls)
        records += recs
        memories[shape.name] = memory
        print(report.table(recs, [("impl", "kernel"), ("width", "k"), ("width_frac", "k/I"), ("tokens", "T"),
                                  ("ms", "ms"), ("prefix_mb", "prefix MB"), ("gbps", "GB/s"),
                                  ("pct_memcpy", "% memcpy"), ("pct_read", "% read"), ("time_frac", "t(k)/t(I)"),
                                  ("rel_err", "rel err")],
                           title=f"{shape.name} (H {shape.hidden_size}, I {shape.intermediate_size}, g "
                           f"{shape.group_size}), {memory['threads']} threads, kernels in the same rounds: memcpy "
                           f"{memory['memcpy_gbps']:.2f} GB/s copied, read {memory['read_gbps']:.2f} GB/s; "
                           f"load average {memory['loadavg_after'][0]:.1f} (noisy on a shared machine)"))
        print()
    candidates = []
    if args.candidates:
        for shape in shapes:
            cands = measure_candidates(shape, args.repeats)
            candidates += [{"shape": shape.name, **c} for c in cands]
            print(report.table(cands, [("candidate", "candidate"), ("ms", "ms"), ("gbps", "GB/s"),
                                       ("pct_memcpy", "% memcpy")],
                               title=f"candidates, {shape.name} gate matrix ({shape.intermediate_size} x "
                               f"{shape.hidden_size}), T=1: memcpy {cands[0]['memcpy_gbps']:.2f} GB/s, load "
                               f"{cands[0]['loadavg']:.1f}"))
            print()
    if getattr(args, "json", None):
        report.write_json(args.json, "cpu", records, memory=memories, candidates=candidates)
        print(f"wrote {args.json}")
    return 0
