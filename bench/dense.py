"""``crisp-bench dense``: what the CPU default's dense layers cost and save on real MoE families' shapes.

A model on the CPU runs its routed experts on the CPU kernel from 4-bit rows; the rest of a token's weights are the
model's own layers: attention, a hybrid's linear-attention layers (Qwen3-Next), the shared experts and dense MLP
layers (Qwen-MoE, DeepSeek) and the lm head, whose vocabulary makes it one of the largest matrices a token reads
(``crisp_runtime.cpu.dense``). This command builds a model with a real family's shapes (its first ``--layers`` layers,
random weights: a whole one does not fit in fp32 on a small machine), applies CRISP as a user would (``apply(model,
pack, gpu_budget=None)``: every expert on the CPU kernel, the dense layers in 8-bit blocks) and decodes batch-1 tokens
with a KV cache, in rounds: the default (after an untimed decode of the same tokens: the CPU kernel prepares an expert
at its first use), then the same handle with its dense layers put back as loaded (``dense="keep"``), the same routed
experts in both. Before timing, the two are checked against each other on the prompt (8-bit rounding of the dense
layers: within 5% relative on the logits). With fewer layers than the model has, the lm head weighs more in a token
than it does in the whole model; the bytes of each part are in the table and the records.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

import torch

from crisp_runtime import cli_args as ca

from . import common, report
from .common import CliError

# each of the default's 8-bit dense layers against the same layer as loaded, on the input the prompt gives it: Q8_0
# rounds inputs and weights ~0.5% relative each (crisp_kernels.dense_int8). A wrong kernel or layout is off by ~100%;
# 5% leaves the rounding ~5x room. Checked per layer, not on the logits: a model with random weights can amplify the
# rounding (rounding Qwen3-Next's linear-attention weights alone to 8-bit blocks moved its first 4 layers' logits by
# 17%; OLMoE's first 2 layers' by 2.2%); the logits' change is reported
CHECK_TOL = 5e-2


@dataclass(frozen=True)
class FamilyShape:
    """A real checkpoint's shapes, from its config.json."""

    name: str
    source: str  # the checkpoint they are read from
    family: str  # transformers' model_type
    layers: int  # the whole model's
    config: dict  # the transformers config's fields (all but num_hidden_layers)
    # fields built otherwise to fit a small machine, that leave a token's bytes as they are (said in the table)
    built: dict = field(default_factory=dict)
    min_layers: int = 1  # the first layers that hold every kind the model has (built even where --layers is fewer)

    def build_config(self) -> dict:
        return {**self.config, **self.built}

    def built_layers(self, layers: int) -> int:
        """The layers built for ``--layers``: at least ``min_layers``."""
        return max(layers, self.min_layers)


FAMILY_SHAPES = {s.name: s for s in (
    FamilyShape("olmoe", "allenai/OLMoE-1B-7B-0924", "olmoe", 16,
                dict(vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_experts=64,
                     num_experts_per_tok=8, num_attention_heads=16, num_key_value_heads=16)),
    FamilyShape("qwen-moe", "Qwen/Qwen1.5-MoE-A2.7B", "qwen2_moe", 24,
                dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
                     shared_expert_intermediate_size=5632, num_experts=60, num_experts_per_tok=4,
                     num_attention_heads=16, num_key_value_heads=16)),
    FamilyShape("deepseek-v2-lite", "deepseek-ai/DeepSeek-V2-Lite", "deepseek_v2", 27,
                dict(vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
                     n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1,
                     num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None,
                     qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, n_group=1, topk_group=1)),
    # a hybrid: three linear-attention layers (gated delta rule) to one of attention; transformers' Qwen3NextConfig
    # defaults are this checkpoint's. 512 experts of 512 neurons (6.4 GB a layer in fp32) built as 32: a token reads
    # the same 10 experts' bytes
    FamilyShape("qwen3-next", "Qwen/Qwen3-Next-80B-A3B-Instruct", "qwen3_next", 48,
                dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632, moe_intermediate_size=512,
                     shared_expert_intermediate_size=512, num_experts=512, num_experts_per_tok=10,
                     num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                     linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                     full_attention_interval=4),
                built=dict(num_experts=32), min_layers=4),  # its first attention layer is the 4th
)}
VARIANTS = ("default", "keep")
ROLE_COLUMNS = ("attention", "mixer", "mlp", "head")  # crisp_runtime.cpu.dense.DenseRole's values, in table order


class DenseBenchError(CliError):
    """A bad argument or a failed check of ``crisp-bench dense``."""


