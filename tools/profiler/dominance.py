"""``crisp-profile``: which expert of a combination is dominant, measured.

On separate calibration windows, for every pair seen on at least ``--dominance-min-tokens`` tokens
of a layer, each member's contribution is set to zero for the tokens routed to that pair (in that
layer only) and the increase of the total next-token loss of the affected windows, per masked
token, is measured. The member whose masking hurts more is dominant. Rare pairs fall back to the
routing-weight proxy (the member with the larger mean routing weight within the pair); the
agreement between measurement and proxy is reported.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from crisp_runtime.planning.pairs import pair_codes

from ..calibration import MaskedExperts, score_windows
from .statistics import Stats

if TYPE_CHECKING:
    from .inputs import ProfileInputs


def measure_dominance(inputs: ProfileInputs, stats: Stats, log: Callable[[str], None]) -> None:
    """Fill ``stats.dominance[i, member, other]`` (loss increase per masked token) for the frequent pairs
    of the layers not yet done, saving the checkpoint after every layer."""
    cfg = inputs.cfg
    if stats.dominance_layers_done >= len(inputs.layers):
        return
    model, layers, dom_windows = inputs.model, inputs.layers, inputs.dom_windows
    E, S = inputs.num_experts, dom_windows.shape[1]
    experts = inputs.experts.forward_weights  # None: the modules' own
    with MaskedExperts(model, layers, weights=experts, record=True) as inst:
        base = score_windows(model, dom_windows, cfg.batch_size)
        codes = {}
        n = dom_windows.shape[0]
        for layer_id in inputs.layer_ids:
            index = torch.cat(inst.trace.index[layer_id]).long()
            weights = torch.cat(inst.trace.weights[layer_id])
            codes[layer_id] = pair_codes(index, weights, E).view(n, S)
    base_seq = base.nll.double().sum(1)  # (N,)
    for i, layer_id in enumerate(inputs.layer_ids):
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
            sub = dom_windows[rows]
            sub_mask = (code[rows] == v).reshape(-1)  # flattened like the experts' tokens
            masked_tokens = int(sub_mask.sum())
            for member, other in ((a, b), (b, a)):
                def widths_fn(lid, index, weights, member=member, sub_mask=sub_mask, layer_id=layer_id):
                    if lid != layer_id:
                        return None
                    w = torch.full_like(index, inputs.inter)
                    kill = sub_mask.to(index.device).unsqueeze(1) & (index == member)
                    return torch.where(kill, torch.zeros_like(w), w)

                with MaskedExperts(model, layers, weights=experts, widths_fn=widths_fn):
                    # one batch, so that the flattened tokens line up with sub_mask
                    masked = score_windows(model, sub, batch_size=sub.shape[0])
                damage = float((masked.nll.double().sum(1) - base_seq[rows]).sum()) / masked_tokens
                stats.dominance[i, member, other] = damage
        stats.dominance_layers_done = i + 1
        stats.save(inputs.work.checkpoint, inputs.run_key)
        log(f"dominance: layer {layer_id}: {len(frequent)} pairs measured ({time.time() - t_layer:.1f} s)")


def dominant(stats: Stats, i: int, a: int, b: int) -> tuple[int, int, bool]:
    """(measured-or-proxy dominant, proxy dominant, measured?) of pair (a, b) in layer slot i."""
    cnt = int(stats.pair_counts[i, a, b])
    proxy = a if stats.pair_weight[i, a, b] >= stats.pair_weight[i, b, a] or cnt == 0 else b
    da, db = float(stats.dominance[i, a, b]), float(stats.dominance[i, b, a])
    if math.isnan(da) or math.isnan(db):
        return proxy, proxy, False
    return (a if da >= db else b), proxy, True


def dominance_report(inputs: ProfileInputs, stats: Stats) -> dict:
    """pack.json's record of every seen pair (count, dominant, proxy, mean weights, masking damage) and how
    often the routing-weight proxy agrees with the measurement (per pair and per token)."""
    E = inputs.num_experts
    measured = agree = 0
    weighted_agree = weighted_total = 0
    per_layer = {}
    for i, layer_id in enumerate(inputs.layer_ids):
        rows = []
        for a in range(E):
            for b in range(a + 1, E):
                cnt = int(stats.pair_counts[i, a, b])
                if cnt == 0:
                    continue
                dom, proxy, was_measured = dominant(stats, i, a, b)
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
    return {
        "dominance_measured_pairs": measured,
        "dominance_proxy_agreement": agree / measured if measured else None,
        "dominance_proxy_agreement_token_weighted": weighted_agree / weighted_total if weighted_total else None,
        "combinations": per_layer,
    }
