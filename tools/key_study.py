"""Which combination key explains the damage of narrowing a token's lighter routed experts (top-k > 2).

    python -m crisp_tools.key_study --model models/tiny-deepseek --crisp models/tiny-deepseek-crisp \\
        --data data/stdlib-calib.txt --num-dominant 3 --json key-study.json

Calibration text only (what a plan may be fitted on). For each MoE layer, the routed experts of rank >=
``--num-dominant`` by routing weight are skipped in that layer alone, and each token's damage is the KL divergence
of the next-token distribution from the pack's full width at the token's own position. Per key, the mean damage of
each group of tokens (the key's combination) is fitted on windows of the statistics part of the text and predicts
the damage of windows of its held-out part (the last ``--holdout-fraction``, as crisp-profile splits it): the
out-of-sample R^2 = 1 - SSE / SST (a group never seen in the fit predicts the fit's mean). Also reported: the
Spearman correlation, over groups of >= 20 fitted tokens, between a group's frequency and its mean damage (CRISP's
tiers rank combinations by frequency, Hot = most frequent, which assumes a positive one).

Keys: the plan's two (``crisp_runtime.planning.pairs.CombinationKey``: leading pair, leading expert) and, for
reference, two that a plan cannot carry: the leading expert x the rank-2 routing weight, and the lighter experts'
summed routing weight alone (quantile buckets fitted on the fit windows).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from crisp_runtime import cli_args as ca
from crisp_runtime.planning.pairs import CombinationKey, codes_of_sorted
from crisp_runtime.storage.outputs import OutputPathError, check_outputs

from .calibration import (
    CliError,
    MaskedExperts,
    check_pack_of_model,
    check_seq_len,
    dump_json,
    load_model,
    load_pack_dir,
    load_texts,
    log,
    random_windows,
    split_texts,
    stored_weights,
    threads,
)

RANK2_BUCKETS = 4
KEY_STUDY_FORMAT, KEY_STUDY_VERSION = "crisp-key-study", 1  # the --json document
TAIL_BUCKETS = 8
MIN_GROUP_TOKENS = 20  # groups in the frequency / damage correlation


def group_r2(fit_codes: torch.Tensor, fit_y: torch.Tensor, test_codes: torch.Tensor, test_y: torch.Tensor) -> float:
    """Out-of-sample R^2 of predicting ``test_y`` by the mean of ``fit_y`` over the fit tokens of the same code."""
    n = int(max(fit_codes.max(), test_codes.max())) + 1
    fit_y, test_y = fit_y.double(), test_y.double()
    count = torch.bincount(fit_codes, minlength=n).double()
    mean = torch.where(count > 0, torch.bincount(fit_codes, weights=fit_y, minlength=n) / count.clamp(min=1),
                       fit_y.mean())
    sst = float(((test_y - fit_y.mean()) ** 2).sum())
    return 1.0 - float(((test_y - mean[test_codes]) ** 2).sum()) / sst if sst > 0 else float("nan")


def spearman_frequency_damage(codes: torch.Tensor, y: torch.Tensor, min_tokens: int = MIN_GROUP_TOKENS) -> float:
    """Spearman correlation between the token count and the mean ``y`` of the groups with >= min_tokens tokens."""
    count = torch.bincount(codes).double()
    mean = torch.bincount(codes, weights=y.double()) / count.clamp(min=1)
    big = count >= min_tokens
    if int(big.sum()) < 3:
        return float("nan")

    def ranks(x):
        return x.argsort().argsort().double()

    return float(torch.corrcoef(torch.stack([ranks(count[big]), ranks(mean[big])]))[0, 1])


def key_codes(sorted_index: torch.Tensor, sorted_weights: torch.Tensor, num_experts: int, num_dominant: int,
              edges: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{key name: (T,) group code} of tokens whose routed experts are sorted by decreasing routing weight."""
    first, second = sorted_index[:, 0], sorted_index[:, 1]
    lead = codes_of_sorted(CombinationKey.LEADING_EXPERT, first, second, num_experts)
    tail = sorted_weights[:, num_dominant:].sum(1)
    return {
        CombinationKey.LEADING_PAIR.value: codes_of_sorted(CombinationKey.LEADING_PAIR, first, second, num_experts),
        CombinationKey.LEADING_EXPERT.value: lead,
        f"leading expert x rank-2 routing weight ({RANK2_BUCKETS} buckets)":
            lead * RANK2_BUCKETS + torch.bucketize(sorted_weights[:, 2].contiguous(), edges["rank2"]),
        f"lighter experts' routing weight ({TAIL_BUCKETS} buckets, no expert id)":
            torch.bucketize(tail.contiguous(), edges["tail"]),
    }


