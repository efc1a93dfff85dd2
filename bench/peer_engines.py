"""The two engines of ``crisp-bench peer``, each in a worker process of its own.

A worker (``python -m crisp_bench.peer_engines``) loads one engine (llama.cpp on one GGUF file, or CRISP's
CPU-only placement on one checkpoint + pack) with one thread count, then answers requests, one JSON line
each on its stdin, with one JSON line on a private pipe (llama.cpp and torch may print on stdout/stderr:
fd 1 is pointed at stderr). Separate processes give each engine its own peak RSS and its own thread pools,
and let the parent interleave rounds of every engine (a shared machine drifts; every engine sees it alike).

Requests: ``{"op": "run", "ids": [...], "prompt": P, "width": "full"|"plan"}``: the first P ids as one
prompt forward, then one forward per remaining id with the KV cache (batch-1 decode, teacher-forced on
the given ids, so both engines decode the same tokens), timed separately; answers the seconds and the
argmax prediction at every position (``logits`` too when ``"logits": true``). ``{"op": "accuracy",
"windows": [[...], ...], "width": ...}``: next-token accuracy from full-window forwards. ``{"op": "rss"}``:
peak RSS (VmHWM) and RSS now, in MiB. ``{"op": "quit"}``.

The CRISP engine: ``crisp_runtime.load_model(checkpoint, pack, dtype=torch.float32, serving="cpu_only",
cpu="on", gpu_budget=<one token's experts>)``, how a checkpoint is loaded to serve from host memory: the
non-expert weights read tensor by tensor in fp32 (activations in fp32, as llama.cpp computes them), the
checkpoint's experts never loaded whole, every routed expert computed from the pack's host rows by the CPU
expert kernel, the other layers by torch; the kernel's threads = the engine's threads. Its peak RSS is what
serving takes (the pack, the non-expert weights, torch), not a full-precision model's load. ``width="full"``:
``CrispPlan.full`` (every expert at full width: the same 4-bit bytes as llama.cpp's Q4_0 reads, plus scales and
zero points); ``"plan"``: the pack's plan. The reference engine (``reference=True``, the conversion check and
the fp32 accuracy) is the whole model loaded by transformers in fp32, and CRISP applied to it on ``applied``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

CRISP_VARIANTS = ("fp32", "q8", "q8-dense4", "q8-dense8", "q8-dense16")


def crisp_cpu_experts(precision: str, threads: int | None = None):
    """The CRISP engine's ``CpuExpertsConfig`` for a ``crisp-bench peer --crisp-precisions`` name: "fp32", the
    native kernel in fp32 (``Precision.BF16``: fp32 where the kernel builds); "q8" and "q8-dense4", its
    8-bit-activation arithmetic (``Precision.Q8``, the default), as are "q8-dense8"'s and "q8-dense16"'s."""
    from crisp_kernels.cpu_expert import Precision
    from crisp_runtime.cpu.experts import CpuExpertsConfig

    if precision not in CRISP_VARIANTS:
        raise ValueError(f"precision: expected one of {CRISP_VARIANTS}, got {precision!r}")
    return CpuExpertsConfig(threads=threads, precision=Precision.BF16 if precision == "fp32" else Precision.Q8)


def crisp_runtime_config(precision: str, threads: int | None = None):
    """The CRISP engine's ``RuntimeConfig``: the experts as :func:`crisp_cpu_experts`; the dense layers (attention,
    the lm head) as loaded (``dense="keep"``) for "fp32" and "q8", attention in 4-bit rows and the head in 8-bit
    blocks for "q8-dense4" (``dense="q4"``), both in 8-bit blocks for "q8-dense8" (``dense="q8"``, llama.cpp's Q8_0:
    what the default ``"auto"`` does under ``cpu_only``), their bf16-valued weights in bf16 for "q8-dense16"
    (``dense="bf16"``, exact); the fp32 experts dropped once packed (``keep_original=False``: the serving
    footprint)."""
    from crisp_runtime.execution.runtime import RuntimeConfig

    dense = {"q8-dense4": "q4", "q8-dense8": "q8", "q8-dense16": "bf16"}.get(precision, "keep")
    return RuntimeConfig(keep_original=False, cpu_experts=crisp_cpu_experts(precision, threads), dense=dense)


def rss_mib() -> dict:
    """Peak (VmHWM) and current (VmRSS) resident set of this process, MiB."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            out[key] = int(value.split()[0]) / 1024
    return {"peak_rss_mib": out.get("VmHWM"), "rss_mib": out.get("VmRSS")}