def build_model(shape: FamilyShape, layers: int, seed: int = 0):
    """``shape``'s first ``layers`` layers, random weights (transformers' own initialisation), fp32, eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(shape.family, **shape.build_config(), num_hidden_layers=layers,
                                  max_position_embeddings=4096)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _decode_s(model, ids: torch.Tensor, prompt: int, handle=None) -> float:
    """Seconds per decoded token: the prompt in one forward (untimed), then one forward per remaining id; the
    handle's statistics reset after the prompt (they count the decoded tokens)."""
    kwargs = common.cache_argument(model)
    with torch.no_grad():
        past = common.cache_of(model(input_ids=ids[:, :prompt], use_cache=True))
        if handle is not None:
            handle.reset_stats()
        t0 = time.perf_counter()
        for i in range(prompt, ids.shape[1]):
            past = common.cache_of(model(input_ids=ids[:, i:i + 1], **kwargs(past), use_cache=True))
        return (time.perf_counter() - t0) / (ids.shape[1] - prompt)


def _layer_errors(model, swapped, ids: torch.Tensor) -> tuple[float, str, torch.Tensor]:
    """One forward of ``ids`` with each replaced layer of ``swapped`` (``DenseSwap.swapped``: parent, name, original)
    checked against its original on the same input: the largest relative error, that layer's name, the logits."""
    worst, where = 0.0, ""

    def check(name: str, original):
        def hook(module, args, out):
            nonlocal worst, where
            want = original(args[0])
            err = ((out - want).norm() / want.norm().clamp_min(torch.finfo(want.dtype).tiny)).item()
            if not math.isnan(worst) and not err <= worst:  # a nan stays: no finite error after it hides it
                worst, where = err, name
        return hook

    paths = {id(module): path for path, module in model.named_modules()}
    hooks = [getattr(parent, name).register_forward_hook(check(".".join(filter(None, (paths[id(parent)], name))),
                                                               original))
             for parent, name, original in swapped]
    try:
        with torch.no_grad():
            logits = model(input_ids=ids).logits
    finally:
        for h in hooks:
            h.remove()
    return worst, where, logits


def measure(shape: FamilyShape, layers: int, tokens: int, prompt: int, rounds: int, progress=None) -> list[dict]:
    """The default and ``dense="keep"`` decode, interleaved over ``rounds``; one record each."""
    from crisp_runtime import apply, pack_model
    from crisp_runtime.cpu.dense import dense_linears

    layers = shape.built_layers(layers)
    model = build_model(shape, layers)
    original: dict[str, int] = {}
    for _, _, linear, role in dense_linears(model):
        nbytes = linear.weight.nbytes + (0 if linear.bias is None else linear.bias.nbytes)
        original[role.value] = original.get(role.value, 0) + nbytes
    pack = pack_model(model)
    ids = torch.randint(0, shape.config["vocab_size"], (1, prompt + tokens), generator=torch.Generator().manual_seed(1))
    with apply(model, pack, gpu_budget=None) as handle:  # the two computed on the prompt before anything is timed
        info, placement = handle.stats()["dense"], handle.stats()["cpu"]["placement"]
        if placement != "cpu_only" or info["chosen"] != "q8":
            raise DenseBenchError(f"{shape.name}: the default ran placement {placement!r} with dense "
                                  f"{info.get('chosen')!r} ({info.get('reason', '')}), not the CPU kernel with 8-bit "
                                  "dense layers (does the native kernel build here?)")
        layer_err, where, rounded = _layer_errors(model, handle.dense.swapped, ids[:, :prompt])
        if not layer_err <= CHECK_TOL:
            raise DenseBenchError(f"{shape.name}: the 8-bit dense layer {where} differs from the layer as loaded by "
                                  f"{layer_err:.3%} relative on the prompt (bound {CHECK_TOL:.1%})")
        with torch.no_grad():
            handle.dense.restore()  # the same handle and experts; the dense layers as loaded
            kept = model(input_ids=ids[:, :prompt]).logits
    err = ((rounded - kept).norm() / kept.norm()).item()
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(rounds):
        with apply(model, pack, gpu_budget=None) as handle:
            _decode_s(model, ids, prompt)  # untimed: the CPU kernel prepares each expert at its first use
            default_s = _decode_s(model, ids, prompt, handle)
            expert_bytes = handle.stats()["bytes_read_per_token"]
            handle.dense.restore()  # the same handle, experts and cache; the dense layers as loaded
            keep_s = _decode_s(model, ids, prompt)
        times["default"].append(default_s)
        times["keep"].append(keep_s)
        if progress:
            progress(r + 1, rounds)
    records = []
    for v in VARIANTS:
        ms = [1e3 * s for s in times[v]]
        med = statistics.median(ms)
        dense_bytes = info["role_bytes"] if v == "default" else original
        records.append({"shape": shape.name, "source": shape.source, "layers": layers, "model_layers": shape.layers,
                        "built": dict(shape.built),
                        "variant": v, "dense": "auto" if v == "default" else "keep",
                        "ms_per_token": med, "tokens_per_s": 1e3 / med, "rounds_ms": ms,
                        "dense_bytes": dict(dense_bytes), "dense_bytes_total": sum(dense_bytes.values()),
                        "dense_original_bytes": dict(original), "logits_rel_err": err,
                        "layer_rel_err_max": layer_err,
                        "expert_bytes_per_token": expert_bytes,
                        "threads": torch.get_num_threads(), "tokens": tokens, "prompt": prompt})
    base = statistics.median(times["keep"])
    for rec in records:
        rec["speedup_vs_keep"] = base / statistics.median(times[rec["variant"]])
    return records


