"""``crisp-bench peer``: CRISP's CPU-only path against llama.cpp on this machine's CPU, in one run.

For each model (``tiny``: the committed models/tiny-mixtral and its pack; ``large``: a random-weight
Mixtral-shaped model whose 4-bit experts dominate a token's bytes, its pack made by crisp-profile on a
little calibration text; ``peer_models``), the same checkpoint is converted to GGUF and quantized by
llama.cpp's own quantizer to Q4_0 and Q4_K_M. Each engine x quantization x thread count runs in a worker
process of its own (``peer_engines``); the parent then:

1. checks the conversion: llama.cpp's unquantized GGUF (F32 for tiny, F16 for large) against the
   transformers fp32 model on the prompt, relative logit error (``CONVERSION_TOL``), and refuses to time
   anything past it;
2. on the tiny model, next-token accuracy on held-out windows from each engine's own logits (fp32
   transformers, llama.cpp Q4_0 / Q4_K_M, CRISP 4-bit full width and the plan's widths);
3. times interleaved rounds: per round, every (engine, quantization, threads, width) decodes the same
   prompt then the same tokens (teacher-forced batch-1 decode with the KV cache); min and median per
   point; peak RSS of each worker.

It also measures, in the same run, this machine's read bandwidth (a streaming ``sum`` over 256 MB, all
cores) and CRISP's CPU expert kernel on one large-model expert (``crisp-bench cpu``'s code) at each
thread count, and llama.cpp's effective expert rate (its Q4_0 expert bytes per token x decode tokens/s:
a lower bound, the token's other work included).
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from crisp_runtime import cli_args as ca

from . import common, report
from . import peer_models as pm
from .common import DEFAULT_TEXT, CliError
from .peer_engines import CRISP_VARIANTS

MODELS = ("tiny", "large", "mixtral-layer")
DEFAULT_MODELS = ("tiny", "large")
# The random-weight models: "large" 4 layers of H 2048, I 5632 (151 MB of 4-bit experts read per token);
# "mixtral-layer" one layer of Mixtral-8x7B's own shape (H 4096, I 14336, 32 heads / 8 KV heads, 8 experts top-2:
# 198 MB of 4-bit experts per token in one layer, where "large" spreads 151 MB over four), so that the per-layer
# cost outside the kernels weighs what it would in a Mixtral-8x7B.
RANDOM_SHAPES = {"large": pm.LargeShape(),
                 "mixtral-layer": pm.LargeShape(hidden_size=4096, intermediate_size=14336, num_hidden_layers=1,
                                                num_attention_heads=32, num_key_value_heads=8)}
ENGINES = ("llama.cpp", "crisp")
WIDTHS = ("full", "plan")
CRISP_QUANT = "crisp-int4-g64"  # our format: 4-bit, group 64 along H, fp16 scales, uint8 zero points
# CRISP's CPU configurations (peer_engines.CRISP_VARIANTS), each an engine of its own, and their records' quant:
# fp32 activations; 8-bit activations with integer dots (llama.cpp's own arithmetic for Q4_0 x Q8_0); and those
# with the dense layers rounded too (RuntimeConfig.dense: attention in 4-bit rows as Q4_0 stores it, or in 8-bit
# blocks; the lm head in 8-bit blocks)
CRISP_PRECISIONS = {v: CRISP_QUANT + ("" if v == "fp32" else f"-{v}") for v in CRISP_VARIANTS}
# Conversion check: an F32 GGUF computes what the fp32 model does up to summation order (~1e-6 relative);
# F16 rounds the weights (bf16 values: exact) and llama.cpp's F16 matmul rounds the activations to fp16
# (2**-11 relative each, accumulated over a few layers): 1e-2 leaves a wrong conversion (a missing rope
# permutation, swapped experts: O(1) relative error) far outside.
CONVERSION_TOL = {"F32": 1e-3, "F16": 1e-2}
RECORD_KEYS = ("engine", "model", "quant", "width", "threads", "decode_tokens_per_s", "prompt_tokens_per_s",
               "peak_rss_mib")
WORKER_TIMEOUT_S = 900
CALIB_TEXT = common.REPO_ROOT / "data" / "stdlib-calib.txt"  # the random models' crisp-profile calibration


class PeerBenchError(CliError):
    pass


# ---------------------------------------------------------------------------- records


def make_record(*, engine: str, model: str, quant: str, width: str, threads: int, decode_s: list[float],
                prompt_s: list[float], decode_tokens: int, prompt_tokens: int, peak_rss_mib: float,
                accuracy: float | None = None, **extra) -> dict:
    """One ``--json`` record: tokens/s from the median round (min round's beside it)."""
    if engine not in ENGINES:
        raise ValueError(f"engine: expected one of {ENGINES}, got {engine!r}")
    if width not in WIDTHS:
        raise ValueError(f"width: expected one of {WIDTHS}, got {width!r}")
    if not decode_s or not prompt_s or decode_tokens < 1 or prompt_tokens < 1:
        raise ValueError("make_record: needs at least one timed round and one token of each kind")
    rec = {"engine": engine, "model": model, "quant": quant, "width": width, "threads": threads,
           "decode_tokens_per_s": decode_tokens / statistics.median(decode_s),
           "prompt_tokens_per_s": prompt_tokens / statistics.median(prompt_s),
           "peak_rss_mib": peak_rss_mib,
           "decode_tokens_per_s_best": decode_tokens / min(decode_s),
           "prompt_tokens_per_s_best": prompt_tokens / min(prompt_s),
           "rounds": len(decode_s), "decode_tokens": decode_tokens, "prompt_tokens": prompt_tokens,
           "decode_s_per_round": list(decode_s)}
    if accuracy is not None:
        rec["accuracy"] = accuracy
    rec.update(extra)
    return rec


def pair_rounds(records: list[dict], baseline_quant: str = "Q4_0") -> None:
    """Adds to every CRISP record its decode speed over llama.cpp's ``baseline_quant`` round by round
    (``vs_<quant>_per_round``: the median, min and max over rounds of llama.cpp's decode seconds over CRISP's in
    the same round, same model and thread count). Each round runs every engine once, within about a minute,
    so a ratio of the same round cancels the drift of a shared machine that a ratio of the two engines'
    separate medians keeps (on the 2-core VM this moved by up to 40% within minutes)."""
    base = {(r["model"], r["threads"]): r["decode_s_per_round"] for r in records
            if r["engine"] == "llama.cpp" and r["quant"] == baseline_quant and r["width"] == "full"}
    for r in records:
        theirs = base.get((r["model"], r["threads"]))
        if r["engine"] != "crisp" or theirs is None:
            continue
        mine = r["decode_s_per_round"]
        if len(mine) != len(theirs):
            raise ValueError(f"pair_rounds: {r['model']}, {r['threads']} threads: {len(mine)} CRISP rounds "
                             f"against {len(theirs)} of llama.cpp {baseline_quant}")
        ratios = [b / a for a, b in zip(mine, theirs, strict=True)]
        r[f"vs_{baseline_quant.lower()}_per_round"] = {"median": statistics.median(ratios), "min": min(ratios),
                                                         "max": max(ratios), "rounds": len(ratios)}


def check_record(rec: dict) -> None:
    """Raise ValueError when a record lacks a key of the schema (the tiny model's also ``accuracy``)."""
    missing = [k for k in RECORD_KEYS if k not in rec]
    if rec.get("model") == "tiny" and "accuracy" not in rec:
        missing.append("accuracy")
    if missing:
        raise ValueError(f"record {rec.get('engine')}/{rec.get('model')}/{rec.get('quant')}: missing {missing}")


# ---------------------------------------------------------------------------- workers


class Worker:
    """One engine in its own process (``peer_engines``), spoken to in JSON lines."""

    def __init__(self, spec: dict) -> None:
        self.spec = spec
        self.name = f"{spec['engine']}/{spec.get('quant', CRISP_PRECISIONS[spec.get('precision', 'fp32')])}/" \
                    f"{spec['threads']}t"
        env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]))
        self.proc = subprocess.Popen([sys.executable, "-m", "crisp_bench.peer_engines", json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env)
        self.ready_seen = False
        self.ready = self._read()
        self.ready_seen = True

    def _read(self) -> dict:
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(WORKER_TIMEOUT_S):
            self.close()
            raise PeerBenchError(f"worker {self.name}: no answer in {WORKER_TIMEOUT_S} s")
        line = self.proc.stdout.readline()
        if not line:
            err = [e for e in self.proc.stderr.read().splitlines() if e.strip()]
            last = err[-1].strip() if err else "no message"  # the exception's line of the worker's traceback
            hint = ""
            if "gguf" in self.spec and not self.ready_seen:  # the cached GGUF did not load: it may be damaged
                hint = (f"; if the cached GGUF is damaged, delete its folder {Path(self.spec['gguf']).parent} "
                        "and rerun to build it again")
            raise PeerBenchError(f"worker {self.name} ended (exit {self.proc.wait()}): {last}{hint}")
        reply = json.loads(line)
        if "error" in reply:
            raise PeerBenchError(f"worker {self.name}: {reply['error']}")
        return reply

    def ask(self, **req) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> dict:
        if self.proc.poll() is not None:
            return {}
        try:
            reply = self.ask(op="quit")
        except (PeerBenchError, BrokenPipeError, OSError):
            reply = {}
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # our own child
            self.proc.wait()
        return reply


@dataclass(frozen=True)
class ModelInputs:
    name: str
    model_dir: Path
    pack_dir: Path
    ggufs: dict  # quant -> path (the unquantized base included)
    base: str  # "F32" or "F16"


def prepare(name: str, work: Path, threads: int, quants=pm.PEER_QUANTS, log=print) -> ModelInputs:
    """The model, its pack and its GGUF files: the unquantized one (the conversion check) and ``quants`` only."""
    if name == "tiny":
        model_dir, pack_dir = pm.TINY_MODEL, pm.TINY_PACK
    else:
        model_dir = pm.large_model(RANDOM_SHAPES[name], work, log=log)
        pack_dir = pm.profile_pack(model_dir, CALIB_TEXT, work, threads=threads, log=log)
    ggufs = pm.gguf_files(model_dir, tuple(quants), work, threads=threads, log=log)
    base = next(q for q in ggufs if q not in pm.PEER_QUANTS)
    return ModelInputs(name, Path(model_dir), Path(pack_dir), ggufs, base)


def rel_err(a, b) -> float:
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float((a - b).norm() / b.norm())


def expert_bytes_per_token(model_dir: Path, quant: str) -> float:
    """Expert bytes read per token at full width: top-k experts x layers x 3 H I weights at the quant's bits
    (Q4_0: 18 B per 32 weights; Q4_K_M: its expert tensors are Q4_K (144 B / 256) with the down
    projections of some layers in Q6_K, counted here as Q4_K: a lower bound)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    weights = cfg["num_experts_per_tok"] * cfg["num_hidden_layers"] * 3 * cfg["hidden_size"] * cfg["intermediate_size"]
    return weights * {"Q4_0": 18 / 32, "Q4_K_M": 144 / 256}[quant]


def measure_kernel(model_dir: Path, plan_fraction: float, threads: int, repeats: int,
                   precisions=tuple(CRISP_PRECISIONS)) -> dict:
    """CRISP's CPU kernel (each of ``precisions``' arithmetic) on one expert of ``model_dir``'s shape, with the
    streaming read in the same rounds."""
    from .cpu import measure
    from .peer_engines import crisp_cpu_experts
    from .shapes import resolve_shapes

    shape = resolve_shapes(["tiny"], model_dir)[0]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        impls = [crisp_cpu_experts(p).impl for p in precisions]
        records, memory = measure(shape, sorted({1.0, round(plan_fraction, 3)}), [1], repeats, impls=impls)
    finally:
        torch.set_num_threads(before)
    return {"threads": threads, "read_gbps": memory["read_gbps"], "memcpy_gbps": memory["memcpy_gbps"],
            "kernel": [{"impl": r["impl"], "width_frac": r["width_frac"], "gbps": r["gbps"],
                        "pct_read": 100 * r["gbps"] / r["read_gbps"],
                        "ms": r["ms"], "prefix_bytes": r["prefix_mb"] * 1e6} for r in records]}


def cpu_profiles(kernel: dict) -> list[dict]:
    """The CPU side of a hybrid hardware profile (``profiles.HardwareProfile``'s cpu_bytes_per_s and
    cpu_latency_s, the same units) from one thread count's kernel measurement, one per kernel
    implementation: an affine fit of seconds against prefix bytes over the widths measured
    (``profiles.fit_affine``)."""
    from .profiles import fit_affine

    out = []
    for impl in dict.fromkeys(k["impl"] for k in kernel["kernel"]):
        points = [(k["prefix_bytes"], k["ms"] / 1e3) for k in kernel["kernel"] if k["impl"] == impl]
        latency, per_byte = fit_affine(points)
        out.append({"model": kernel.get("model"), "threads": kernel["threads"], "impl": impl,
                    "cpu_bytes_per_s": 1 / per_byte, "cpu_latency_s": latency,
                    "read_bytes_per_s": kernel["read_gbps"] * 1e9})
    return out


# ---------------------------------------------------------------------------- one model


def bench_model(inputs: ModelInputs, args, ids: list[int], windows: list[list[int]] | None, log=print
                ) -> tuple[list[dict], dict]:
    threads = sorted(set(args.thread_counts))
    n_ctx = max(len(ids), max((len(w) for w in windows or ()), default=0)) + 8
    top = threads[-1]
    meta: dict = {"model_dir": common.rel(inputs.model_dir), "pack_dir": common.rel(inputs.pack_dir),
                  "gguf": {q: str(p) for q, p in inputs.ggufs.items()}}
    workers: dict[tuple, Worker] = {}
    try:
        # 1. the conversion check: the unquantized GGUF against the fp32 model (transformers' whole model, in a
        # worker of its own, closed before the timed engines load: its peak RSS is a full-precision model's)
        ref = Worker({"engine": "crisp", "model": str(inputs.model_dir), "pack": str(inputs.pack_dir),
                      "threads": top, "n_ctx": n_ctx, "reference": True})
        workers[("reference",)] = ref
        base = Worker({"engine": "llama.cpp", "gguf": str(inputs.ggufs[inputs.base]), "quant": inputs.base,
                       "threads": top, "n_ctx": n_ctx})
        check_ids = ids[:args.prompt]
        got = base.ask(op="run", ids=check_ids, prompt=len(check_ids), logits=True)
        want = ref.ask(op="run", ids=check_ids, prompt=len(check_ids), logits=True)
        base.close()
        err = rel_err(got["logits"], want["logits"])
        meta["conversion_check"] = {"gguf": inputs.base, "relative_logit_error": err,
                                    "tolerance": CONVERSION_TOL[inputs.base], "positions": len(check_ids)}
        log(f"{inputs.name}: llama.cpp {inputs.base} GGUF against the fp32 model: relative logit error {err:.2e} "
            f"(tolerance {CONVERSION_TOL[inputs.base]:.0e})")
        if not err <= CONVERSION_TOL[inputs.base]:
            raise PeerBenchError(f"{inputs.name}: the GGUF conversion differs from the fp32 model (relative logit "
                                 f"error {err:.2e} > {CONVERSION_TOL[inputs.base]:.0e}); not timing it")
        accuracy: dict = {}
        if windows:
            got = ref.ask(op="accuracy", windows=windows)
            accuracy["fp32"] = got["correct"] / got["total"]
            meta["accuracy_positions"] = got["total"]
        workers.pop(("reference",)).close()
        # 2. every other worker, loaded one after another
        for t in threads:
            for quant in args.quants:
                workers[("llama.cpp", quant, t)] = Worker({"engine": "llama.cpp", "gguf": str(inputs.ggufs[quant]),
                                                           "quant": quant, "threads": t, "n_ctx": n_ctx})
            for precision in args.crisp_precisions:
                key = ("crisp", CRISP_PRECISIONS[precision], t)
                if key not in workers:
                    workers[key] = Worker({"engine": "crisp", "model": str(inputs.model_dir),
                                           "pack": str(inputs.pack_dir), "threads": t, "n_ctx": n_ctx,
                                           "precision": precision})
        points = [(key, w) for key in workers for w in (WIDTHS if key[0] == "crisp" else ("full",))]
        first_crisp = next((w for key, w in workers.items() if key[0] == "crisp"), None)
        if first_crisp is not None:  # the CPU placement's decision and rates, as its first CRISP worker reports them
            meta["crisp_cpu"] = first_crisp.ready.get("info", {}).get("cpu") or first_crisp.ask(op="stats").get("cpu")
        # 3. accuracy from each engine's own logits (the top thread count's workers)
        if windows:
            for key, width in points:
                if key[2] == top:
                    got = workers[key].ask(op="accuracy", windows=windows, width=width)
                    accuracy[(key[1], width)] = got["correct"] / got["total"]
        # 4. interleaved timed rounds, after one warm-up run each
        preds, expert_bytes = {}, {}
        for key, width in points:
            got = workers[key].ask(op="run", ids=ids, prompt=args.prompt, width=width)
            preds[key, width] = got["pred"]
            if "expert_bytes_per_token" in got:
                expert_bytes[width] = got["expert_bytes_per_token"]
        if "full" in expert_bytes and "plan" in expert_bytes:
            meta["crisp_expert_bytes_per_token"] = expert_bytes
            meta["plan_bytes_fraction"] = expert_bytes["plan"] / expert_bytes["full"]
        times = {p: ([], []) for p in points}
        for r in range(args.rounds):
            order = points[r % len(points):] + points[:r % len(points)]  # rotate: no point always first
            for key, width in order:
                got = workers[key].ask(op="run", ids=ids, prompt=args.prompt, width=width)
                times[key, width][0].append(got["decode_s"])
                times[key, width][1].append(got["prompt_s"])
                time.sleep(0.05)  # let the previous engine's OpenMP threads stop spinning
            log(f"{inputs.name}: round {r + 1}/{args.rounds} done")
        rss = {key: w.ask(op="rss") for key, w in workers.items()}
        # 5. where CRISP's decode step goes (after the timed rounds: the timers cost ~1 us per hook)
        meta["crisp_breakdown"] = [dict(threads=key[2], width=width, quant=key[1], **workers[key].ask(
            op="breakdown", ids=ids, prompt=args.prompt, width=width)) for key, width in points if key[0] == "crisp"]
        for b in meta["crisp_breakdown"]:
            log(f"{inputs.name}: CRISP {b['quant']} {b['width']} width, {b['threads']} threads, per token: step "
                f"{1e3 * b['step_s']:.2f} ms = CPU kernel {1e3 * b['kernel_s']:.2f} + MoE outside the kernel "
                f"{1e3 * b['moe_outside_kernel_s']:.2f} + attention {1e3 * b['attention_s']:.2f} + lm head "
                f"{1e3 * b['lm_head_s']:.2f} + rest {1e3 * b['rest_s']:.2f} ms ({b['layers']} layers); outside the "
                f"native calls {1e3 * b['outside_native_s']:.2f} ms, {1e3 * b['floor_step_s']:.2f} with them skipped")
        records = []
        full_ref = preds.get((("crisp", CRISP_QUANT, top), "full"))
        for key, width in points:
            engine, quant, t = key
            acc = accuracy.get((quant, width)) if windows else None
            extra = {"rss_after_load_mib": workers[key].ready.get("rss_mib"), "load_s": workers[key].ready["load_s"]}
            if full_ref is not None:
                mine = preds[key, width][args.prompt - 1:]
                extra["top1_agreement_vs_crisp_full"] = sum(int(a == b) for a, b in zip(
                    mine, full_ref[args.prompt - 1:], strict=True)) / len(mine)
            if windows:
                extra["accuracy_fp32"] = accuracy["fp32"]
                extra["accuracy_loss_vs_fp32"] = accuracy["fp32"] - acc
                crisp_full = accuracy.get((CRISP_QUANT, "full"))
                if crisp_full is not None:
                    extra["accuracy_loss_vs_crisp_full"] = crisp_full - acc
            if engine == "llama.cpp":
                bpt = expert_bytes_per_token(inputs.model_dir, quant)
                decode = len(ids) - args.prompt
                extra["expert_gbps_effective"] = bpt * decode / statistics.median(times[key, width][0]) / 1e9
            records.append(make_record(engine=engine, model=inputs.name, quant=quant, width=width, threads=t,
                                       decode_s=times[key, width][0], prompt_s=times[key, width][1],
                                       decode_tokens=len(ids) - args.prompt, prompt_tokens=args.prompt,
                                       peak_rss_mib=rss[key]["peak_rss_mib"], accuracy=acc, **extra))
        return records, meta
    finally:
        for w in workers.values():
            w.close()


# ---------------------------------------------------------------------------- CLI


def _window(text: str) -> int:
    n = common.positive_int(text)
    if n < 2:
        raise argparse.ArgumentTypeError(f"expected at least 2 tokens (one prediction needs two), got {text!r}")
    return n


def _thread_counts(text: str) -> list[int]:
    return [ca.threads_int(v) for v in common.items(text)]


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "peer", help="CRISP's CPU-only path against llama.cpp (Q4_0, Q4_K_M) on this CPU, in one run",
        description="Converts the same Mixtral checkpoint to GGUF, quantizes it with llama.cpp's quantizer "
        "(Q4_0, Q4_K_M) and times llama.cpp and CRISP's CPU-only placement (the checkpoint loaded by "
        "crisp_runtime.load_model with cpu='on', serving='cpu_only') in interleaved rounds: batch-1 decode "
        "and prompt tokens/s, peak RSS, and on the tiny model next-token accuracy. Needs the 'peers' extra "
        "(pip install 'crisp-moe[peers]'). The large model (random weights, "
        "2.3 GB) and the GGUF files go to a work folder of this command, reused when complete.")
    p.add_argument("--models", type=common.csv_choices(MODELS), default=list(DEFAULT_MODELS),
                   help="tiny (the committed models/tiny-mixtral), large (random-weight H 2048, I 5632, 8 experts "
                   "top-2, 4 layers: 605 MB of 4-bit experts), mixtral-layer (random-weight, one layer of "
                   "Mixtral-8x7B's shape: H 4096, I 14336, 793 MB of 4-bit experts; a 2.9 GB checkpoint, about "
                   "10 GB of memory while the fp32 reference loads it); comma separated (default: tiny,large)")
    p.add_argument("--threads", dest="thread_counts", type=_thread_counts,
                   default=sorted({1, os.cpu_count() or 1}),
                   help="thread counts, comma separated, each engine run with each (default: 1 and all cores)")
    p.add_argument("--tokens", type=common.positive_int, default=64, help="decoded tokens per round (default 64)")
    p.add_argument("--prompt", type=common.positive_int, default=64, help="prompt tokens per round (default 64)")
    p.add_argument("--rounds", type=common.positive_int, default=3, help="interleaved timed rounds (default 3)")
    p.add_argument("--quants", type=common.csv_choices(pm.PEER_QUANTS), default=list(pm.PEER_QUANTS),
                   help="llama.cpp quantizations (default: Q4_0,Q4_K_M)")
    p.add_argument("--crisp-precisions", type=common.csv_choices(tuple(CRISP_PRECISIONS)),
                   default=list(CRISP_PRECISIONS),
                   help="CRISP's CPU configurations, each timed as an engine of its own: fp32 (the expert kernel with "
                   "fp32 activations), q8 (8-bit activations and integer dot products, as llama.cpp's Q4_0 path, the "
                   "experts' default; the dense layers, attention and lm head, as loaded: dense='keep'), q8-dense4 "
                   "(q8, and attention's linear layers in 4-bit rows, the lm head in 8-bit blocks: "
                   "RuntimeConfig(dense='q4')), "
                   "q8-dense8 (q8, and the dense layers in 8-bit blocks as llama.cpp's Q8_0: dense='q8', what the "
                   "default dense='auto' does under cpu_only) and q8-dense16 (q8, and the dense layers whose weights "
                   "are bf16 values in bf16, exact: dense='bf16'); "
                   "comma separated (default: all; records' quant "
                   f"{', '.join(CRISP_PRECISIONS.values())})")
    p.add_argument("--accuracy-windows", type=common.positive_int, default=16,
                   help="held-out windows for the tiny model's accuracy (default 16)")
    p.add_argument("--window", type=_window, default=128, help="tokens per accuracy window (default 128)")
    p.add_argument("--text", metavar="PATH", default=str(DEFAULT_TEXT), type=ca.nonempty_path,
                   help="held-out text for the prompt, the decoded tokens and the accuracy")
    p.add_argument("--kernel-repeats", type=common.positive_int, default=5,
                   help="rounds of the kernel / read-bandwidth measurement on the large model's expert")
    p.add_argument("--work-dir", metavar="DIR", default=None, type=ca.nonempty_path,
                   help=f"where the large model, its pack and the GGUF files are made (default: {pm.work_dir()}); "
                   "each in a folder of its own, reused only when its completion marker matches")
    p.add_argument("--json", metavar="PATH", type=ca.nonempty_path,
                   help="write the records as JSON to PATH (atomically)")
    ca.add_force(p)


def implicit_inputs(args) -> dict:
    """What peer reads without an option naming it (``cli`` refuses an output onto or into any of them): the
    committed tiny model and its pack, the calibration text, and the work folder's models and GGUF files."""
    return {"the tiny model": pm.TINY_MODEL, "the tiny model's pack": pm.TINY_PACK, "the calibration text": CALIB_TEXT,
            "--work-dir": args.work_dir if args.work_dir else pm.work_dir()}


