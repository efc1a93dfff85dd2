"""Routing traces: record them from a model, store them, and derive the policies' plans from them.

File format (``.npz``, read with ``allow_pickle=False``; no pickle anywhere):

    index    (L, T, k) int16    routed expert ids per MoE layer, token and slot (router order)
    weights  (L, T, k) float32  their routing weights
    layer_ids (L,) int64        decoder-layer index of each MoE layer (plan keys)
    seq_starts (S,) int64       first token of each recorded sequence
    predicted (L, T, n) int16   optional: experts of the *next* MoE layer predicted per layer and token
                                from this layer's MoE input (crisp_runtime.scheduling.prefetch; router's top-k
                                first, then by router logit; the last layer's row is -1). Files
                                without it load with ``predicted=None``.
    meta     0-d str            JSON: format "crisp-routing-trace", version, model, num_experts,
                                top_k, hidden_size, intermediate_size, source, ...

Recording runs the model teacher-forced over token sequences. In a causal model the
routing of position t depends only on tokens <= t, so this is exactly the routing that
decoding the same text token by token with a KV cache would produce.

"""

from __future__ import annotations

import contextlib
import json
import os
import zipfile
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from crisp_runtime.planning.baselines import equal_bytes_plans
from crisp_runtime.planning.pairs import counts_by_pair, leading_pairs, pair_counts
from crisp_runtime.planning.plan import CrispPlan, LayerPlan, TierCutoffs, TierWidths, assign_tiers, pair_key

from .common import CliError

TRACE_FORMAT = "crisp-routing-trace"
TRACE_VERSION = 1


class TraceError(CliError):
    """A trace file that is missing, malformed or does not fit."""