def add_parser(subparsers) -> None:
    """The ``crisp-bench dense`` subcommand's options."""
    p = subparsers.add_parser(
        "dense", help="the CPU default's 8-bit dense layers (attention, shared experts, lm head) on real shapes",
        description="Decode tokens/s of a model with a real MoE family's shapes (its first --layers layers, random "
        "weights) on the CPU: CRISP's default (every expert on the CPU kernel; attention, shared experts, dense MLP "
        "layers and the lm head in 8-bit blocks), then the same handle with those layers as loaded in fp32, in each "
        "of --rounds rounds, after checking the two agree on a prompt. Shapes: "
        + "; ".join(f"{s.name} ({s.source}, {s.layers} layers)" for s in FAMILY_SHAPES.values()) + ".")
    p.add_argument("--shapes", type=common.csv_choices(tuple(FAMILY_SHAPES)), default=list(FAMILY_SHAPES),
                   help=f"comma separated: {', '.join(FAMILY_SHAPES)} (default: all)")
    p.add_argument("--layers", type=common.positive_int, default=2,
                   help="the first N layers of each model (default 2: fp32 weights of 2 layers are 3-5 GB; "
                   "DeepSeek-V2-Lite's first layer is its dense one; qwen3-next is built with at least 4, its first "
                   "attention layer being the 4th)")
    p.add_argument("--tokens", type=common.positive_int, default=32, help="decoded tokens per round (default 32)")
    p.add_argument("--prompt", type=common.positive_int, default=16, help="prompt tokens per round (default 16)")
    p.add_argument("--rounds", type=common.positive_int, default=5, help="timed rounds (default 5)")
    p.add_argument("--json", metavar="PATH", type=ca.nonempty_path,
                   help="write the records as JSON to PATH (atomically)")
    ca.add_force(p)
    p.add_argument("--threads", type=ca.threads_int, default=None, help="torch CPU threads (default: torch's)")


def run(args) -> int:
    from crisp_kernels import cpu_native

    if not cpu_native.available():
        raise DenseBenchError("the native CPU kernel does not build here (a C compiler is needed at first use): "
                              "the dense layers stay as loaded, nothing to compare")
    shallow = [f"{s.name} has {s.layers}" for s in map(FAMILY_SHAPES.get, args.shapes) if args.layers > s.layers]
    if shallow:  # every shape checked before the first is measured
        raise DenseBenchError(f"--layers {args.layers}: {', '.join(shallow)} layers")
    records = []
    for name in args.shapes:
        shape = FAMILY_SHAPES[name]
        recs = measure(shape, args.layers, args.tokens, args.prompt, args.rounds,
                       progress=report.Progress(f"dense {shape.name}"))
        records += recs
        rows = [dict(r, experts_mb=(r["expert_bytes_per_token"] or 0) / 1e6,
                     **{f"{role}_mb": r["dense_bytes"].get(role, 0) / 1e6 for role in ROLE_COLUMNS})
                for r in recs]
        mixers = [("mixer_mb", "mixers MB")] if any(r["mixer_mb"] for r in rows) else []
        built = "".join(f", {k} built as {v} of {shape.config[k]}" for k, v in shape.built.items())
        print(report.table(rows, [("variant", "dense layers"), ("ms_per_token", "ms/token"),
                                  ("tokens_per_s", "tok/s"), ("speedup_vs_keep", "x keep"),
                                  ("attention_mb", "attention MB"), *mixers, ("mlp_mb", "shared/dense MLP MB"),
                                  ("head_mb", "lm head MB"), ("experts_mb", "experts MB/token")],
                           title=f"{shape.name} ({shape.source}'s shapes, {recs[0]['layers']} of {shape.layers} layers"
                           f"{built}, random weights), batch-1 decode, {torch.get_num_threads()} threads; default = "
                           f"8-bit blocks, keep = fp32 as loaded; on the prompt each 8-bit layer within "
                           f"{recs[0]['layer_rel_err_max']:.2%} of the layer as loaded, the logits "
                           f"{recs[0]['logits_rel_err']:.2%} from keep's"))
        print()
    common.emit(args, "dense", records)
    return 0