def _argmax_rows(rows) -> list[int]:
    return [int(r.argmax()) for r in rows]


class LlamaCppEngine:
    """llama.cpp (llama-cpp-python's ``Llama``) on one GGUF file, ``threads`` for decode and prompt."""

    def __init__(self, gguf_path: str, threads: int, n_ctx: int) -> None:
        import llama_cpp

        self.llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                                   n_threads=threads, n_threads_batch=threads, logits_all=True, verbose=False)
        self.info = {"llama_cpp": llama_cpp.__version__, "n_vocab": self.llm.n_vocab()}

    def run(self, ids: list[int], prompt: int, width: str = "full", logits: bool = False) -> dict:
        llm = self.llm
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids[:prompt])
        t1 = time.perf_counter()
        for tok in ids[prompt:]:
            llm.eval([tok])
        t2 = time.perf_counter()
        scores = llm.scores[:len(ids)]
        out = {"prompt_s": t1 - t0, "decode_s": t2 - t1, "pred": _argmax_rows(scores)}
        if logits:
            out["logits"] = scores.tolist()
        return out

    def accuracy(self, windows: list[list[int]], width: str = "full") -> dict:
        correct = total = 0
        for w in windows:
            self.llm.reset()
            self.llm.eval(w)
            pred = _argmax_rows(self.llm.scores[:len(w) - 1])
            correct += sum(int(p == t) for p, t in zip(pred, w[1:], strict=True))
            total += len(w) - 1
        return {"correct": correct, "total": total}


