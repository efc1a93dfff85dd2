"""``crisp-profile``: turn a model and calibration text into a CRISP pack and plan.

Steps (all measured on the calibration text; nothing is downloaded):

1. **Statistics** (one pass over ``--samples`` windows, resumable batch by batch). For every
   MoE layer, expert e and neuron j, with h = silu(gate_j·x) * (up_j·x) the neuron's activation
   and w the token's routing weight for e, summed over the tokens routed to e:

       importance[e, j] = sum_t w_t * |h_tj| * ||down[:, j]||

   This is the magnitude of neuron j's contribution to the layer output, w_t * h_tj * down[:, j]
   (what dropping it removes), so weighting by the routing weight is not a heuristic: a neuron
   that only fires for tokens that give the expert a small weight contributes little.
   (``--importance mean-abs`` drops the weight, for comparison.) Also counted: the leading
   pair (the two experts with the highest routing weights, ``crisp_runtime.plan``) of every
   token, and the routing weight each member gets within its pair (the dominance proxy).
2. **Permutation**: neurons of each expert sorted by decreasing importance; the pack stores
   them in that order, so a width-k execution reads the k most important ones.
3. **Tiers** per layer with ``assign_tiers`` (Hot = most frequent pairs carrying ``--hot-mass``
   of activations, Cold = least frequent carrying at most ``--cold-mass``).
4. **Dominance, measured**: on separate calibration windows, for every pair seen on at least
   ``--dominance-min-tokens`` tokens of a layer, each member's contribution is set to zero for
   the tokens routed to that pair (in that layer only) and the increase of the total next-token
   loss of the affected windows, per masked token, is measured. The member whose masking hurts
   more is dominant. Rare pairs fall back to the routing-weight proxy (the member with the larger
   mean routing weight within the pair); the agreement between measurement and proxy is reported.
5. **Search** (optional, ``--search-target-bytes F``): tier cut-offs and the Warm width that
   minimise the loss on held-out *calibration* windows (the last ``--holdout-fraction`` of the
   calibration text, never the evaluation text) with expert bytes per token <= F x full width.
6. **Pack**: 4-bit, group-wise, neuron-major, reordered (``crisp_kernels.pack_layer``), written
   with the plan and a ``pack.json`` describing the model and the profiling.

Output is written atomically: built in a temporary folder next to ``--out`` and renamed onto it.
An ``--out`` that holds another model's pack, anything besides a pack's own files (pack.json,
plan.json, experts.safetensors), or that is, contains or lies inside ``--model`` / ``--data`` is
refused before any work. Statistics are checkpointed after every batch in a run-keyed folder of
the work folder (``tools.workdir``: only files the run wrote are ever deleted); rerunning the same
command (also after Ctrl-C, exit code 130) resumes from there, and the result equals that of an
uninterrupted run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from crisp_kernels.format import QuantFormat, dequantize_layer, pack_layer
from crisp_runtime import cli_args as ca
from crisp_runtime.outputs import OutputPathError, check_not_input_folder, check_writable_folder
from crisp_runtime.pairs import leading_pairs, pair_codes, pair_counts, pair_skew
from crisp_runtime.plan import (
    CrispPlan,
    LayerPlan,
    Tier,
    TierCutoffs,
    TierWidths,
    assign_tiers,
)

from .calibration import (
    DTYPES,
    CliError,
    MaskedExperts,
    check_seq_len,
    check_vocab,
    load_model,
    load_texts,
    log,
    model_fingerprint,
    random_windows,
    resolve_device,
    score_windows,
    split_texts,
    threads,
)
from .workdir import WorkFolder

STATS_FILE = "stats.safetensors"
PROFILE_VERSION = 1

# Defaults of the tier cut-offs and the Warm width. The paper does not state its values; these are
# set by arithmetic for the target, <= 55% of full-width expert bytes per token at top-2.
# A token of a Hot pair reads 2 full experts, Warm 1 + warm_width, Cold 1, so the bytes fraction is
# (1 + hot_share + warm_width * warm_share) / 2. Hot = pairs carrying 5% of activations (the last
# Hot pair overshoots, so ~5-8%), Cold = the rarest pairs carrying up to 50% (on the paper's skew
# the bottom 29% of pairs carry < 10%, so Cold is most of the pairs but a minority of the tokens
# only if the skew is strong), Warm at 1/16 width: (1 + 0.05..0.08 + 0.45 * 0.0625) / 2 = 54-55.4%.
# They are starting points, not a measurement: `--search-target-bytes F` measures the loss of
# alternatives on held-out calibration text and picks the best; pack.json records the candidates.
DEFAULT_HOT_MASS = 0.05
DEFAULT_COLD_MASS = 0.5
DEFAULT_WARM_WIDTH = 0.0625

SEARCH_HOT = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5)
# Which expert of a combination is dominant: a fixed per-pair label measured by masking
# ("measured", the paper's rule), or the heavier expert of each token by routing weight
# ("routing-weight": the plan stores no label). "auto" keeps whichever has the lower loss on the
# held-out calibration windows. On the trained tiny Mixtral (models/tiny-mixtral) the fixed labels
# lost at every setting: all-Cold at 50% bytes, accuracy 0.565 (measured labels) vs 0.707
# (routing weight) on calibration windows, so per-token information beats a per-pair label there.
DOMINANCE_RULES = ("auto", "routing-weight", "measured")
SEARCH_COLD = (0.0, 0.1, 0.2, 0.3, 0.5)
# Routing wider than top-2: how many experts of a token run full width (the plan's num_dominant).
# At top-k the dominants alone cost num_dominant / k of the full-width bytes (1/6 = 17% at top-6,
# 2/6 = 33%, 3/6 = 50%), so a target F admits every count with num_dominant / k <= F; the search
# tries each of them (at top-2 only 1: two dominants are full width). With two or more dominants
# both leading-pair members are full width, so a per-pair label cannot change any width and only
# the routing-weight rule is searched there.


class ProfileInterrupted(RuntimeError):
    """Raised by the test hook ``interrupt_after`` to simulate a crash after some batches."""


@dataclass
class ProfileConfig:
    model: str
    data: list[str]
    out: str
    samples: int = 2048
    seq_len: int = 256
    batch_size: int = 16
    seed: int = 0
    device: str = "cpu"
    dtype: str = "auto"
    group_size: int = 64
    symmetric: bool = False
    importance: str = "weighted"
    hot_mass: float = DEFAULT_HOT_MASS
    cold_mass: float = DEFAULT_COLD_MASS
    warm_width: float = DEFAULT_WARM_WIDTH
    holdout_fraction: float = 0.1
    dominance_samples: int = 64
    dominance_min_tokens: int = 32
    dominance_max_windows: int = 8
    dominance: str = "auto"
    num_dominant: int | None = None  # None: 1, or searched with search_target_bytes (see above)
    search_target_bytes: float | None = None
    search_samples: int = 32
    work_dir: str | None = None
    keep_work: bool = False
    threads: int | None = None
    quiet: bool = False
    extra: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- helpers


def bytes_fraction(plan: CrispPlan, routing: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean expert bytes per token under ``plan`` over recorded routing, as a fraction of full width."""
    used = total = 0
    for layer_id, (index, weights) in routing.items():
        widths = plan.token_widths(layer_id, index, weights)
        used += int(widths.sum())
        total += index.numel() * plan.intermediate_size
    return used / total if total else 0.0


