"""``crisp-bench transfer``: host-to-device bandwidth, and load time per width per model shape.

A width-k load in CRISP's format is three plain copies (qweight, scales, zeros rows 0..k) from
pinned host memory into device buffers; that is what is timed here, for each model shape and
width, beside the expert's compute time at that width (the paper's "load and compute scale
together" table). On a CPU there is no host-to-device link: the "copy" is a memcpy between
two host buffers, and the output says so.

``--profile-out`` fits the simulator's affine models to these measurements (load = latency +
bytes / bandwidth, compute = latency + bytes / bandwidth) and measures the model's router and
other per-layer time, and writes the ``measured`` profile.
"""

from __future__ import annotations

import statistics
import time

import torch

from crisp_kernels.format import QuantFormat
from crisp_runtime import cli_args as ca
from crisp_runtime.cpu.knob import measure_handoff_s

from . import common, report
from .common import (
    DEFAULT_MODEL,
    CliError,
    ModelInputError,
    cache_argument,
    cache_of,
    load_model_for_bench,
    sync,
)
from .cpu import CpuBenchError, measure_cpu_expert
from .profiles import MEASURED_PROFILE_FILE, HardwareProfile, fit_affine
from .runtime import measure_transfer
from .shapes import ModelShape, resolve_shapes, shape_names


class TransferError(CliError):
    pass


def parse_widths(spec: str) -> list[float]:
    try:
        ws = [float(s) for s in spec.split(",") if s.strip()]
    except ValueError:
        raise TransferError(f"--widths {spec!r}: expected fractions such as 0.25,0.5,1.0") from None
    if not ws or any(not 0 < w <= 1 for w in ws):
        raise TransferError(f"--widths {spec!r}: fractions must lie in (0, 1]")
    return ws