@dataclass
class Trace:
    index: np.ndarray  # (L, T, k) int
    weights: np.ndarray  # (L, T, k) float32
    layer_ids: list[int]
    meta: dict = field(default_factory=dict)
    seq_starts: list[int] = field(default_factory=lambda: [0])
    predicted: np.ndarray | None = None  # (L, T, n) int: next-layer experts predicted (see the module docstring)

    def __post_init__(self) -> None:
        pred = self.predicted
        if pred is not None and (pred.ndim != 3 or pred.shape[:2] != self.index.shape[:2]):
            raise TraceError(f"trace: predicted must be (L, T, n) with the index's L and T, "
                             f"got {self.predicted.shape} for index {self.index.shape}")
        self._check_fields()

    def _check_fields(self) -> None:
        """Types, shapes and ranges of every field (a TraceError naming it), so that a bad trace
        fails here and not deep inside the simulator or with a silently wrong replay."""
        for name, kinds in (("index", "iu"), ("weights", "f")):
            value = getattr(self, name)
            if not isinstance(value, np.ndarray) or value.dtype.kind not in kinds:
                what = f"{value.dtype}" if isinstance(value, np.ndarray) else type(value).__name__
                raise TraceError(f"trace: {name} must be a numpy array of {'integers' if kinds == 'iu' else 'floats'}, "
                                 f"got {what}")
        if self.index.ndim != 3 or self.index.shape != self.weights.shape:
            raise TraceError(f"trace: index and weights must have equal (L, T, k) shapes, "
                             f"got {self.index.shape} and {self.weights.shape}")
        if not np.isfinite(self.weights).all():
            raise TraceError("trace: weights hold NaN or infinite routing weights")
        if not isinstance(self.meta, dict):
            raise TraceError(f"trace metadata must be a JSON object, got {type(self.meta).__name__}")
        for key in ("num_experts", "top_k", "intermediate_size"):
            if key not in self.meta:
                raise TraceError(f"trace metadata lacks {key!r}")
            if type(self.meta[key]) is not int or self.meta[key] < 1:
                raise TraceError(f"trace metadata {key!r} must be a positive integer, got {self.meta[key]!r}")
        if self.index.shape[2] != self.meta["top_k"]:
            raise TraceError(f"trace: {self.index.shape[2]} routed slots per token, metadata top_k is "
                             f"{self.meta['top_k']}")
        hidden = self.meta.get("hidden_size")  # optional: --target native needs it (simulate_cmd)
        if hidden is not None and (type(hidden) is not int or hidden < 1):
            raise TraceError(f"trace metadata 'hidden_size' must be a positive integer, got {hidden!r}")
        if 0 in self.index.shape[:2]:
            raise TraceError(f"trace: holds no tokens or no layers (index shape {self.index.shape})")
        self._check_routing()
        _check_int_list(self.layer_ids, "layer_ids")
        if len(self.layer_ids) != self.index.shape[0]:
            raise TraceError(f"trace: {len(self.layer_ids)} layer ids for {self.index.shape[0]} layers")
        if len(set(self.layer_ids)) != len(self.layer_ids):
            raise TraceError(f"trace: layer_ids {list(self.layer_ids)} repeat a layer")
        _check_int_list(self.seq_starts, "seq_starts")
        last = max(self.num_tokens - 1, 0)
        if (not self.seq_starts or self.seq_starts[0] != 0 or self.seq_starts[-1] > last
                or any(b <= a for a, b in zip(self.seq_starts, self.seq_starts[1:], strict=False))):
            raise TraceError(f"trace: seq_starts must increase strictly from 0 and stay below the {self.num_tokens} "
                             f"tokens, got {list(self.seq_starts)[:8]}")

    def _check_routing(self) -> None:
        """What a router records: expert ids in [0, E), distinct within a token, with positive weights. The
        runtime's padding sentinels (ids outside [0, E), planning.baselines) never reach a recorded trace, and
        the simulator would replay one as a slot without an expert; only the predictions' -1 (no prediction:
        the last layer's rows, scheduling.prefetch) is a sentinel here."""
        e = self.num_experts
        if (self.weights <= 0).any():
            li, t, _ = np.argwhere(self.weights <= 0)[0]
            raise TraceError(f"trace: weights must be positive routing weights, got {self.weights[li, t].tolist()} "
                             f"at layer {li}, token {t}")
        bad = (self.index < 0) | (self.index >= e)
        if bad.any():
            li, t, _ = np.argwhere(bad)[0]
            raise TraceError(f"trace: index holds expert ids outside [0, {e}) (num_experts {e}), e.g. "
                             f"{self.index[li, t].tolist()} at layer {li}, token {t}")
        ordered = np.sort(self.index, axis=2)
        twice = (ordered[:, :, 1:] == ordered[:, :, :-1]).any(axis=2)
        if twice.any():
            li, t = np.argwhere(twice)[0]
            raise TraceError(f"trace: a token routes to the same expert twice: {self.index[li, t].tolist()} at "
                             f"layer {li}, token {t}")
        pred = self.predicted
        if pred is not None:
            bad = (pred < -1) | (pred >= e)
            if bad.any():
                li, t, _ = np.argwhere(bad)[0]
                raise TraceError(f"trace: predicted holds expert ids outside [0, {e}) other than -1 (no "
                                 f"prediction), e.g. {pred[li, t].tolist()} at layer {li}, token {t}")

    @property
    def num_layers(self) -> int:
        return self.index.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.index.shape[1]

    @property
    def num_experts(self) -> int:
        return int(self.meta["num_experts"])

    @property
    def top_k(self) -> int:
        return int(self.meta["top_k"])

    @property
    def intermediate_size(self) -> int:
        return int(self.meta["intermediate_size"])

    def head(self, num_tokens: int) -> Trace:
        """The first ``num_tokens`` tokens."""
        n = min(num_tokens, self.num_tokens)
        return Trace(self.index[:, :n], self.weights[:, :n], list(self.layer_ids), dict(self.meta),
                     [s for s in self.seq_starts if s < n] or [0],
                     None if self.predicted is None else self.predicted[:, :n])

    def save(self, path: str | os.PathLike) -> None:
        """Write the trace atomically (a reader of the old file, possibly memory-mapped, keeps it)."""
        from crisp_runtime.storage.outputs import write_atomic

        meta = {"format": TRACE_FORMAT, "version": TRACE_VERSION, **self.meta}
        optional = {} if self.predicted is None else {"predicted": self.predicted.astype(np.int16)}

        def write(tmp: str) -> None:
            with open(tmp, "wb") as f:
                np.savez_compressed(
                    f, index=self.index.astype(np.int16), weights=self.weights.astype(np.float32),
                    layer_ids=np.asarray(self.layer_ids, dtype=np.int64),
                    seq_starts=np.asarray(self.seq_starts, dtype=np.int64), meta=np.asarray(json.dumps(meta)),
                    **optional,
                )

        write_atomic(path, write)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Trace:
        path = Path(path)
        if not path.is_file():
            raise TraceError(f"{path}: no such trace file (record one with `crisp-bench simulate --record-trace`)")
        try:
            with np.load(path, allow_pickle=False) as z:
                meta = json.loads(str(z["meta"]))
                if not isinstance(meta, dict) or meta.get("format") != TRACE_FORMAT:
                    raise TraceError(f"{path}: not a routing trace (format "
                                     f"{meta.get('format') if isinstance(meta, dict) else meta!r})")
                if meta.get("version") != TRACE_VERSION:
                    raise TraceError(f"{path}: trace version {meta.get('version')!r} is not supported")
                predicted = z["predicted"].astype(np.int64) if "predicted" in z.files else None
                index, weights = z["index"], z["weights"]
                if index.dtype.kind not in "iu" or weights.dtype.kind != "f":
                    raise TraceError(f"{path}: index must hold integers and weights floats, got {index.dtype} and "
                                     f"{weights.dtype}")
                return cls(index.astype(np.int64), weights.astype(np.float32), _int_array(z, "layer_ids", path),
                           meta, _int_array(z, "seq_starts", path), predicted)
        except TraceError as exc:
            if str(exc).startswith(str(path)):
                raise
            raise TraceError(f"{path}: {exc}") from None
        except (OSError, ValueError, KeyError, EOFError, RecursionError, zipfile.BadZipFile, zlib.error) as exc:
            # BadZipFile / zlib.error / EOFError: a truncated, corrupt or empty .npz; RecursionError: meta JSON
            # nested too deep
            raise TraceError(f"{path}: not a readable trace ({type(exc).__name__}: {exc})") from exc