def _sha256_bytes(*chunks: bytes) -> str:
    h = hashlib.sha256()
    for c in chunks:
        h.update(c)
    return h.hexdigest()


def _pack_json_model(path: Path) -> dict | None:
    """The model fingerprint recorded in an existing pack folder's pack.json, or None if absent."""
    try:
        data = json.loads((path / "pack.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    for holder in (data.get("info"), data):
        if isinstance(holder, dict) and isinstance(holder.get("model"), dict):
            return holder["model"]
    return None


def pack_file_names() -> tuple[str, ...]:
    """The files a pack folder consists of: the only ones crisp-profile ever replaces in --out."""
    from crisp_runtime.pack import PACK_FILES

    return PACK_FILES


def check_out_files(out: Path) -> dict | None:
    """Refuse an --out that is not a folder or holds anything besides a pack's own files (no model needed,
    so this runs before the model is loaded). Returns the model fingerprint of the pack found there, if any."""
    try:  # the pack is staged beside --out and swapped in: its parent must take new files
        check_writable_folder(f"--out {out}", out.parent)
    except OutputPathError as exc:
        raise CliError(str(exc)) from exc
    if not out.exists():
        return None
    if not out.is_dir():
        raise CliError(f"--out {out}: exists and is not a folder")
    if not any(out.iterdir()):
        return None
    existing = _pack_json_model(out)
    if existing is None:
        raise CliError(f"--out {out}: the folder is not empty and holds no CRISP pack; refusing to replace it")
    others = sorted(p.name for p in out.iterdir() if p.name not in pack_file_names())
    if others:
        listed = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
        raise CliError(f"--out {out}: beside the CRISP pack the folder holds other files ({listed}); refusing to "
                       f"replace it (give an empty or new folder)")
    return existing


def check_out_dir(out: Path, fingerprint: dict) -> None:
    """Refuse an --out that holds something other than an older pack of this same model (and only that)."""
    existing = check_out_files(out)
    if existing is None:
        return
    if existing.get("weights_sha256") != fingerprint["weights_sha256"] or any(
        existing.get(k) != fingerprint[k] for k in ("hidden_size", "intermediate_size", "num_experts", "layer_ids")
    ):
        raise CliError(
            f"--out {out}: holds the pack of a different model ({existing.get('model_type')}, "
            f"weights {str(existing.get('weights_sha256'))[:12]}...); choose another --out or delete it"
        )


# ----------------------------------------------------------------------------- checkpointed statistics


class Stats:
    """Sums accumulated over calibration batches (float64 so that resuming reproduces them exactly)."""

    def __init__(self, num_layers: int, num_experts: int, inter: int):
        self.imp_weighted = torch.zeros(num_layers, num_experts, inter, dtype=torch.float64)
        self.imp_abs = torch.zeros(num_layers, num_experts, inter, dtype=torch.float64)
        self.expert_tokens = torch.zeros(num_layers, num_experts, dtype=torch.int64)
        self.pair_counts = torch.zeros(num_layers, num_experts, num_experts, dtype=torch.int64)  # [a, b], a < b
        self.pair_weight = torch.zeros(num_layers, num_experts, num_experts, dtype=torch.float64)  # [m, other]
        self.dominance = torch.full((num_layers, num_experts, num_experts), float("nan"), dtype=torch.float64)
        self.next_batch = 0
        self.dominance_layers_done = 0

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in vars(self).items() if isinstance(v, torch.Tensor)}

    def save(self, path: Path, run_key: str) -> None:
        from safetensors.torch import save_file

        from crisp_kernels.io import atomic_write

        meta = {"run_key": run_key, "next_batch": str(self.next_batch),
                "dominance_layers_done": str(self.dominance_layers_done), "version": str(PROFILE_VERSION)}
        tensors = {k: v.contiguous() for k, v in self.tensors().items()}
        atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=meta))

    @classmethod
    def load(cls, path: Path, run_key: str, shape) -> Stats | None:
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                if meta.get("run_key") != run_key or meta.get("version") != str(PROFILE_VERSION):
                    return None
                stats = cls(*shape)
                for name in stats.tensors():
                    t = f.get_tensor(name)
                    if t.shape != getattr(stats, name).shape:
                        return None
                    setattr(stats, name, t)
        except Exception:  # a corrupt or foreign checkpoint: start over
            return None
        stats.next_batch = int(meta["next_batch"])
        stats.dominance_layers_done = int(meta["dominance_layers_done"])
        return stats


