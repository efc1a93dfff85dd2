#!/usr/bin/env python3
"""Train a tiny byte-level MoE (Mixtral or DeepSeek-MoE shape) from scratch for CRISP demos and tests.

Nothing is downloaded: the model is a transformers class built from its config with random
initialisation, trained on the byte corpus written by ``tools/make_corpus.py`` (the Python
standard library's sources). Two families (``--family``):

  mixtral      ``MixtralForCausalLM``: every layer MoE, ``--experts`` experts of width
               ``--intermediate-size``, top ``--top-k`` (softmax router). models/tiny-mixtral.
  deepseek_v3  ``DeepseekV3ForCausalLM`` in the DeepSeek-MoE shape: fine-grained routed experts
               of width ``--moe-intermediate-size``, ``--shared-experts`` shared experts (one dense
               MLP of shared * moe width in every MoE layer), the first ``--dense-layers`` layers
               a dense MLP of width ``--intermediate-size``; sigmoid router without group limit
               (n_group = topk_group = 1), top-k weights normalised to sum 1
               (routed_scaling_factor 1). Attention is DeepSeek's MLA with head sizes derived from
               --hidden-size / --heads (see build_config). models/tiny-deepseek.

The Mixtral recipe is unchanged by the second family: the same command gives the same weights.

Deterministic: fixed seeds, ``torch.use_deterministic_algorithms(True)``, a fixed number of
threads, and training windows drawn from a seeded ``torch.Generator``. The same command on
the same Python/torch version and CPU type gives the same weights (floating-point reduction
order can differ across CPU types and thread counts).

Output directory: ``model.safetensors`` + ``config.json`` + ``generation_config.json`` (from
``save_pretrained``) and ``training.json`` (hyperparameters, versions, wall time, metrics,
expert-pair skew on the calibration text).

Usage:
    nice -n 10 python tools/train_tiny_moe.py --steps 2400 --out models/tiny-mixtral
    python tools/train_tiny_moe.py --family deepseek_v3 ... --out models/tiny-deepseek  # see its training.json
    python tools/train_tiny_moe.py --steps 20 --out /tmp/tiny --no-save   # speed probe
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

# Run as a script, Python puts tools/ first on sys.path, where a sibling module could shadow a
# standard-library one (a tools/profile.py once broke transformers' cProfile import); put the
# repository root there instead, which also makes crisp_runtime importable without an install.
_TOOLS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _TOOLS_DIR]
sys.path.insert(0, os.path.dirname(_TOOLS_DIR))
if not __package__:  # run as a script: its sibling modules are the repository's package `tools`
    __package__ = "tools"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from crisp_runtime import cli_args as ca  # noqa: E402
from crisp_runtime.hf.moe_layers import find_moe_layers, record_routing  # noqa: E402
from crisp_runtime.planning import pairs  # noqa: E402
from crisp_runtime.storage.outputs import write_text  # noqa: E402

from .text import VOCAB_SIZE, read_texts, sample_sequences  # noqa: E402

FAMILIES = ("mixtral", "deepseek_v3")
# Options that only the deepseek_v3 family reads (None = not given).
_DEEPSEEK_ONLY = ("moe_intermediate_size", "shared_experts", "dense_layers")


def build_config(args: argparse.Namespace):
    if args.family == "deepseek_v3":
        return _deepseek_config(args)
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.max_positions,
        num_local_experts=args.experts,
        num_experts_per_tok=args.top_k,
        router_aux_loss_coef=args.aux_coef,
        output_router_logits=False,  # saved config: inference default; training passes True
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        use_cache=True,
    )


def _deepseek_config(args: argparse.Namespace):
    """DeepSeek-MoE shape on transformers' DeepSeek-V3 classes (the drop-in runs them).

    Routing: n_group = topk_group = 1 (no group-limited routing: one group of all experts),
    norm_topk_prob with routed_scaling_factor 1.0 so that a token's routed weights sum to 1 as in
    the Mixtral model; e_score_correction_bias stays zero (DeepSeek-V3's aux-loss-free bias update is
    not part of transformers; per_layer_balance_loss balances instead). MLA attention without the
    query low-rank (q_lora_rank None); per head: value and q/k width hidden/heads, half of it rotary
    (qk_rope_head_dim), half not (qk_nope_head_dim); the compressed KV width (kv_lora_rank) is
    hidden/2.
    """
    from transformers import DeepseekV3Config

    head = args.hidden_size // args.heads
    return DeepseekV3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        moe_intermediate_size=args.moe_intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        n_routed_experts=args.experts,
        num_experts_per_tok=args.top_k,
        n_shared_experts=args.shared_experts,
        first_k_dense_replace=args.dense_layers,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        q_lora_rank=None,
        kv_lora_rank=args.hidden_size // 2,
        qk_rope_head_dim=head // 2,
        qk_nope_head_dim=head - head // 2,
        v_head_dim=head,
        max_position_embeddings=args.max_positions,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        use_cache=True,
    )


class WindowSampler:
    """Seeded random windows of ``seq_len + 1`` bytes from one byte stream (no per-step copies)."""

    def __init__(self, texts: list[str], seq_len: int, seed: int):
        data = b"\x00".join(t.encode("utf-8") for t in texts)
        self.stream = torch.frombuffer(bytearray(data), dtype=torch.uint8)  # (total_bytes,)
        self.span = seq_len + 1
        if len(data) < self.span:
            raise ValueError(f"training text has {len(data)} bytes, need at least {self.span}")
        self.gen = torch.Generator().manual_seed(seed)
        self.offsets = torch.arange(self.span)  # (seq_len + 1,)

    def batch(self, batch_size: int) -> torch.Tensor:
        """Returns LongTensor (batch_size, seq_len + 1)."""
        starts = torch.randint(0, len(self.stream) - self.span + 1, (batch_size,), generator=self.gen)
        return self.stream[starts[:, None] + self.offsets[None, :]].long()


@torch.no_grad()
def evaluate(model, seqs: torch.Tensor, batch_size: int = 16) -> dict[str, float]:
    """Mean next-byte loss / perplexity / top-1 accuracy over ``seqs`` (N, L): L-1 predictions each."""
    model.eval()
    total_loss, total_correct, total = 0.0, 0, 0
    for i in range(0, len(seqs), batch_size):
        x = seqs[i : i + batch_size]
        logits = model(input_ids=x[:, :-1], use_cache=False).logits.float()  # (B, L-1, V)
        target = x[:, 1:]  # (B, L-1)
        total_loss += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                      reduction="sum").item()
        total_correct += (logits.argmax(-1) == target).sum().item()
        total += target.numel()
    loss = total_loss / total
    return {"loss": loss, "perplexity": math.exp(loss), "accuracy": total_correct / total,
            "predictions": total}


@torch.no_grad()
def pair_skew(model, seqs: torch.Tensor, top_fraction: float = 0.25, bottom_fraction: float = 0.29,
              batch_size: int = 16) -> list[dict]:
    """Per layer: how concentrated the routed expert combinations (leading pairs) are.

    Counts every token's leading pair on ``seqs`` (N, L) and reports ``crisp_runtime.planning.pairs.pair_skew``:
    the share of activations carried by the most frequent ``top_fraction`` of all C(E, 2) possible
    pairs, and by the least frequent ``bottom_fraction`` (cf. the paper's 25% / 29%). For this top-2
    model the leading pair is the whole routed set.
    """
    refs = find_moe_layers(model)
    model.eval()
    with record_routing(model, refs) as routing:
        for i in range(0, len(seqs), batch_size):
            model(input_ids=seqs[i : i + batch_size], use_cache=False)
    report = []
    for i, ref in enumerate(refs):
        index, weights = routing.layer(ref.layer_id)
        counts = pairs.pair_counts(index, weights, ref.num_experts)
        s = pairs.pair_skew(counts, top_fraction, bottom_fraction)
        n_top, n_bottom = max(1, round(top_fraction * s.possible)), max(1, round(bottom_fraction * s.possible))
        ranked = sorted(pairs.counts_by_pair(counts).items(), key=lambda item: (-item[1], item[0]))
        load = torch.bincount(index.reshape(-1), minlength=ref.num_experts).double()
        report.append({
            "layer": i,
            "tokens": s.tokens,
            "combinations": s.possible,
            f"top_{n_top}_share": s.top_share,
            f"bottom_{n_bottom}_share": s.bottom_share,
            "unused_combinations": s.possible - s.seen,
            "top_combinations": [[list(pair), n] for pair, n in ranked[:n_top]],
            "expert_share": [round(v, 4) for v in (load / load.sum()).tolist()],
        })
    return report


def per_layer_balance_loss(router_logits: tuple[torch.Tensor, ...], top_k: int,
                           scoring: str = "softmax") -> torch.Tensor:
    """Switch-style load-balancing loss, computed per layer and averaged over layers.

    For layer l with router logits (T, E): f_e = share of the T*top_k routed slots that go to
    expert e (no gradient), P_e = mean router probability of e; loss_l = E * sum_e f_e * P_e,
    which is 1.0 for perfectly balanced routing. transformers' built-in aux loss pools the
    tokens of all layers before taking f and P, so one layer's collapse can be offset by
    another's; with it, whole experts died in our probe runs. Per-layer balance avoids that.
    ``scoring``: how the router turns logits into scores; "softmax" (Mixtral) or "sigmoid"
    (DeepSeek-V3: probabilities = sigmoid scores normalised to sum 1 per token, as in
    DeepSeek-V3's sequence-wise balance loss). Top-k of either equals top-k of the logits.
    """
    losses = []
    for logits in router_logits:  # each (T, E)
        if scoring == "softmax":
            probs = logits.float().softmax(dim=-1)  # (T, E)
        elif scoring == "sigmoid":
            scores = logits.float().sigmoid()  # (T, E)
            probs = scores / scores.sum(dim=-1, keepdim=True)
        else:
            raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
        num_experts = probs.shape[-1]
        chosen = probs.topk(top_k, dim=-1).indices  # (T, top_k)
        f = F.one_hot(chosen, num_experts).sum(dim=1).float().mean(dim=0) / top_k  # (E,)
        losses.append(num_experts * (f.detach() * probs.mean(dim=0)).sum())
    return torch.stack(losses).mean()


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup then cosine decay to ``min_lr_ratio * lr``."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _trained_here(folder: Path) -> bool:
    """Whether ``folder`` holds a checkpoint this tool wrote (its training.json, as :func:`main` writes it)."""
    try:
        record = json.loads((folder / "training.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and {"hyperparameters", "tokens_per_step", "train_tokens"} <= record.keys()


def parse_args(argv=None) -> argparse.Namespace:
    p = ca.Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                  epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--family", choices=FAMILIES, default="mixtral",
                   help="model family (see above); deepseek_v3 also takes the three options below it")
    p.add_argument("--data-dir", default="data", help="directory with stdlib-{train,calib,heldout}.txt")
    p.add_argument("--out", default="models/tiny-mixtral", help="output directory for the checkpoint")
    p.add_argument("--steps", type=ca.positive_int, default=2400)
    p.add_argument("--seed", type=ca.seed_int, default=0)
    p.add_argument("--batch-size", type=ca.positive_int, default=16)
    p.add_argument("--seq-len", type=ca.int_in(2), default=256)
    p.add_argument("--lr", type=ca.float_in(0.0, None, low_open=True), default=3e-3)
    p.add_argument("--min-lr-ratio", type=ca.float_in(0.0, 1.0), default=0.1)
    p.add_argument("--warmup", type=ca.nonnegative_int, default=100)
    p.add_argument("--weight-decay", type=ca.float_in(0.0), default=0.1)
    p.add_argument("--grad-clip", type=ca.float_in(0.0, None, low_open=True), default=1.0)
    p.add_argument("--hidden-size", type=ca.positive_int, default=128)
    p.add_argument("--intermediate-size", type=ca.positive_int, default=256)
    p.add_argument("--layers", type=ca.positive_int, default=4)
    p.add_argument("--experts", type=ca.int_in(2), default=8)
    p.add_argument("--top-k", type=ca.positive_int, default=2)
    p.add_argument("--moe-intermediate-size", type=ca.positive_int, default=None,
                   help="deepseek_v3: width of each routed and shared expert")
    p.add_argument("--shared-experts", type=ca.positive_int, default=None,
                   help="deepseek_v3: shared experts per MoE layer (one dense MLP of this many expert widths)")
    p.add_argument("--dense-layers", type=ca.positive_int, default=None,
                   help="deepseek_v3: leading layers with a dense MLP of --intermediate-size instead of MoE")
    p.add_argument("--heads", type=ca.positive_int, default=4)
    p.add_argument("--kv-heads", type=ca.positive_int, default=2)
    p.add_argument("--max-positions", type=ca.int_in(2), default=512)
    p.add_argument("--aux-coef", type=ca.float_in(0.0), default=0.01,
                   help="coefficient of the per-layer router load-balancing loss (1.0 = balanced)")
    p.add_argument("--eval-samples", type=ca.positive_int, default=128, help="held-out / calib windows for metrics")
    p.add_argument("--eval-seed", type=ca.seed_int, default=1234)
    p.add_argument("--threads", type=ca.threads_int, default=2)
    p.add_argument("--train-experts-impl", default="eager",
                   help="experts implementation used while training only (not saved in the config)")
    p.add_argument("--log-every", type=ca.positive_int, default=25)
    p.add_argument("--no-save", action="store_true", help="train and evaluate without writing a checkpoint")
    p.add_argument("--force", action="store_true",
                   help="write into an --out folder that holds files even when this tool did not write them")
    args = p.parse_args(argv)
    problems = []
    if args.heads % args.kv_heads or args.hidden_size % args.heads:
        problems.append(f"--heads {args.heads} must divide --hidden-size {args.hidden_size} and be a multiple of "
                        f"--kv-heads {args.kv_heads}")
    if args.top_k > args.experts:
        problems.append(f"--top-k {args.top_k} is more than --experts {args.experts}")
    given = [o for o in _DEEPSEEK_ONLY if getattr(args, o) is not None]
    if args.family != "deepseek_v3" and given:
        problems.append(f"--{given[0].replace('_', '-')} applies to --family deepseek_v3 only")
    elif args.family == "deepseek_v3":
        missing = [o for o in _DEEPSEEK_ONLY if getattr(args, o) is None]
        if missing:
            problems.append(f"--family deepseek_v3 needs --{missing[0].replace('_', '-')}")
        elif args.dense_layers >= args.layers:
            problems.append(f"--dense-layers {args.dense_layers} leaves no MoE layer of --layers {args.layers}")
        elif (args.hidden_size // args.heads) % 2:
            problems.append(f"--hidden-size / --heads = {args.hidden_size // args.heads} must be even (rotary half)")
    if args.seq_len > args.max_positions:
        problems.append(f"--seq-len {args.seq_len} is beyond --max-positions {args.max_positions}")
    out = Path(args.out)
    if not args.no_save and (out.exists() and not out.is_dir()):
        problems.append(f"--out {args.out}: exists and is not a folder")
    elif not args.no_save and (out / "pack.json").exists():
        problems.append(f"--out {args.out}: holds a CRISP pack; write the checkpoint elsewhere")
    elif not args.no_save and not out.exists() and not out.parent.is_dir():
        problems.append(f"--out {args.out}: its parent folder does not exist")
    elif not args.no_save and not args.force and out.is_dir() and any(out.iterdir()) and not _trained_here(out):
        problems.append(f"--out {args.out}: holds files this tool did not write (no training.json of it); give a "
                        "new or empty folder, or pass --force to write over them")
    if problems:
        p.error(problems[0])
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)

    import transformers
    from transformers import AutoModelForCausalLM

    d = args.data_dir
    train_texts = read_texts([os.path.join(d, "stdlib-train.txt")])
    heldout = sample_sequences(read_texts([os.path.join(d, "stdlib-heldout.txt")]),
                               args.eval_samples, args.seq_len, args.eval_seed)  # (N, L)
    calib = sample_sequences(read_texts([os.path.join(d, "stdlib-calib.txt")]),
                             args.eval_samples, args.seq_len, args.eval_seed)  # (N, L)
    sampler = WindowSampler(train_texts, args.seq_len, args.seed + 1)

    config = build_config(args)
    model = AutoModelForCausalLM.from_config(config)
    model.set_experts_implementation(args.train_experts_impl)
    n_params = sum(p.numel() for p in model.parameters())
    n_expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    print(f"params {n_params:,} (experts {n_expert:,}); train bytes {len(sampler.stream):,}", flush=True)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    scoring = "sigmoid" if args.family == "deepseek_v3" else "softmax"
    tokens_per_step = args.batch_size * args.seq_len
    t0 = time.perf_counter()
    t_log = t0
    for step in range(args.steps):
        model.train()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        batch = sampler.batch(args.batch_size)  # (B, L+1)
        # No labels: the LM loss is computed here on explicit (input, next byte) pairs, and the
        # balance loss from the per-layer router logits (see per_layer_balance_loss).
        out = model(input_ids=batch[:, :-1], output_router_logits=True, use_cache=False)
        logits = out.logits  # (B, L, V)
        lm_loss = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), batch[:, 1:].reshape(-1))
        aux_loss = per_layer_balance_loss(out.router_logits, config.num_experts_per_tok, scoring)
        loss = lm_loss + args.aux_coef * aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        if (step + 1) % args.log_every == 0 or step == 0 or step + 1 == args.steps:
            now = time.perf_counter()
            n_steps = args.log_every if step else 1
            print(f"step {step + 1:5d}/{args.steps} lm_loss {lm_loss.item():.4f} aux {aux_loss.item():.3f} "
                  f"lr {lr_at(step, args):.2e} {n_steps * tokens_per_step / (now - t_log):7.0f} tok/s "
                  f"elapsed {now - t0:6.1f}s", flush=True)
            t_log = now
    wall = time.perf_counter() - t0

    metrics = evaluate(model, heldout)
    calib_metrics = evaluate(model, calib)
    skew = pair_skew(model, calib)
    print(f"held-out: loss {metrics['loss']:.4f} ppl {metrics['perplexity']:.3f} "
          f"acc {metrics['accuracy']:.4f} ({metrics['predictions']} predictions)")
    print(f"calib:    loss {calib_metrics['loss']:.4f} ppl {calib_metrics['perplexity']:.3f} "
          f"acc {calib_metrics['accuracy']:.4f}")
    for r in skew:
        keys = [k for k in r if k.endswith("_share") and k != "expert_share"]
        print(f"layer {r['layer']}: " + " ".join(f"{k} {r[k]:.3f}" for k in keys)
              + f" unused {r['unused_combinations']}/{r['combinations']} expert_share {r['expert_share']}")
    print(f"training wall time {wall:.1f}s ({args.steps * tokens_per_step / wall:.0f} tok/s)")
    if args.no_save:
        return 0

    model.set_experts_implementation("eager")
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    # Reload and check what others rely on: transformers' own class, its expert layout, same metrics.
    reloaded = AutoModelForCausalLM.from_pretrained(args.out)
    assert type(reloaded) is type(model), type(reloaded)
    first_moe = args.dense_layers or 0
    experts = reloaded.model.layers[first_moe].mlp.experts
    E, H = config.num_local_experts, config.hidden_size
    I = config.moe_intermediate_size if args.family == "deepseek_v3" else config.intermediate_size
    assert type(experts).__name__ in ("MixtralExperts", "DeepseekV3Experts"), type(experts)
    assert tuple(experts.gate_up_proj.shape) == (E, 2 * I, H), experts.gate_up_proj.shape
    assert tuple(experts.down_proj.shape) == (E, H, I), experts.down_proj.shape
    with open(os.path.join(args.out, "config.json")) as f:
        assert "experts_implementation" not in f.read(), "config.json forces an experts implementation"
    re_metrics = evaluate(reloaded, heldout)
    assert abs(re_metrics["loss"] - metrics["loss"]) < 1e-4, (re_metrics, metrics)

    description = {
        "mixtral": "Tiny byte-level Mixtral trained from scratch on Python stdlib sources (CRISP demos/tests)",
        "deepseek_v3": "Tiny byte-level DeepSeek-MoE-shaped model (transformers DeepseekV3 classes: fine-grained "
                       "routed experts, shared experts, dense first layer) trained from scratch on Python stdlib "
                       "sources (CRISP beyond top-2)",
    }[args.family]
    record = {
        "description": description,
        "command": "python tools/train_tiny_moe.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "hyperparameters": {k: v for k, v in vars(args).items()
                            if k not in ("out", "no_save", "log_every") and v is not None},
        "aux_loss": "per-layer Switch-style balance loss (per_layer_balance_loss), not transformers' pooled one"
                    + ("; sigmoid scores normalised per token" if scoring == "sigmoid" else ""),
        "tokens_per_step": tokens_per_step,
        "train_tokens": tokens_per_step * args.steps,
        "parameters": n_params,
        "expert_parameters": n_expert,
        **({"shared_expert_parameters": sum(p.numel() for n, p in model.named_parameters() if ".shared_experts." in n)}
           if args.family == "deepseek_v3" else {}),
        "dtype": "float32",
        "tokenizer": "bytes (crisp_tools.text: UTF-8 byte = token id, vocab 256, separator 0)",
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "threads": args.threads},
        "training_wall_time_s": round(wall, 1),
        "heldout": {**metrics, "file": "stdlib-heldout.txt", "samples": args.eval_samples,
                    "seq_len": args.seq_len, "seed": args.eval_seed,
                    "how": "crisp_tools.text.sample_sequences(read_texts([file]), samples, seq_len, seed); "
                           "next-byte predictions at positions 1..seq_len-1"},
        "calib": {**calib_metrics, "file": "stdlib-calib.txt"},
        "combination_skew_calib": skew,
    }
    write_text(os.path.join(args.out, "training.json"), json.dumps(record, indent=1) + "\n")
    print(f"saved {args.out} ({os.path.getsize(os.path.join(args.out, 'model.safetensors')) / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