def _check_int_list(values, name: str) -> None:
    if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise TraceError(f"trace: {name} must be a list of integers, got {values!r}"[:200])


def _int_array(z, name: str, path: Path) -> list[int]:
    """A 1-D integer array of a trace file as a list (a float array is refused, not truncated)."""
    a = z[name]
    if a.ndim != 1 or a.dtype.kind not in "iu":
        raise TraceError(f"{path}: {name} must be a 1-D integer array, got {a.dtype} of shape {a.shape}")
    return [int(v) for v in a]


# ---------------------------------------------------------------------------- recording


@torch.no_grad()
def record_trace(model, sequences: torch.Tensor, *, source: str = "", progress=None,
                 predict_extra: int | None = 1) -> Trace:
    """Run ``model`` over each row of ``sequences`` (S, N) and record every MoE layer's routing.

    predict_extra: also record the next layer's experts predicted from each layer's MoE input
    (``crisp_runtime.scheduling.prefetch``), top_k + predict_extra per token (top_k alone where a block routes inside
    its own forward: no router logits to rank more by; the trace's ``prediction`` says how many); None records no
    prediction.
    """
    from crisp_runtime.hf.moe_layers import find_moe_layers, model_top_k, record_routing
    from crisp_runtime.scheduling.prefetch import NextLayerPredictor, record_predictions

    layers = find_moe_layers(model)
    ref = layers[0]
    device = next(model.parameters()).device
    top_k = model_top_k(model)
    predictor = None
    if predict_extra is not None:
        predictor = NextLayerPredictor(model, refs=layers)  # the routers' top-k
        if predict_extra and predictor.ranks_by_logit:
            predictor = NextLayerPredictor(model, experts=min(ref.num_experts, top_k + predict_extra), refs=layers)
    with contextlib.ExitStack() as stack:
        routing = stack.enter_context(record_routing(model, layers))
        predictions = stack.enter_context(record_predictions(model, predictor, layers)) if predictor else None
        for i, seq in enumerate(sequences):
            model(input_ids=seq.unsqueeze(0).to(device), use_cache=False)
            if progress is not None:
                progress(i + 1, len(sequences))
    index = np.stack([routing.layer(r.layer_id)[0].numpy() for r in layers])
    weights = np.stack([routing.layer(r.layer_id)[1].numpy() for r in layers])
    predicted = None
    if predictions is not None:
        predicted = np.stack([torch.cat(predictions[r.layer_id]).numpy() for r in layers])
    meta = {
        "model": getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__,
        "num_experts": ref.num_experts, "top_k": model_top_k(model), "hidden_size": ref.hidden_size,
        "intermediate_size": ref.intermediate_size, "source": source,
        "recording": "teacher-forced forward per sequence (= decode routing in a causal model)",
    }
    if predictor is not None:
        meta["prediction"] = {
            "experts_per_token": predictor.experts,
            "rule": "next MoE layer's router applied to this layer's MoE input (after its post-attention norm); "
                    "the router's top-k first, then by router logit; last layer -1 (crisp_runtime.scheduling.prefetch)",
        }
    n = sequences.shape[1]
    return Trace(index, weights, [r.layer_id for r in layers], meta, [i * n for i in range(len(sequences))],
                 predicted)