# ----------------------------------------------------------------------------- the profiler


class Profiler:
    def __init__(self, cfg: ProfileConfig):
        self.cfg = cfg
        self.t0 = time.time()
        self._validate_and_prepare()

    # -- everything that can fail on bad input happens here, before any output is written
    def _validate_and_prepare(self) -> None:
        cfg = self.cfg
        if cfg.samples < 1:
            raise CliError(f"--samples must be positive, got {cfg.samples}")
        if cfg.batch_size < 1:
            raise CliError(f"--batch-size must be positive, got {cfg.batch_size}")
        if not 0.0 < cfg.holdout_fraction < 1.0:
            raise CliError(f"--holdout-fraction must lie in (0, 1), got {cfg.holdout_fraction}")
        if not 0.0 <= cfg.warm_width <= 1.0:
            raise CliError(f"--warm-width is a fraction of the full width in [0, 1], got {cfg.warm_width}")
        if cfg.search_target_bytes is not None and not 0.0 < cfg.search_target_bytes <= 1.0:
            raise CliError(
                f"--search-target-bytes is a fraction of full width in (0, 1], got {cfg.search_target_bytes}"
            )
        if cfg.importance not in ("weighted", "mean-abs"):
            raise CliError(f"--importance must be 'weighted' or 'mean-abs', got {cfg.importance!r}")
        try:
            self.cutoffs = TierCutoffs(cfg.hot_mass, cfg.cold_mass)
        except ValueError as exc:
            raise CliError(f"--hot-mass {cfg.hot_mass} / --cold-mass {cfg.cold_mass}: {exc}") from exc
        try:
            self.fmt = QuantFormat(group_size=cfg.group_size, symmetric=cfg.symmetric)
        except ValueError as exc:
            raise CliError(f"--group-size {cfg.group_size}: {exc}") from exc
        self.out = Path(cfg.out).absolute()
        inputs = {"--model": cfg.model, "--data": list(cfg.data)}
        try:
            check_not_input_folder("--out", self.out, inputs)
            work_root = (Path(cfg.work_dir).absolute() if cfg.work_dir
                         else self.out.parent / f".{self.out.name}.crisp-work")
            check_not_input_folder("--work-dir", work_root, {**inputs, "--out": str(self.out)})
        except OutputPathError as exc:
            raise CliError(str(exc)) from exc
        check_out_files(self.out)  # before the (possibly slow) model load; the model is checked below
        self.device = resolve_device(cfg.device)
        # Cheap checks on the text before the (possibly slow) model load.
        texts = load_texts(cfg.data)
        self.model, self.layers = load_model(cfg.model, self.device, cfg.dtype)
        check_seq_len(self.model, cfg.seq_len)
        ref = self.layers[0]
        self.num_experts, self.inter, self.hidden = ref.num_experts, ref.intermediate_size, ref.hidden_size
        from crisp_runtime.models import model_top_k

        self.top_k = model_top_k(self.model)
        if self.top_k < 2:
            raise CliError(f"--model: routes top-{self.top_k}; CRISP's combinations need top-k >= 2")
        if cfg.num_dominant is not None and not 1 <= cfg.num_dominant < self.top_k:
            raise CliError(f"--num-dominant {cfg.num_dominant}: the model routes top-{self.top_k}, expected "
                           f"1..{self.top_k - 1} (top-k dominants would be full width everywhere)")
        try:
            self.fmt.check_hidden_size(self.hidden)
        except ValueError as exc:
            raise CliError(f"--group-size {cfg.group_size}: {exc}") from exc
        self.layer_ids = [r.layer_id for r in self.layers]
        self.fingerprint = model_fingerprint(self.model, self.layers)
        check_out_dir(self.out, self.fingerprint)

        stats_texts, holdout_texts = split_texts(texts, cfg.holdout_fraction)
        self.windows = random_windows(stats_texts, cfg.samples, cfg.seq_len, cfg.seed, "--data (calibration part)")
        self.dom_windows = random_windows(
            stats_texts, cfg.dominance_samples, cfg.seq_len, cfg.seed + 1, "--data (calibration part)"
        )
        if cfg.dominance not in DOMINANCE_RULES:
            raise CliError(f"--dominance: expected one of {DOMINANCE_RULES}, got {cfg.dominance!r}")
        self.search_windows = None
        if cfg.search_target_bytes is not None or cfg.dominance == "auto":
            self.search_windows = random_windows(
                holdout_texts, cfg.search_samples, cfg.seq_len, cfg.seed + 2,
                f"--data (held-out calibration part, last {cfg.holdout_fraction:.0%})",
            )
        check_vocab(self.model, self.windows)
        data_digest = _sha256_bytes(self.windows.numpy().tobytes(), self.dom_windows.numpy().tobytes())
        self.run_key = _sha256_bytes(
            json.dumps(self.fingerprint, sort_keys=True).encode(), data_digest.encode(),
            json.dumps([cfg.batch_size, cfg.dominance_min_tokens, cfg.dominance_max_windows]).encode(),
        )
        self.work = WorkFolder(work_root, self.run_key, STATS_FILE)
        self.work.check()

    def log(self, msg: str) -> None:
        log(f"[crisp-profile {time.time() - self.t0:6.1f}s] {msg}", quiet=self.cfg.quiet)

    # -- main flow
    def run(self, interrupt_after: int | None = None) -> dict:
        self.work.open()
        try:
            info = self._run(interrupt_after)
        except BaseException:
            self.work.release()  # the checkpoint stays: rerunning resumes from it
            raise
        if self.cfg.keep_work:
            self.work.release()
        else:
            self.work.remove()
        others = self.work.others()
        if others:
            self.log(f"left alone: {len(others)} checkpoint folder(s) of runs with other settings in {self.work.root} "
                     f"({', '.join(p.name for p in others[:3])}); rerun those commands to finish them, or delete them")
        self.log(f"wrote {self.out} in {time.time() - self.t0:.1f} s")
        return info

    def _run(self, interrupt_after: int | None) -> dict:
        cfg = self.cfg
        ckpt = self.work.checkpoint
        shape = (len(self.layers), self.num_experts, self.inter)
        stats = Stats.load(ckpt, self.run_key, shape) if ckpt.exists() else None
        if stats is None:
            if ckpt.exists():  # truncated, corrupt or of another version: it is ours (run-keyed folder), redo it
                self.log(f"the checkpoint {ckpt} is unreadable or of another version; starting over")
            stats = Stats(*shape)
        else:
            self.log(f"resuming from {ckpt}: batch {stats.next_batch}, dominance layers {stats.dominance_layers_done}")
        with threads(cfg.threads):
            self._statistics(stats, ckpt, interrupt_after)
            order = self._permutation(stats)
            self._dominance(stats, ckpt)
            packed = self._pack(order)
            rules = ["measured", "routing-weight"] if cfg.dominance == "auto" else [cfg.dominance]
            search = None
            if cfg.search_target_bytes is not None:
                plan, plan_info = self._plan(stats, rules[0])
                plan, search = self._search(stats, plan, packed, rules)
                plan_info["dominance_rule"] = search["chosen"]["dominance"]
            else:
                plan, plan_info = self._plan(stats, rules[0])
                plan_info["dominance_rule"] = rules[0]
                if len(rules) > 1:
                    plan, plan_info["dominance_rule"], plan_info["dominance_choice"] = self._choose_rule(
                        stats, packed, rules)
        info = self._info(stats, plan, plan_info, search)
        self._write(packed, plan, info)
        return info

    def _statistics(self, stats: Stats, ckpt: Path, interrupt_after: int | None) -> None:
        cfg = self.cfg
        num_batches = math.ceil(self.windows.shape[0] / cfg.batch_size)
        slot = {lid: i for i, lid in enumerate(self.layer_ids)}
        E = self.num_experts

        def observer(layer_id, expert, h, routing):
            i = slot[layer_id]
            a = h.detach().abs().double()
            stats.imp_weighted[i, expert] += (a * routing.double().unsqueeze(1)).sum(0).cpu()
            stats.imp_abs[i, expert] += a.sum(0).cpu()
            stats.expert_tokens[i, expert] += h.shape[0]

        done_now = 0
        start = time.time()
        with MaskedExperts(self.model, self.layers, observer=observer, record=True) as inst:
            for b in range(stats.next_batch, num_batches):
                inst.reset_trace()
                batch = self.windows[b * cfg.batch_size : (b + 1) * cfg.batch_size].to(self.device)
                with torch.no_grad():
                    self.model(input_ids=batch, use_cache=False)
                for layer_id in self.layer_ids:
                    i = slot[layer_id]
                    index = torch.cat(inst.trace.index[layer_id]).long()
                    weights = torch.cat(inst.trace.weights[layer_id])
                    stats.pair_counts[i] += pair_counts(index, weights, E)
                    first, second = leading_pairs(index, weights)
                    w_first = (weights * (index == first.unsqueeze(1))).sum(1).double()
                    w_second = (weights * (index == second.unsqueeze(1))).sum(1).double()
                    stats.pair_weight[i].view(-1).index_add_(0, first * E + second, w_first)
                    stats.pair_weight[i].view(-1).index_add_(0, second * E + first, w_second)
                stats.next_batch = b + 1
                stats.save(ckpt, self.run_key)
                done_now += 1
                elapsed = time.time() - start
                eta = elapsed / done_now * (num_batches - b - 1)
                self.log(f"statistics: batch {b + 1}/{num_batches} ({elapsed:.1f} s, ~{eta:.0f} s left)")
                if interrupt_after is not None and done_now >= interrupt_after and b + 1 < num_batches:
                    raise ProfileInterrupted(f"interrupted after {done_now} batches (test hook)")

    def _scores(self, stats: Stats) -> torch.Tensor:
        """Importance per (layer slot, expert, neuron), see the module docstring."""
        base = stats.imp_weighted if self.cfg.importance == "weighted" else stats.imp_abs
        norms = torch.stack([r.module.down_proj.detach().float().norm(dim=1).cpu().double() for r in self.layers])
        return base * norms  # (L, E, I) * (L, E, I)

    def _permutation(self, stats: Stats) -> dict[int, torch.Tensor]:
        scores = self._scores(stats)
        order = {}
        for i, layer_id in enumerate(self.layer_ids):
            # stable sort: ties (e.g. neurons never activated) keep their original order
            order[layer_id] = torch.sort(-scores[i], dim=1, stable=True).indices
        return order

    # -- dominance: masking each member of frequent pairs on separate calibration windows
    def _dominance(self, stats: Stats, ckpt: Path) -> None:
        cfg = self.cfg
        if stats.dominance_layers_done >= len(self.layers):
            return
        E, S = self.num_experts, self.dom_windows.shape[1]
        with MaskedExperts(self.model, self.layers, record=True) as inst:
            base = score_windows(self.model, self.dom_windows, cfg.batch_size)
            codes = {}
            n = self.dom_windows.shape[0]
            for layer_id in self.layer_ids:
                index = torch.cat(inst.trace.index[layer_id]).long()
                weights = torch.cat(inst.trace.weights[layer_id])
                codes[layer_id] = pair_codes(index, weights, E).view(n, S)
        base_seq = base.nll.double().sum(1)  # (N,)
        for i, layer_id in enumerate(self.layer_ids):
            if i < stats.dominance_layers_done:
                continue
            code = codes[layer_id]
            values, counts = torch.unique(code, return_counts=True)
            frequent = [(int(v), int(c)) for v, c in zip(values, counts, strict=True) if c >= cfg.dominance_min_tokens]
            t_layer = time.time()
            for v, _ in frequent:
                a, b = divmod(v, E)
                hits = (code == v).sum(1)  # positions per window
                rows = torch.argsort(hits, descending=True, stable=True)[: cfg.dominance_max_windows]
                rows = rows[hits[rows] > 0]
                sub = self.dom_windows[rows]
                sub_mask = (code[rows] == v).reshape(-1)  # flattened like the experts' tokens
                masked_tokens = int(sub_mask.sum())
                for member, other in ((a, b), (b, a)):
                    def widths_fn(lid, index, weights, member=member, sub_mask=sub_mask, layer_id=layer_id):
                        if lid != layer_id:
                            return None
                        w = torch.full_like(index, self.inter)
                        kill = sub_mask.to(index.device).unsqueeze(1) & (index == member)
                        return torch.where(kill, torch.zeros_like(w), w)

                    with MaskedExperts(self.model, self.layers, widths_fn=widths_fn):
                        # one batch, so that the flattened tokens line up with sub_mask
                        masked = score_windows(self.model, sub, batch_size=sub.shape[0])
                    damage = float((masked.nll.double().sum(1) - base_seq[rows]).sum()) / masked_tokens
                    stats.dominance[i, member, other] = damage
            stats.dominance_layers_done = i + 1
            stats.save(ckpt, self.run_key)
            self.log(f"dominance: layer {layer_id}: {len(frequent)} pairs measured ({time.time() - t_layer:.1f} s)")

    def _dominant(self, stats: Stats, i: int, a: int, b: int) -> tuple[int, int, bool]:
        """(measured-or-proxy dominant, proxy dominant, measured?) of pair (a, b) in layer slot i."""
        cnt = int(stats.pair_counts[i, a, b])
        proxy = a if stats.pair_weight[i, a, b] >= stats.pair_weight[i, b, a] or cnt == 0 else b
        da, db = float(stats.dominance[i, a, b]), float(stats.dominance[i, b, a])
        if math.isnan(da) or math.isnan(db):
            return proxy, proxy, False
        return (a if da >= db else b), proxy, True

    def _layer_plans(self, stats: Stats, cutoffs: TierCutoffs, rule: str) -> dict[int, LayerPlan]:
        E = self.num_experts
        layers = {}
        for i, layer_id in enumerate(self.layer_ids):
            counts = {(a, b): int(stats.pair_counts[i, a, b]) for a in range(E) for b in range(a + 1, E)
                      if stats.pair_counts[i, a, b] > 0}
            tiers = assign_tiers(counts, cutoffs)
            dominant = {p: self._dominant(stats, i, *p)[0] for p in tiers} if rule == "measured" else {}
            layers[layer_id] = LayerPlan(tiers, dominant)
        return layers

    def _plan(self, stats: Stats, rule: str) -> tuple[CrispPlan, dict]:
        cfg = self.cfg
        E = self.num_experts
        measured = agree = 0
        weighted_agree = weighted_total = 0
        per_layer = {}
        for i, layer_id in enumerate(self.layer_ids):
            rows = []
            for a in range(E):
                for b in range(a + 1, E):
                    cnt = int(stats.pair_counts[i, a, b])
                    if cnt == 0:
                        continue
                    dom, proxy, was_measured = self._dominant(stats, i, a, b)
                    entry = {"experts": [a, b], "count": cnt, "dominant": dom, "proxy_dominant": proxy,
                             "measured": was_measured,
                             "mean_weight": [float(stats.pair_weight[i, a, b]) / cnt,
                                             float(stats.pair_weight[i, b, a]) / cnt]}
                    if was_measured:
                        entry["mask_damage"] = [float(stats.dominance[i, a, b]), float(stats.dominance[i, b, a])]
                        measured += 1
                        agree += dom == proxy
                        weighted_total += cnt
                        weighted_agree += cnt * (dom == proxy)
                    rows.append(entry)
            per_layer[str(layer_id)] = sorted(rows, key=lambda r: -r["count"])
        warm = round(cfg.warm_width * self.inter)
        dominants = cfg.num_dominant or 1
        plan = CrispPlan.crisp(
            E, self.top_k, self.inter, self._layer_plans(stats, self.cutoffs, rule), TierWidths(self.inter, warm, 0),
            unseen_tier=Tier.WARM, num_dominant=dominants,
            description=self._description(self.cutoffs, warm, rule, dominants),
        )
        info = {
            "dominance_measured_pairs": measured,
            "dominance_proxy_agreement": agree / measured if measured else None,
            "dominance_proxy_agreement_token_weighted": weighted_agree / weighted_total if weighted_total else None,
            "combinations": per_layer,
        }
        self.log(
            f"plan: {measured} pairs with measured dominance; routing-weight proxy agrees on "
            f"{info['dominance_proxy_agreement'] if measured else float('nan'):.1%}"
        )
        return plan, info

    def _description(self, cutoffs: TierCutoffs, warm: int, rule: str, num_dominant: int = 1) -> str:
        if self.top_k > 2:
            return self._description_pair(cutoffs, warm, rule) + (
                f" Top-{self.top_k} routing: the {num_dominant} dominant expert(s) of a token (ranks below "
                f"{num_dominant}: the leading pair's dominant, then the other experts by routing weight) run full "
                f"width, the other {self.top_k - num_dominant} routed experts take the tier's width.")
        return self._description_pair(cutoffs, warm, rule)

    def _description_pair(self, cutoffs: TierCutoffs, warm: int, rule: str) -> str:
        if rule == "routing-weight":
            return (
                f"CRISP plan from crisp-profile: combination = leading pair by routing weight; tiers by share of "
                f"activations (hot_mass={cutoffs.hot_mass}, cold_mass={cutoffs.cold_mass}); widths of the "
                f"non-dominant expert hot={self.inter}, warm={warm}, cold=0 of {self.inter}; dominance rule "
                f"'routing-weight': the heavier expert of each token is dominant (no per-pair labels); unseen "
                f"pairs are Warm."
            )
        return (
            f"CRISP plan from crisp-profile: combination = leading pair by routing weight; tiers by share of "
            f"activations (hot_mass={cutoffs.hot_mass}, cold_mass={cutoffs.cold_mass}); widths of the "
            f"non-dominant expert hot={self.inter}, warm={warm}, cold=0 of {self.inter}; dominance measured by "
            f"masking each member (loss increase per masked token) for pairs seen on >= "
            f"{self.cfg.dominance_min_tokens} tokens of the dominance windows, rarer pairs fall back to the "
            f"routing-weight proxy (larger mean routing weight within the pair); unseen pairs are Warm with the "
            f"heavier expert dominant."
        )

    def _choose_rule(self, stats: Stats, packed, rules) -> tuple[CrispPlan, str, dict]:
        """--dominance auto without a search: the rule whose plan has the lower held-out calibration loss."""
        weights = {lid: _stored_weights(layer) for lid, layer in packed.items()}
        losses, plans = {}, {}
        for rule in rules:
            plans[rule] = self._plan(stats, rule)[0]
            with MaskedExperts(self.model, self.layers, weights=weights, widths_fn=plans[rule].token_widths):
                losses[rule] = score_windows(self.model, self.search_windows, self.cfg.batch_size).loss
        best = min(rules, key=lambda r: losses[r])
        self.log("dominance: " + ", ".join(f"{r} loss {v:.4f}" for r, v in losses.items()) + f"; chose {best}")
        return plans[best], best, {"held_out_calibration_loss": losses}

    # -- the optional search, on held-out calibration windows
    def _search(self, stats: Stats, plan: CrispPlan, packed, rules) -> tuple[CrispPlan, dict]:
        cfg = self.cfg
        target = cfg.search_target_bytes
        weights = {lid: _stored_weights(layer) for lid, layer in packed.items()}
        with MaskedExperts(self.model, self.layers, weights=weights, record=True) as inst:
            full_scores = score_windows(self.model, self.search_windows, cfg.batch_size)
            routing = {lid: (torch.cat(inst.trace.index[lid]), torch.cat(inst.trace.weights[lid]))
                       for lid in self.layer_ids}
        candidates = []
        dominant_counts = ([cfg.num_dominant] if cfg.num_dominant is not None
                           else [d for d in range(1, self.top_k) if d / self.top_k <= target + 1e-9])
        for dominants in dominant_counts:
            with_d = CrispPlan.crisp(self.num_experts, self.top_k, self.inter, plan.layers, plan.tier_widths,
                                     unseen_tier=plan.unseen_tier, num_dominant=dominants)
            # two or more dominants: both leading-pair members full width, a per-pair label changes nothing
            rules_d = rules if dominants == 1 else ["routing-weight"]
            for hot in SEARCH_HOT:
                for cold in SEARCH_COLD:
                    if hot + cold > 1.0:
                        continue
                    cut = TierCutoffs(hot, cold)
                    base_plan = with_d.with_tiers(TierWidths(self.inter, 0, 0),
                                                  self._layer_plans(stats, cut, rules_d[0]))
                    lo = bytes_fraction(base_plan, routing)
                    if lo > target + 1e-9:
                        continue
                    one = bytes_fraction(base_plan.with_tiers(TierWidths(self.inter, self.inter, 0)), routing)
                    slope = (one - lo) / self.inter  # bytes fraction per Warm neuron (linear in the width)
                    warm = self.inter if slope <= 0 else min(self.inter, int((target - lo) / slope + 1e-9))
                    # bytes depend on the tiers only (dominant experts run full whichever they are)
                    candidates.extend((hot, cold, warm, cut, rule, with_d) for rule in rules_d)
        self.log(f"search: {len(candidates)} candidates within {target:.0%} of full-width bytes")
        results = []
        best = None
        for hot, cold, warm, cut, rule, with_d in candidates:
            cand = with_d.with_tiers(TierWidths(self.inter, warm, 0), self._layer_plans(stats, cut, rule))
            with MaskedExperts(self.model, self.layers, weights=weights, widths_fn=cand.token_widths):
                sc = score_windows(self.model, self.search_windows, cfg.batch_size)
            rec = {"hot_mass": hot, "cold_mass": cold, "warm_width": warm, "dominance": rule,
                   "bytes_fraction": bytes_fraction(cand, routing), "loss": sc.loss, "accuracy": sc.accuracy}
            if self.top_k > 2:
                rec["num_dominant"] = cand.num_dominant
            results.append(rec)
            if best is None or rec["loss"] < best[0]["loss"]:
                best = (rec, cand, cut, warm, rule)
        if best is None:
            raise CliError(f"--search-target-bytes {target}: no tier setting reaches it (dominant experts alone "
                           f"need more); raise the target")
        rec, cand, cut, warm, rule = best
        self.log(f"search: chose hot_mass={rec['hot_mass']} cold_mass={rec['cold_mass']} warm_width={warm} "
                 f"dominance={rule} num_dominant={cand.num_dominant} "
                 f"(bytes {rec['bytes_fraction']:.1%}, loss {rec['loss']:.4f} vs full {full_scores.loss:.4f})")
        chosen = CrispPlan.crisp(
            self.num_experts, self.top_k, self.inter, cand.layers, cand.tier_widths, unseen_tier=cand.unseen_tier,
            num_dominant=cand.num_dominant,
            description=self._description(cut, warm, rule, cand.num_dominant)
            + f" Tier cut-offs and Warm width chosen by a search for "
            f"<= {target:.0%} of full-width bytes per token on held-out calibration windows (lowest loss).",
        )
        info = {"target_bytes_fraction": target, "chosen": rec, "full_width": {"loss": full_scores.loss,
                "accuracy": full_scores.accuracy}, "candidates": results}
        return chosen, info

    # -- pack and write
    def _pack(self, order: dict[int, torch.Tensor]):
        packed = {}
        for ref in self.layers:
            packed[ref.layer_id] = pack_layer(
                ref.module.gate_up_proj.detach().float().cpu(), ref.module.down_proj.detach().float().cpu(),
                self.fmt, neuron_order=order[ref.layer_id],
            )
        return packed

    def _info(self, stats: Stats, plan: CrispPlan, plan_info: dict, search: dict | None) -> dict:
        cfg = self.cfg
        skew = {}
        for i, layer_id in enumerate(self.layer_ids):
            s = pair_skew(stats.pair_counts[i], 0.25, 0.29)
            skew[str(layer_id)] = {"top25_share": s.top_share, "bottom29_share": s.bottom_share,
                                   "seen_pairs": s.seen, "possible_pairs": s.possible}
        return {
            "tool": "crisp-profile",
            "profile_version": PROFILE_VERSION,
            "model": self.fingerprint,
            "model_path": str(cfg.model),
            "model_type": self.fingerprint["model_type"],
            "num_hidden_layers": getattr(self.model.config.get_text_config(), "num_hidden_layers", None),
            "top_k": self.top_k,
            "neuron_bytes": self.fmt.neuron_nbytes(self.hidden),
            "importance": ("sum over routed tokens of routing_weight * |silu(gate x) * (up x)| * ||down column||"
                           if cfg.importance == "weighted" else
                           "sum over routed tokens of |silu(gate x) * (up x)| * ||down column||"),
            "calibration": {"data": [str(p) for p in cfg.data], "samples": cfg.samples, "seq_len": cfg.seq_len,
                            "seed": cfg.seed, "holdout_fraction": cfg.holdout_fraction,
                            "dominance_samples": cfg.dominance_samples},
            "tier_cutoffs": {"hot_mass": self.cutoffs.hot_mass, "cold_mass": self.cutoffs.cold_mass},
            "skew": skew,
            "expert_tokens": stats.expert_tokens.tolist(),
            "search": search,
            "elapsed_s": round(time.time() - self.t0, 1),
            **plan_info,
        }

    def _write(self, packed, plan: CrispPlan, info: dict) -> None:
        """The pack into --out as one change (``crisp_runtime.pack.save_pack``: a staging folder beside it,
        swapped in; only the pack's own files are ever replaced)."""
        check_out_dir(self.out, self.fingerprint)  # again: something may have appeared meanwhile
        save_pack_dir(self.out, packed, plan, info)