def _work_dir(args) -> Path:
    """The work folder: --work-dir must be a folder or a new one in an existing folder (a typo makes no tree of
    folders); the default one is made with its parents."""
    if not args.work_dir:
        return pm.work_dir()
    work = Path(args.work_dir).expanduser()
    if work.exists() and not work.is_dir():
        raise PeerBenchError(f"--work-dir {args.work_dir}: exists and is not a folder; give a folder")
    if not work.exists() and not work.parent.is_dir():
        raise PeerBenchError(f"--work-dir {args.work_dir}: its parent folder {work.parent} does not exist; "
                             "expected an existing folder or a new one inside an existing folder")
    return work


def _max_positions(name: str) -> int:
    """The longest sequence model ``name`` takes (its config's max_position_embeddings)."""
    if name == "tiny":
        cfg = json.loads((pm.TINY_MODEL / "config.json").read_text())
        return int(cfg["max_position_embeddings"])
    return RANDOM_SHAPES[name].max_position_embeddings


def _check_lengths(args) -> None:
    """Before any model is built: the prompt and the decoded tokens (and the tiny model's accuracy windows) fit
    every asked model's positions; a longer run would fail inside an engine, minutes in."""
    for name in args.models:
        most = _max_positions(name)
        if args.prompt + args.tokens > most:
            raise PeerBenchError(f"--prompt {args.prompt} + --tokens {args.tokens}: model {name} takes at most "
                                 f"{most} positions")
        if name == "tiny" and args.window > most:
            raise PeerBenchError(f"--window {args.window}: model tiny takes at most {most} positions")