class CrispEngine:
    """CRISP's CPU-only placement (see the module docstring) with ``threads`` torch and kernel threads."""

    def __init__(self, model_dir: str, pack_dir: str, threads: int, n_ctx: int, reference: bool = False,
                 precision: str = "fp32") -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from crisp_runtime.hf.dropin import apply, load_model
        from crisp_runtime.planning.plan import CrispPlan
        from crisp_runtime.storage.pack import load_pack

        from .common import cache_argument, cache_of

        self.torch = torch
        torch.set_num_threads(threads)
        self.reference = reference
        pack = load_pack(pack_dir)
        if pack.plan is None:
            raise ValueError(f"{pack_dir}: the pack has no plan.json")
        first = pack.layers[min(pack.layers)]
        # cpu="on" needs a device budget; under cpu_only nothing is served from it: the smallest allowed,
        # one token's experts at full width
        budget = pack.plan.top_k * max(layer.nbytes() // layer.num_experts for layer in pack.layers.values())
        self._plans = {"plan": pack.plan, "full": CrispPlan.full(first.num_experts, pack.plan.top_k,
                                                                  first.intermediate_size, sorted(pack.layers))}
        config = crisp_runtime_config(precision, threads)
        serving = {"serving": "cpu_only", "cpu": "on", "gpu_budget": budget, "config": config}
        if reference:
            self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                              local_files_only=True).eval()
            self._apply = lambda: apply(self.model, pack, **serving)
            self.handle = None
        else:
            del pack, first  # load_model reads the pack itself: one copy in memory, not two
            self.model, self.handle = load_model(model_dir, pack_dir, dtype=torch.float32, **serving)
        self._kwargs, self._cache_of = cache_argument(self.model), cache_of
        self.width = None
        self.info = {"torch": torch.__version__, "plan_bytes_fraction": None}
        if self.handle is not None:
            self.info["cpu"] = _jsonable(self.handle.stats().get("cpu"))

    def _ready(self, width: str) -> None:
        if self.handle is None:
            return
        if width != self.width:
            self.handle.set_plan(self._plans[width])
            self.width = width

    def reference_done(self) -> dict:
        """The fp32 reference measured (accuracy before apply): now CRISP takes over the experts."""
        if self.handle is None:
            self.handle = self._apply()
            self.info["cpu"] = _jsonable(self.handle.stats().get("cpu"))
        return {"applied": True}

    def run(self, ids: list[int], prompt: int, width: str = "full", logits: bool = False) -> dict:
        torch = self.torch
        self._ready(width)
        x = torch.tensor(ids).unsqueeze(0)
        rows = []
        with torch.no_grad():
            t0 = time.perf_counter()
            out = self.model(input_ids=x[:, :prompt], use_cache=True)
            t1 = time.perf_counter()
            rows.append(out.logits[0])
            past = self._cache_of(out)
            if self.handle is not None:
                self.handle.reset_stats()  # the decoded tokens' expert bytes; not timed (t_dec starts after it)
            t_dec = time.perf_counter()
            for i in range(prompt, len(ids)):
                out = self.model(input_ids=x[:, i:i + 1], **self._kwargs(past), use_cache=True)
                past = self._cache_of(out)
                rows.append(out.logits[0])
            t2 = time.perf_counter()
        scores = torch.cat(rows).float()
        res = {"prompt_s": t1 - t0, "decode_s": t2 - t_dec, "pred": scores.argmax(-1).tolist()}
        if self.handle is not None:
            res["expert_bytes_per_token"] = self.handle.stats()["bytes_read_per_token"]
        if logits:
            res["logits"] = scores.tolist()
        return res

    def accuracy(self, windows: list[list[int]], width: str = "full") -> dict:
        torch = self.torch
        self._ready(width)
        correct = total = 0
        with torch.no_grad():
            for w in windows:
                x = torch.tensor(w).unsqueeze(0)
                pred = self.model(input_ids=x[:, :-1], use_cache=False).logits[0].argmax(-1)
                correct += int((pred == x[0, 1:]).sum())
                total += len(w) - 1
        return {"correct": correct, "total": total}

    def stats(self) -> dict:
        return {} if self.handle is None else _jsonable(self.handle.stats())

    def breakdown(self, ids: list[int], prompt: int, width: str = "full") -> dict:
        """Where one decode step's time goes, summed over the decoded tokens of ``ids`` (seconds per token):
        the native CPU kernel's calls (timed around the ctypes call, on the runtime's CPU worker thread),
        the MoE blocks (router + the runtime's expert step, the kernel included), attention, the lm head, and
        the rest of the step (norms, embedding, residuals, the transformers model's Python). Timers cost
        ~1 us per hook; a step has ~3 hooks per layer.

        Then the time outside the native calls two ways: ``outside_native_s``, the step less the expert kernel and
        the native dense layers (``dense_kernel_s``), as it ran; and ``floor_step_s``, the same decode again with
        every native call skipped (the experts add nothing, a dense layer's output is zeros): the Python and torch
        work alone, with the caches the native calls would have streamed weights through left warm. Their
        difference is what that work loses to running after the kernels (``cache_effect_s``)."""
        from crisp_kernels import cpu_native

        torch = self.torch
        self._ready(width)
        acc = {"moe": 0.0, "attention": 0.0, "lm_head": 0.0}  # the modules' times (hooks)
        start: dict = {}
        handles = []
        for name, mod in self.model.named_modules():
            kind = ("attention" if name.endswith("self_attn") else "moe" if name.endswith((".mlp", "block_sparse_moe"))
                    else "lm_head" if name == "lm_head" else None)
            if kind is None:
                continue

            def pre(mod, args, kind=kind):
                start[id(mod)] = time.perf_counter()

            def post(mod, args, out, kind=kind):
                acc[kind] += time.perf_counter() - start.pop(id(mod))

            handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
        original = cpu_native.NativeKernel._rows  # both arithmetics' calls go through it
        original_token = cpu_native.BoundRows.one_token_  # and a one-token step's, through the bound rows
        dense_names = ("dense_int8", "dense_q8", "dense_bf16")  # the dense layers (RuntimeConfig.dense)
        original_dense = {name: getattr(cpu_native.NativeKernel, name) for name in dense_names}
        native = {"kernel": [0.0, 0], "dense": [0.0, 0]}  # seconds and calls of the expert kernel, the dense layers

        def timing(fn, kind="kernel"):
            def timed(*a, **k):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    native[kind][0] += time.perf_counter() - t0
                    native[kind][1] += 1
            return timed

        def skipped_dense(kernel, x, *args, **kwargs):  # out is the argument after the weights: zeros, not garbage
            args[-2].zero_()

        def decode(past) -> float:
            t0 = time.perf_counter()
            for i in range(prompt, len(ids)):
                out = self.model(input_ids=x[:, i:i + 1], **self._kwargs(past), use_cache=True)
                past = self._cache_of(out)
            return time.perf_counter() - t0

        x = torch.tensor(ids).unsqueeze(0)
        try:
            with torch.no_grad():
                out = self.model(input_ids=x[:, :prompt], use_cache=True)
                past = self._cache_of(out)
                for key in acc:
                    acc[key] = 0.0
                cpu_native.NativeKernel._rows = staticmethod(timing(original))
                cpu_native.BoundRows.one_token_ = timing(original_token)
                for name, fn in original_dense.items():
                    setattr(cpu_native.NativeKernel, name, timing(fn, "dense"))
                total = decode(past)
                for h in handles:
                    h.remove()
                handles = []
                # the same tokens again from the same prompt (computed, not timed), every native call skipped
                cpu_native.NativeKernel._rows = staticmethod(original)
                cpu_native.BoundRows.one_token_ = original_token
                for name, fn in original_dense.items():
                    setattr(cpu_native.NativeKernel, name, fn)
                out = self.model(input_ids=x[:, :prompt], use_cache=True)
                past = self._cache_of(out)
                cpu_native.NativeKernel._rows = staticmethod(lambda *a, **k: None)
                cpu_native.BoundRows.one_token_ = lambda *a, **k: None
                for name in dense_names:
                    setattr(cpu_native.NativeKernel, name, skipped_dense)
                floor = decode(past)
        finally:
            cpu_native.NativeKernel._rows = staticmethod(original)
            cpu_native.BoundRows.one_token_ = original_token
            for name, fn in original_dense.items():
                setattr(cpu_native.NativeKernel, name, fn)
            for h in handles:
                h.remove()
        n = len(ids) - prompt
        per = {k: v / n for k, v in acc.items()}
        (kernel, kernel_calls), (dense, dense_calls) = native["kernel"], native["dense"]
        outside = total - kernel - dense  # the step's time outside the native calls
        layers = sum(1 for name, _ in self.model.named_modules() if name.endswith("self_attn"))
        return {"tokens": n, "step_s": total / n, "kernel_s": kernel / n,
                "kernel_calls_per_token": kernel_calls / n, "moe_outside_kernel_s": per["moe"] - kernel / n,
                "attention_s": per["attention"],
                "lm_head_s": per["lm_head"],
                "rest_s": total / n - per["moe"] - per["attention"] - per["lm_head"], "layers": layers,
                "dense_kernel_s": dense / n, "dense_calls_per_token": dense_calls / n,
                "outside_native_s": outside / n, "floor_step_s": floor / n, "cache_effect_s": (outside - floor) / n}