def _stored_weights(layer):
    """Dequantized weights of a packed layer in STORED (importance) order, transformers layout."""
    from crisp_kernels.format import PackedLayer

    stored = PackedLayer(layer.fmt, layer.qweight, layer.scales, layer.zeros,
                         torch.arange(layer.intermediate_size).expand(layer.num_experts, -1).contiguous())
    return dequantize_layer(stored)


# ----------------------------------------------------------------------------- pack folder I/O


def save_pack_dir(directory: Path, packed, plan: CrispPlan, info: dict) -> None:
    """experts.safetensors + plan.json + pack.json (``crisp_runtime.pack.save_pack``)."""
    from crisp_runtime.pack import save_pack

    save_pack(directory, packed, plan=plan, info=info)


def load_pack_dir(directory: str | os.PathLike):
    """(layers {layer_id: PackedLayer}, plan or None, info dict) of a pack folder; CliError if unreadable.

    Every tensor's sha256 is checked against the digests recorded at save (crisp-eval and evidence run
    a model over text for minutes to hours; hashing even a Mixtral-8x7B pack costs seconds).
    """
    from crisp_kernels.io import PackCheck
    from crisp_runtime.pack import load_pack

    directory = Path(directory)
    if not directory.is_dir():
        raise CliError(f"--crisp {directory}: not a folder")
    try:
        pack = load_pack(directory, check=PackCheck.DIGESTS)
    except (FileNotFoundError, ValueError) as exc:
        raise CliError(f"--crisp {directory}: not a readable CRISP pack ({exc})") from exc
    return pack.layers, pack.plan, dict(pack.info or {})