def _quantile_edges(x: torch.Tensor, buckets: int) -> torch.Tensor:
    return torch.quantile(x.float(), torch.linspace(0, 1, buckets + 1)[1:-1])


class KeyStudy:
    def __init__(self, model_dir, pack_dir, data, *, fit_samples=256, test_samples=64, seq_len=256, batch_size=16,
                 num_dominant=None, holdout_fraction=0.1, seed=0, quiet=False):
        self.t0, self.quiet, self.batch_size = time.time(), quiet, batch_size
        layers, plan, info = load_pack_dir(pack_dir)
        self.model, self.refs = load_model(model_dir)
        check_pack_of_model(layers, info, self.model, f"--crisp {pack_dir}")
        check_seq_len(self.model, seq_len)
        self.layer_ids = sorted(layers)
        first = layers[self.layer_ids[0]]
        self.num_experts, self.inter = first.num_experts, first.intermediate_size
        self.top_k = plan.top_k if plan is not None else None
        if self.top_k is None or self.top_k < 3:
            raise CliError(f"--crisp {pack_dir}: the study needs routing wider than top-2 (the pack's plan has top_k "
                           f"{self.top_k}); at top-2 the leading pair is the whole combination")
        self.num_dominant = plan.num_dominant if num_dominant is None else num_dominant
        if not 1 <= self.num_dominant < self.top_k:
            raise CliError(f"--num-dominant must lie in [1, {self.top_k - 1}], got {self.num_dominant}")
        self.weights = {lid: stored_weights(layer) for lid, layer in layers.items()}
        stats_part, holdout_part = split_texts(load_texts(data), holdout_fraction)
        self.fit = random_windows(stats_part, fit_samples, seq_len, seed + 3, "--data (statistics part)")
        self.test = random_windows(holdout_part, test_samples, seq_len, seed + 4, "--data (held-out part)")
        self.meta = {"model": str(model_dir), "crisp": str(pack_dir), "data": [str(d) for d in data],
                     "fit_windows": fit_samples, "test_windows": test_samples, "seq_len": seq_len, "seed": seed,
                     "holdout_fraction": holdout_fraction, "num_dominant": self.num_dominant, "top_k": self.top_k}

    def log(self, msg):
        log(f"[key-study {time.time() - self.t0:6.1f}s] {msg}", quiet=self.quiet)

    def _damage(self, windows) -> tuple[dict, dict]:
        """({layer: (N*S,) KL of skipping that layer's lighter experts}, {layer: (index, weights) sorted})."""
        nd, k, inter = self.num_dominant, self.top_k, self.inter
        damage = {lid: [] for lid in self.layer_ids}
        routing = {lid: ([], []) for lid in self.layer_ids}

        def skip_in(layer_id):
            def widths(lid, index, weights):
                if lid != layer_id:
                    return None
                order = weights.float().argsort(dim=1, descending=True, stable=True)
                rank = torch.empty_like(order).scatter_(1, order, torch.arange(k).expand_as(order).contiguous())
                return torch.where(rank >= nd, 0, inter)
            return widths

        with torch.no_grad():
            for start in range(0, windows.shape[0], self.batch_size):
                batch = windows[start:start + self.batch_size]
                with MaskedExperts(self.model, self.refs, weights=self.weights, record=True) as inst:
                    base = torch.log_softmax(self.model(input_ids=batch, use_cache=False).logits.float(), -1)
                for lid in self.layer_ids:
                    index, w = torch.cat(inst.trace.index[lid]).long(), torch.cat(inst.trace.weights[lid]).float()
                    order = w.argsort(dim=1, descending=True, stable=True)
                    routing[lid][0].append(index.gather(1, order))
                    routing[lid][1].append(w.gather(1, order))
                    with MaskedExperts(self.model, self.refs, weights=self.weights, widths_fn=skip_in(lid)):
                        masked = torch.log_softmax(self.model(input_ids=batch, use_cache=False).logits.float(), -1)
                    damage[lid].append((base.exp() * (base - masked)).sum(-1).reshape(-1).double())
                self.log(f"{min(start + self.batch_size, windows.shape[0])}/{windows.shape[0]} windows")
        return ({lid: torch.cat(d) for lid, d in damage.items()},
                {lid: (torch.cat(i), torch.cat(w)) for lid, (i, w) in routing.items()})

    def run(self) -> dict:
        fit_y, fit_r = self._damage(self.fit)
        test_y, test_r = self._damage(self.test)
        out = dict(self.meta, layers={})
        for lid in self.layer_ids:
            si, sw = fit_r[lid]
            edges = {"rank2": _quantile_edges(sw[:, 2], RANK2_BUCKETS),
                     "tail": _quantile_edges(sw[:, self.num_dominant:].sum(1), TAIL_BUCKETS)}
            fit_codes = key_codes(si, sw, self.num_experts, self.num_dominant, edges)
            test_codes = key_codes(*test_r[lid], self.num_experts, self.num_dominant, edges)
            out["layers"][str(lid)] = {
                "mean_damage_fit": float(fit_y[lid].mean()), "mean_damage_test": float(test_y[lid].mean()),
                "keys": {name: {"groups_fitted": int(torch.unique(c).numel()),
                                "oos_r2": group_r2(c, fit_y[lid], test_codes[name], test_y[lid]),
                                "spearman_frequency_damage": spearman_frequency_damage(c, fit_y[lid])}
                         for name, c in fit_codes.items()},
            }
        out["elapsed_s"] = round(time.time() - self.t0, 1)
        return out