def _jsonable(obj):
    return json.loads(json.dumps(obj, default=str))


def make_engine(spec: dict):
    if spec["engine"] == "llama.cpp":
        return LlamaCppEngine(spec["gguf"], spec["threads"], spec["n_ctx"])
    if spec["engine"] == "crisp":
        return CrispEngine(spec["model"], spec["pack"], spec["threads"], spec["n_ctx"],
                           reference=spec.get("reference", False), precision=spec.get("precision", "fp32"))
    raise ValueError(f"engine: expected llama.cpp or crisp, got {spec['engine']!r}")


def serve(spec: dict, requests, reply) -> None:
    """Answer ``requests`` (an iterable of JSON lines) with ``reply(dict)`` until quit."""
    t0 = time.perf_counter()
    engine = make_engine(spec)
    reply({"ready": True, "load_s": time.perf_counter() - t0, "info": engine.info, **rss_mib()})
    for line in requests:
        req = json.loads(line)
        op = req.get("op")
        try:
            if op == "quit":
                reply({"bye": True, **rss_mib()})
                return
            if op == "run":
                reply(engine.run(req["ids"], req["prompt"], req.get("width", "full"), req.get("logits", False)))
            elif op == "accuracy":
                reply(engine.accuracy(req["windows"], req.get("width", "full")))
            elif op == "applied":
                reply(engine.reference_done())
            elif op == "rss":
                reply(rss_mib())
            elif op == "breakdown":
                reply(engine.breakdown(req["ids"], req["prompt"], req.get("width", "full")))
            elif op == "stats":
                reply(engine.stats() if hasattr(engine, "stats") else {})
            else:
                reply({"error": f"unknown op {op!r}"})
        except Exception as err:  # noqa: BLE001 - the parent reports it with the worker's spec
            reply({"error": f"{type(err).__name__}: {err}"})


def main() -> int:
    spec = json.loads(sys.argv[1])
    channel = os.fdopen(os.dup(1), "w", buffering=1)  # the private reply pipe: the original stdout
    os.dup2(2, 1)  # whatever the libraries print goes to stderr
    sys.stdout = sys.stderr
    serve(spec, sys.stdin, lambda obj: channel.write(json.dumps(obj) + "\n"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