# ----------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    p = ca.Parser(
        prog="crisp-profile",
        description="Profile an MoE model on calibration text and write a CRISP pack (experts reordered by "
        "importance, 4-bit, neuron-major) with its plan (Hot/Warm/Cold tiers; dominance measured by masking "
        "or per token by routing weight).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", required=True, type=ca.nonempty_path,
                   help="local transformers checkpoint folder (nothing is downloaded)")
    p.add_argument("--data", required=True, nargs="+", type=ca.nonempty_path,
                   help="calibration text: .txt, .jsonl/.jsonl.gz/.json.gz with a 'text' field, or a saved "
                        "`datasets` folder (byte-level tokens)")
    p.add_argument("--out", required=True, type=ca.nonempty_path,
                   help="output pack folder (written atomically; refused if it holds anything but a pack of this "
                        "model)")
    p.add_argument("--samples", type=ca.positive_int, default=2048,
                   help="calibration windows for the statistics (the paper: 2048)")
    p.add_argument("--seq-len", type=ca.int_in(2), default=256, help="tokens per window")
    p.add_argument("--batch-size", type=ca.positive_int, default=16,
                   help="windows per forward pass (and per checkpoint)")
    p.add_argument("--seed", type=ca.seed_int, default=0, help="seed of the window sampling")
    p.add_argument("--device", type=ca.device_name, default="cpu", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--dtype", default="auto", choices=tuple(DTYPES),
                   help="dtype the model is loaded in (auto: the checkpoint's); statistics are float32 either way")
    p.add_argument("--threads", type=ca.threads_int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--group-size", type=int, default=64, choices=(32, 64, 128), help="4-bit quantization group along H")
    p.add_argument("--symmetric", action="store_true", help="symmetric 4-bit (no zero points)")
    p.add_argument("--importance", default="weighted", choices=("weighted", "mean-abs"),
                   help="neuron score: sum of routing_weight*|act|*||down col|| (weighted) or without the weight")
    p.add_argument("--hot-mass", type=ca.float_in(0.0, 1.0), default=DEFAULT_HOT_MASS,
                   help="Hot = most frequent combinations carrying this share of activations")
    p.add_argument("--cold-mass", type=ca.float_in(0.0, 1.0), default=DEFAULT_COLD_MASS,
                   help="Cold = least frequent combinations carrying at most this share")
    p.add_argument("--warm-width", type=ca.float_in(0.0, 1.0), default=DEFAULT_WARM_WIDTH,
                   help="width of the auxiliary expert in Warm combinations, as a fraction of full width")
    p.add_argument("--holdout-fraction", type=ca.float_in(0.0, 1.0, low_open=True, high_open=True), default=0.1,
                   help="last share of the calibration text kept out of the statistics, for --search-target-bytes")
    p.add_argument("--dominance-samples", type=ca.positive_int, default=64,
                   help="calibration windows for measuring dominance")
    p.add_argument("--dominance-min-tokens", type=ca.positive_int, default=32,
                   help="pairs seen on fewer tokens (in the dominance windows) use the routing-weight proxy")
    p.add_argument("--dominance-max-windows", type=ca.positive_int, default=8,
                   help="windows per pair in each masking run")
    p.add_argument("--dominance", default="auto", choices=DOMINANCE_RULES,
                   help="dominant expert of a combination: a per-pair label measured by masking (measured), the "
                        "heavier expert of each token (routing-weight), or whichever has the lower loss on held-out "
                        "calibration windows (auto, default)")
    p.add_argument("--num-dominant", type=ca.positive_int, default=None, metavar="N",
                   help="routed experts per token at full width (1..top_k-1; default 1, or with "
                        "--search-target-bytes every N whose dominants alone fit the target is searched)")
    p.add_argument("--search-target-bytes", type=ca.float_in(0.0, 1.0, low_open=True), default=None, metavar="FRACTION",
                   help="search tier cut-offs and Warm width for <= FRACTION of full-width bytes per token "
                        "(lowest loss on held-out calibration windows); overrides --hot-mass/--cold-mass/--warm-width")
    p.add_argument("--search-samples", type=ca.positive_int, default=32,
                   help="held-out calibration windows for the search")
    p.add_argument("--work-dir", default=None, type=ca.nonempty_path,
                   help="checkpoint folder for resuming (default: .<out>.crisp-work next to --out); the run keeps "
                        "its files in a run-<key> folder inside it and deletes only those")
    p.add_argument("--keep-work", action="store_true", help="keep the run's checkpoint after success")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    return p


def config_from_args(args: argparse.Namespace) -> ProfileConfig:
    values = vars(args)
    return ProfileConfig(**{k: values[k] for k in ProfileConfig.__dataclass_fields__ if k in values})


def main(argv: list[str] | None = None, *, interrupt_after: int | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        info = Profiler(config_from_args(args)).run(interrupt_after=interrupt_after)
    except (CliError, OutputPathError) as exc:
        print(f"crisp-profile: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return ca.interrupted("crisp-profile", resumable=True)
    if not args.quiet:
        summary = {k: info[k] for k in ("dominance_measured_pairs", "dominance_proxy_agreement", "skew")}
        print(json.dumps(summary, indent=1))
    return 0


__all__ = ["ProfileConfig", "Profiler", "ProfileInterrupted", "main", "load_pack_dir", "save_pack_dir"]

if __name__ == "__main__":
    sys.exit(main())