def _expert_buffers(shape: ModelShape, device, pin: bool):
    fmt = QuantFormat(group_size=shape.group_size)
    inter, hidden, groups = shape.intermediate_size, shape.hidden_size, shape.hidden_size // fmt.group_size

    def make(cols, dtype):
        t = torch.empty((inter, 3, cols), dtype=dtype)
        return t.pin_memory() if pin else t

    host = [make(hidden // 2, torch.uint8), make(groups, torch.float16), make(groups, torch.uint8)]
    for t in host:
        t.view(torch.uint8).random_(0, 255)
    dev = [torch.empty_like(t, device=device) for t in host]
    return host, dev


def time_load(host, dev, width: int, repeats: int, device) -> float:
    """Median seconds to copy rows 0..width of the three tensors host -> device."""
    times = []
    for _ in range(repeats + 1):
        sync(device)
        t0 = time.perf_counter()
        for h, d in zip(host, dev, strict=True):
            d[:width].copy_(h[:width], non_blocking=True)
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def time_compute(shape: ModelShape, width: int, repeats: int, device) -> float:
    """Median seconds of one decode token through one expert at ``width`` (crisp_kernels.expert_mlp)."""
    from crisp_kernels import Backend, expert_mlp, pack_expert

    g = torch.Generator().manual_seed(0)
    h, i = shape.hidden_size, shape.intermediate_size
    gate = torch.randn(i, h, generator=g) * 0.02
    up = torch.randn(i, h, generator=g) * 0.02
    down = torch.randn(h, i, generator=g) * 0.02
    packed = pack_expert(gate, up, down, QuantFormat(group_size=shape.group_size)).to(device)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    x = torch.randn(1, h, generator=g).to(device, dtype)
    times = []
    for _ in range(repeats + 1):
        sync(device)
        t0 = time.perf_counter()
        # On a CPU the runtime runs the torch reference (never Triton's interpreter): time the same.
        expert_mlp(x, packed, width, backend=Backend.TORCH if device.type == "cpu" else None)
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def bandwidth(device, nbytes: int, repeats: int) -> float:
    pin = device.type == "cuda"
    src = torch.empty(nbytes, dtype=torch.uint8)
    src = src.pin_memory() if pin else src
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return nbytes / time_load([src], [dst], nbytes, repeats, device)


def add_parser(subparsers) -> None:
    """The ``crisp-bench transfer`` subcommand's options."""
    p = subparsers.add_parser(
        "transfer", help="host-to-device bandwidth and load time per width",
        description="Pinned host-to-device bandwidth, and load time per width for each model shape "
        "(the paper's 'load and compute scale together' table). On a CPU the 'transfer' is a memcpy.")
    p.add_argument("--shapes", default="tiny,mixtral",
                   help=f"model shapes, comma separated: {', '.join(shape_names())}")
    p.add_argument("--widths", default="0.125,0.25,0.5,0.75,1.0", help="width fractions, comma separated")
    p.add_argument("--repeats", type=common.positive_int, default=5, help="timed repetitions per point")
    p.add_argument("--model", metavar="DIR", default=str(common.DEFAULT_MODEL), type=ca.nonempty_path,
                   help="model whose shape is 'tiny' and whose router/other time goes into --profile-out "
                   "(default: the committed models/tiny-mixtral)")
    p.add_argument("--profile-out", metavar="PATH.json", nargs="?", const=MEASURED_PROFILE_FILE, type=ca.nonempty_path,
                   help=f"also measure expert compute and write a 'measured' simulator profile "
                   f"(default path {MEASURED_PROFILE_FILE})")
    common.add_outputs(p)


def run(args) -> int:
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    model_dir = getattr(args, "model", None)
    shapes = resolve_shapes(args.shapes, model_dir)
    widths = parse_widths(args.widths)
    on_gpu = device.type == "cuda"
    what = (f"pinned host -> {torch.cuda.get_device_name(0)}" if on_gpu
            else "CPU: no GPU, the 'transfer' is a host memcpy (not a PCIe measurement)")
    print(f"transfer: {what}")
    big = 256 << 20 if on_gpu else 64 << 20
    bw = bandwidth(device, big, args.repeats)
    print(f"bandwidth of one {big >> 20} MiB copy: {bw / 1e9:.2f} GB/s")
    records = [{"kind": "bandwidth", "bytes": big, "gb_per_s": bw / 1e9, "device": str(device)}]
    compute_points: dict[str, list] = {}
    load_points: dict[str, list] = {}
    cpu_points: dict[str, list] = {}
    for shape in shapes:
        host, dev = _expert_buffers(shape, device, pin=on_gpu)
        prog = report.Progress(f"transfer {shape.name}")
        measure_compute = args.profile_out is not None or shape.expert_nbytes < (64 << 20) or on_gpu
        for n, frac in enumerate(widths):
            width = max(1, round(frac * shape.intermediate_size))
            nbytes = width * shape.neuron_nbytes
            load = time_load(host, dev, width, args.repeats, device)
            comp = time_compute(shape, width, max(1, args.repeats // 2), device) if measure_compute else None
            records.append({"kind": "load", "shape": shape.name, "width_fraction": frac, "width": width,
                            "bytes": nbytes, "load_ms": 1e3 * load, "gb_per_s": nbytes / load / 1e9,
                            "compute_ms": None if comp is None else 1e3 * comp,
                            "load_over_compute": None if not comp else load / comp, "device": str(device)})
            load_points.setdefault(shape.name, []).append((nbytes, load))
            if comp is not None:
                compute_points.setdefault(shape.name, []).append((nbytes, comp))
            prog(n + 1, len(widths))
        del host, dev
        # The CPU's expert time against width (hybrid placement): H1's kernel at batch 1, each width
        # checked against the reference first (bench.cpu.measure_cpu_expert).
        cpu = _measure_cpu(shape, widths, args.repeats)
        if cpu is not None:
            for w, sec, nbytes, gbps in zip(cpu["widths"], cpu["seconds"], cpu["prefix_bytes"], cpu["gbps"],
                                            strict=True):
                records.append({"kind": "cpu_expert", "shape": shape.name, "width": w, "bytes": nbytes,
                                "cpu_ms": 1e3 * sec, "gb_per_s": gbps, "impl": cpu["impl"],
                                "memcpy_gb_per_s": cpu["memcpy_gbps"]})
                cpu_points.setdefault(shape.name, []).append((nbytes, sec))
    cols = [("shape", "shape"), ("width_fraction", "width"), ("mb", "MB"), ("load_ms", "load ms"),
            ("gb_per_s", "GB/s"), ("compute_ms", "compute ms (1 token)"), ("load_over_compute", "load/compute")]
    rows = [dict(r, mb=r["bytes"] / 1e6, compute_ms=r["compute_ms"] if r["compute_ms"] is not None else "-",
                 load_over_compute=r["load_over_compute"] if r["load_over_compute"] is not None else "-")
            for r in records if r["kind"] == "load"]
    print(report.table(rows, cols, title="load and compute per width (paper, RTX 4090 Mixtral: 7.5/0.8 ms full, "
                                         "3.8/0.4 ms at 50%)"))
    cpu_rows = [dict(r, mb=r["bytes"] / 1e6) for r in records if r["kind"] == "cpu_expert"]
    if cpu_rows:
        print(report.table(cpu_rows, [("shape", "shape"), ("width", "width"), ("mb", "MB"), ("cpu_ms", "CPU ms"),
                                      ("gb_per_s", "GB/s of prefix"), ("impl", "kernel")],
                           title="CPU expert time against width (batch 1; the hybrid placement's CPU side)"))
    if not on_gpu:
        print("compute on CPU is the pure-torch reference expert (dequantize + matmul), not a GPU kernel")
    else:  # the runtime's own prefix copies through its cache, vs a plain pinned copy
        rt = measure_transfer(iters=5)
        print(report.table(rt, [(k, k) for k in rt[0]], title="runtime prefix copies (crisp_bench.runtime)"))
        records += [dict(r, kind="runtime_prefix_copy") for r in rt]
    extra = {}
    if args.profile_out is not None:
        handoff = 0.0
        if cpu_points:  # a step with CPU experts also waits for the worker thread's handoff (one per step)
            handoff = measure_handoff_s(jobs=200, rounds=5)
            print(f"CPU worker handoff (an empty job submitted and its result back): {handoff * 1e6:.0f} us per step")
        profile = measured_profile(load_points, compute_points, device, model_dir, cpu_points, join_s=handoff)
        profile.save(args.profile_out)  # atomically; checked up front by crisp-bench's main
        extra["profile"] = profile.to_dict()
        print(f"wrote the measured profile {args.profile_out}: H2D {profile.h2d_bytes_per_s / 1e9:.2f} GB/s + "
              f"{profile.copy_latency_s * 1e6:.0f} us/copy; compute {profile.compute_bytes_per_s / 1e9:.2f} GB/s + "
              f"{profile.compute_latency_s * 1e6:.0f} us; router {profile.router_s * 1e6:.0f} us, "
              f"other {profile.other_s * 1e6:.0f} us per layer")
    if args.plot:
        series = {f"load {s}": [(b / 1e6, 1e3 * t) for b, t in pts] for s, pts in load_points.items()}
        series.update({f"compute {s}": [(b / 1e6, 1e3 * t) for b, t in pts] for s, pts in compute_points.items()})
        report.plot_lines(args.plot, series, xlabel="prefix MB", ylabel="ms", title=f"load and compute vs width "
                          f"({device})", note=report.environment()["date"])
        print(f"wrote {args.plot}")
    if args.json:
        report.write_json(args.json, "transfer", records, **extra)
        print(f"wrote {args.json}")
    return 0


def _measure_cpu(shape: ModelShape, widths, repeats: int) -> dict | None:
    """``bench.cpu.measure_cpu_expert`` at ``widths`` (fractions), or None where the kernel cannot run."""
    neurons = sorted({max(1, round(f * shape.intermediate_size)) for f in widths})
    try:
        return measure_cpu_expert(shape, neurons, repeats=max(1, repeats))
    except CpuBenchError as exc:
        print(f"(CPU expert time not measured for {shape.name}: {exc})")
        return None


def measured_profile(load_points, compute_points, device, model_dir=None, cpu_points=None,
                     join_s: float = 0.0) -> HardwareProfile:
    """Affine fits over all shapes' points, plus router/other per layer from the committed model, plus the
    CPU's expert time (affine in prefix bytes) when measured and ``join_s``, the per-step cost of the CPU
    side beyond its experts (the worker's handoff, ``CpuWorker.handoff_s``). The copy rate while the CPU
    streams is not measured here (it needs a GPU: ``bench/gpu_check.sh``): None, i.e. taken as unchanged."""
    lp = [p for pts in load_points.values() for p in pts]
    cp = [p for pts in compute_points.values() for p in pts]
    copy_lat, s_per_byte = fit_affine(lp)
    comp_lat, c_per_byte = fit_affine(cp)
    def comp(nbytes):
        return comp_lat + nbytes * c_per_byte

    router_s, other_s = measure_layer_overheads(model_dir, device, comp)
    cpu = [p for pts in (cpu_points or {}).values() for p in pts]
    cpu_lat, cpu_per_byte = fit_affine(cpu) if cpu else (0.0, None)
    return HardwareProfile(
        name="measured", h2d_bytes_per_s=1.0 / max(s_per_byte, 1e-15), copy_latency_s=copy_lat,
        compute_bytes_per_s=1.0 / max(c_per_byte, 1e-15), compute_latency_s=comp_lat, router_s=router_s,
        other_s=other_s, source="crisp-bench transfer --profile-out",
        description=f"measured on {report.environment()['device']} {report.environment()['date']}",
        cpu_bytes_per_s=None if cpu_per_byte is None else 1.0 / max(cpu_per_byte, 1e-15), cpu_latency_s=cpu_lat,
        join_s=join_s if cpu else 0.0,
    )


@torch.no_grad()
def measure_layer_overheads(model_dir, device, expert_compute_s=None) -> tuple[float, float]:
    """(router s, other s) per MoE layer of a decode step of the committed model (0, 0 without one).

    Decode-step time minus the experts modules' time, split into the gate (router) and the rest,
    by forward hooks that synchronise the device. When the model has a CRISP pack, the step runs
    through the CRISP runtime with every expert resident at full width, and what the experts
    module spends beyond ``top_k`` expert computes (``expert_compute_s(bytes)``; the runtime's
    planner, grouping, kernel launches) is added to the router's time: it is serial per layer
    step, before the experts, so the simulator treats it alike.
    """
    try:
        model, pack_dir = load_model_for_bench(model_dir or DEFAULT_MODEL, need_pack=False, device=device)
    except ModelInputError:
        return 0.0, 0.0
    from crisp_runtime.hf.moe_layers import find_moe_layers, model_top_k

    handle = None
    if pack_dir is not None and expert_compute_s is not None:
        from crisp_runtime import apply
        from crisp_runtime.storage.pack import load_pack

        pack = load_pack(pack_dir)
        layer = next(iter(pack.layers.values()))
        plan = __import__("crisp_runtime").CrispPlan.full(layer.num_experts, model_top_k(model),
                                                          layer.intermediate_size, sorted(pack.layers))
        handle = apply(model, pack, plan=plan, gpu_budget=None)
        per_layer_compute = model_top_k(model) * expert_compute_s(layer.nbytes() // layer.num_experts)

    refs = find_moe_layers(model)
    spent = {"experts": 0.0, "router": 0.0}
    marks: dict = {}

    def pre(kind):
        def hook(*_):
            sync(device)
            marks[kind] = time.perf_counter()
        return hook

    def post(kind):
        def hook(*_):
            sync(device)
            spent[kind] += time.perf_counter() - marks[kind]
        return hook

    handles = []
    for ref in refs:
        handles += [ref.module.register_forward_pre_hook(pre("experts")),
                    ref.module.register_forward_hook(post("experts"))]
        parent = model.get_submodule(ref.name.rsplit(".", 1)[0])
        gate = getattr(parent, "gate", None) or getattr(parent, "router", None)
        if gate is not None:
            handles += [gate.register_forward_pre_hook(pre("router")), gate.register_forward_hook(post("router"))]
    ids = torch.arange(1, 49).unsqueeze(0).to(device) % 200 + 32
    past, total, n = None, 0.0, 0
    cache_kwargs = cache_argument(model)
    try:
        for t in range(ids.shape[1]):
            if t == 8:
                spent.update(experts=0.0, router=0.0)
            sync(device)
            t0 = time.perf_counter()
            out = model(input_ids=ids[:, t:t + 1], **cache_kwargs(past), use_cache=True)
            sync(device)
            past = cache_of(out)
            if t >= 8:
                total += time.perf_counter() - t0
                n += 1
    finally:
        for h in handles:
            h.remove()
        if handle is not None:
            handle.restore()
    layers = len(refs)
    router = spent["router"] / (n * layers)
    other = max(0.0, (total - spent["experts"] - spent["router"]) / (n * layers))
    if handle is not None:
        router += max(0.0, spent["experts"] / (n * layers) - per_layer_compute)
    return router, other