def synthetic_trace(num_layers=4, num_tokens=256, num_experts=8, top_k=2, intermediate_size=256, seed=0) -> Trace:
    """A skewed random trace (Zipf-like expert popularity per layer), for tests and demos."""
    rng = np.random.default_rng(seed)
    index = np.zeros((num_layers, num_tokens, top_k), dtype=np.int64)
    weights = np.zeros((num_layers, num_tokens, top_k), dtype=np.float32)
    for layer in range(num_layers):
        pop = 1.0 / np.arange(1, num_experts + 1) ** 1.2
        pop = pop[rng.permutation(num_experts)]
        pop /= pop.sum()
        for t in range(num_tokens):
            chosen = rng.choice(num_experts, size=top_k, replace=False, p=pop)
            w = np.sort(rng.dirichlet(np.ones(top_k)))[::-1]
            index[layer, t] = chosen
            weights[layer, t] = w
    meta = {"model": "synthetic", "num_experts": num_experts, "top_k": top_k, "hidden_size": 128,
            "intermediate_size": intermediate_size, "source": f"synthetic seed {seed}"}
    return Trace(index, weights, list(range(num_layers)), meta)


# ---------------------------------------------------------------------------- policies


def plan_from_trace(trace: Trace, cutoffs: TierCutoffs | None = None, warm_fraction: float = 0.5) -> CrispPlan:
    """A CRISP plan made from the trace's own counts (dominant = heavier routing weight).

    For tests and for models without a profiled plan; reports label it as such.
    """
    cutoffs = TierCutoffs() if cutoffs is None else cutoffs
    inter = trace.intermediate_size
    layers = {}
    for li, layer_id in enumerate(trace.layer_ids):
        index, weights = torch.from_numpy(trace.index[li]), torch.from_numpy(trace.weights[li])
        counts = counts_by_pair(pair_counts(index, weights, trace.num_experts))
        heavier: dict = {}
        first, second = leading_pairs(index, weights)
        for a, b in zip(first.tolist(), second.tolist(), strict=True):
            heavier.setdefault(pair_key(a, b), Counter())[a] += 1
        tiers = assign_tiers(counts, cutoffs)
        dominant = {k: heavier[k].most_common(1)[0][0] for k in tiers}
        layers[layer_id] = LayerPlan(tiers, dominant)
    return CrispPlan.crisp(trace.num_experts, trace.top_k, inter, layers,
                           TierWidths(inter, int(round(warm_fraction * inter)), 0),
                           description="derived from the trace itself (bench.traces.plan_from_trace)")


def token_widths(trace: Trace, plan: CrispPlan) -> np.ndarray:
    """(L, T, k) widths in source neurons for every traced token under ``plan``."""
    out = np.zeros_like(trace.index)
    for li, layer_id in enumerate(trace.layer_ids):
        out[li] = plan.token_widths(layer_id, torch.from_numpy(trace.index[li]),
                                    torch.from_numpy(trace.weights[li])).numpy()
    return out


def routing(trace: Trace) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The trace as ``crisp_runtime.planning.baselines.Routing``: {layer_id: ((T, k) index, (T, k) weights)}."""
    return {layer_id: (torch.from_numpy(trace.index[li]), torch.from_numpy(trace.weights[li]))
            for li, layer_id in enumerate(trace.layer_ids)}


def policy_plans(trace: Trace, crisp: CrispPlan | None, uniform_width: int | None = None,
                 skip_threshold: float | None | str = "match") -> dict[str, CrispPlan]:
    """The four policies over the trace's model: full, uniform, skip_aux, crisp.

    Defaults match crisp-eval (one implementation: ``crisp_runtime.planning.baselines.equal_bytes_plans``):
    uniform at the width giving CRISP's bytes per token on this trace, skip_aux keeping CRISP's
    ``num_dominant`` experts full and the rest above the routing-weight threshold giving CRISP's bytes.
    Without a CRISP plan: uniform at half width, skip_aux skipping every non-leading expert.
    """
    e, k, inter, ids = trace.num_experts, trace.top_k, trace.intermediate_size, trace.layer_ids
    if crisp is not None:
        crisp.check_compatible(num_experts=e, top_k=k, intermediate_size=inter, layer_ids=ids)
        matched = equal_bytes_plans(crisp, routing(trace))
        num_dominant = crisp.num_dominant
    else:
        matched = {"full": CrispPlan.full(e, k, inter, ids)}
        num_dominant = 1
    plans = {"full": matched["full"]}
    if uniform_width is None:
        uniform_width = matched["uniform"].uniform_width if crisp is not None else inter // 2
    plans["uniform"] = CrispPlan.uniform(e, k, inter, ids, uniform_width)
    if skip_threshold == "match":
        skip_threshold = matched["skip_aux"].skip_threshold if crisp is not None else None
    plans["skip_aux"] = CrispPlan.skip_aux(e, k, inter, ids, threshold=skip_threshold, num_dominant=num_dominant)
    if crisp is not None:
        plans["crisp"] = crisp
    return plans