def to_text(study: dict) -> str:
    lines = [f"skipping routed experts of rank >= {study['num_dominant']} (top-{study['top_k']}), one layer at a "
             f"time: out-of-sample R^2 of the per-token KL by key (Spearman frequency vs damage)"]
    for lid, layer in study["layers"].items():
        lines.append(f"layer {lid} (mean KL {layer['mean_damage_test']:.4f} held out):")
        lines += [f"  {name}: R^2 {v['oos_r2']:+.3f} (Spearman {v['spearman_frequency_damage']:+.2f}), "
                  f"{v['groups_fitted']} groups" for name, v in layer["keys"].items()]
    return "\n".join(lines)


def build_parser():
    p = ca.Parser(prog="python -m crisp_tools.key_study", description=__doc__.split("\n\n")[0],
                  formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, type=ca.nonempty_path, help="local transformers checkpoint folder")
    p.add_argument("--crisp", required=True, type=ca.nonempty_path, help="CRISP pack folder (its 4-bit experts)")
    p.add_argument("--data", required=True, nargs="+", type=ca.nonempty_path,
                   help="calibration text (split like crisp-profile: statistics part, held-out part)")
    p.add_argument("--fit-samples", type=ca.positive_int, default=256, help="windows of the statistics part (fit)")
    p.add_argument("--test-samples", type=ca.positive_int, default=64, help="windows of the held-out part (scored)")
    p.add_argument("--holdout-fraction", type=ca.float_in(0.0, 1.0, low_open=True, high_open=True), default=0.1,
                   help="last share of --data held out (crisp-profile's default)")
    p.add_argument("--num-dominant", type=ca.positive_int, default=None,
                   help="routed experts kept per token (default: the pack plan's num_dominant)")
    p.add_argument("--seq-len", type=ca.int_in(2), default=256, help="tokens per window")
    p.add_argument("--batch-size", type=ca.positive_int, default=16, help="windows per forward pass")
    p.add_argument("--seed", type=ca.seed_int, default=0, help="seed of the window sampling")
    p.add_argument("--threads", type=ca.threads_int, default=None, help="torch CPU threads")
    p.add_argument("--json", default=None, type=ca.nonempty_path,
                   help="write the study as JSON (atomically, never onto an input)")
    ca.add_force(p)
    p.add_argument("--quiet", action="store_true")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_outputs({"--json": args.json}, {"--model": args.model, "--crisp": args.crisp, "--data": args.data},
                      force=args.force, kinds={"--json": {KEY_STUDY_FORMAT}})
        with threads(args.threads):
            study = KeyStudy(args.model, args.crisp, args.data, fit_samples=args.fit_samples,
                             test_samples=args.test_samples, seq_len=args.seq_len, batch_size=args.batch_size,
                             num_dominant=args.num_dominant, holdout_fraction=args.holdout_fraction, seed=args.seed,
                             quiet=args.quiet).run()
    except (CliError, OutputPathError) as exc:
        print(f"key_study: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return ca.interrupted("key_study", resumable=False)
    print(to_text(study))
    if args.json:
        dump_json(args.json, {"format": KEY_STUDY_FORMAT, "version": KEY_STUDY_VERSION, **study})
    return 0


if __name__ == "__main__":
    sys.exit(main())