def run(args) -> int:
    work = _work_dir(args)
    _check_lengths(args)
    pm.require_peers()
    from crisp_tools.text import read_texts, sample_sequences

    try:
        texts = read_texts(args.text)
        ids = sample_sequences(texts, 1, args.prompt + args.tokens, seed=1)[0].tolist()
        windows = sample_sequences(texts, args.accuracy_windows, args.window, seed=2).tolist()
    except ValueError as exc:
        raise PeerBenchError(f"--text {args.text}: {exc}") from exc
    cpu_model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), "unknown") if Path("/proc/cpuinfo").exists() else "unknown"
    records, metas, kernels = [], {}, []
    for name in args.models:
        inputs = prepare(name, work, max(args.thread_counts), args.quants)
        recs, meta = bench_model(inputs, args, ids, windows if name == "tiny" else None)
        if name != "tiny":  # one expert of the model's shape, with the streaming read in the same rounds
            plan_frac = meta["plan_bytes_fraction"]
            for t in sorted(set(args.thread_counts)):
                kernels.append(dict(model=name, **measure_kernel(inputs.model_dir, plan_frac, t, args.kernel_repeats,
                                                                 args.crisp_precisions)))
        for r in recs:
            check_record(r)
        pair_rounds(recs)
        records += recs
        metas[name] = meta
    print(report.table(records, [("model", "model"), ("engine", "engine"), ("quant", "quant"), ("width", "width"),
                                 ("threads", "thr"), ("decode_tokens_per_s", "decode tok/s"),
                                 ("prompt_tokens_per_s", "prompt tok/s"), ("peak_rss_mib", "peak RSS MiB"),
                                 ("accuracy", "acc"), ("expert_gbps_effective", "expert GB/s (llama.cpp)")],
                       title=f"{cpu_model}, {os.cpu_count()} cores; median of {args.rounds} interleaved rounds, "
                       f"prompt {args.prompt} + {args.tokens} decoded tokens"))
    for r in records:
        paired = r.get("vs_q4_0_per_round")
        if paired:
            print(f"{r['model']}, {r['threads']} thr, {r['quant']} {r['width']}: {paired['median']:.2f}x "
                  f"llama.cpp Q4_0's decode, median of {paired['rounds']} rounds' ratios "
                  f"(range {paired['min']:.2f}-{paired['max']:.2f})")
    for k in kernels:
        print(f"CRISP CPU kernel, {k['model']} expert, {k['threads']} threads: read {k['read_gbps']:.1f} GB/s; "
              + ", ".join(f"{x['impl']} k/I {x['width_frac']:.2f}: {x['gbps']:.1f} GB/s ({x['pct_read']:.0f}% of read)"
                          for x in k["kernel"]))
    if args.json:
        report.write_json(args.json, "peer", records, cpu_model=cpu_model, models=metas, kernel=kernels,
                          cpu_profiles=[p for k in kernels for p in cpu_profiles(k)],
                          prompt_tokens=args.prompt, decode_tokens=args.tokens, rounds=args.rounds)
        print(f"wrote {args.json}")
    return 0
