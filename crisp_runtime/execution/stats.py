"""Counters of one applied model: what crossed host-to-device, what the cache saved, per layer.

Definitions (all JSON-friendly ints/floats):

- ``tokens``: real tokens that went through the layer (each MoE layer sees every token once):
  ``positions - padding``.
- ``positions``: every (batch row, position) the layer computed, padding included (the experts
  run on padding positions too: their outputs are discarded by the model, not skipped).
- ``padding``: positions that the ``attention_mask`` passed to the applied model's forward marks
  as padding (0). Without a 2-D mask (or when the experts are called directly) it stays 0 and
  ``tokens == positions``.
- ``steps``: calls of the layer (one per forward pass).
- ``bytes_h2d``: bytes copied host-to-device into the prefix cache (missing prefixes and
  widenings), exactly ``rows_copied * neuron_nbytes``.
- ``bytes_read``: what a cache-less offload would copy: per step, for each expert run, the
  bytes of its prefix at the width the step needs (the largest any of its tokens needs).
- ``bytes_routed``: per token, the bytes of the prefixes of every expert that token runs
  (``Σ_t Σ_e nbytes(width_t,e)``); equal to ``bytes_read`` when one token is decoded at a time.
- ``hits``: experts run without a copy (resident at the width needed or wider).
- ``misses``: experts not resident at all, copied in.
- ``widenings``: experts resident at a narrower prefix, widened by copying only the missing rows.
- ``evictions``: prefixes dropped from the cache to make room.
- ``expert_runs``: experts run (width > 0), ``skipped``: routed (token, expert) slots of width 0.
- ``copy_ms`` / ``step_ms``: optional timings (``RuntimeConfig(record_timings=True)``): ``step_ms``
  from CUDA events, ``copy_ms`` the copies of the synchronous path (device synchronised around each).
- Serving (``crisp_runtime.planning.serving``; zero under the default policy, which serves the plan's
  widths): ``fallbacks`` slots served narrower than the plan wanted, ``serving_skips`` slots the
  plan wanted but the policy skipped, ``served_wider`` slots served wider than wanted (free,
  from a wider resident prefix), ``served_widened`` dominant slots widened on demand
  (``DominantWiden.HIT``); ``served_{dominant,aux}_{slots,neurons}`` served slots and
  their summed widths per role (``served_width_mean`` in ``as_dict``); with a 2-bit tail pack every
  width here counts storage rows (``crisp_kernels.format.neurons_in_rows`` gives its neurons).
- Prefetch (``CrispRuntime.prefetch``): ``prefetches`` admitted, ``prefetch_bytes`` copied,
  ``prefetch_rejected`` (did not fit without evicting what the step needs), ``prefetch_hits``
  demands served without a copy by a prefetch not used before; with ``PrefetchPolicy.window``,
  ``prefetch_cut`` requests copied short or not at all because the modeled copy engine ran out of time
  before the next layer's demand, ``prefetch_cut_rows`` their rows not copied.
- Hybrid placement (``ServingPolicy.placement``): ``cpu_runs`` experts computed on the
  host CPU from host memory (not copied, not counted in hits / misses / ``expert_runs``),
  ``cpu_bytes_read`` the bytes of the prefixes they read; ``transients``: GPU tasks of the neuron split
  whose missing rows were copied into its per-step transient buffer (``ServingPolicy.transient_buffer``),
  not admitted (a lookup for ``hit_rate``, like a miss), ``transient_bytes`` their bytes (in ``bytes_h2d``).

The per-token figures (``bytes_h2d_per_token``, ``bytes_read_per_token``) divide by real tokens.
``LayerStats.tokens`` is what the executor counts, every position; ``as_dict`` reports it as
``positions`` and subtracts ``LayerStats.padding`` (set by the transformers drop-in) for ``tokens``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass
class LayerStats:
    tokens: int = 0  # positions computed, padding included (reported as "positions")
    padding: int = 0  # of those, positions the attention mask marks as padding
    steps: int = 0
    bytes_h2d: int = 0
    bytes_read: int = 0
    bytes_routed: int = 0
    hits: int = 0
    misses: int = 0
    widenings: int = 0
    evictions: int = 0
    expert_runs: int = 0
    skipped: int = 0
    copy_ms: float = 0.0
    step_ms: float = 0.0
    fallbacks: int = 0
    serving_skips: int = 0
    served_wider: int = 0
    served_widened: int = 0
    served_dominant_slots: int = 0
    served_dominant_neurons: int = 0
    served_aux_slots: int = 0
    served_aux_neurons: int = 0
    prefetches: int = 0
    prefetch_bytes: int = 0
    prefetch_rejected: int = 0
    prefetch_hits: int = 0
    prefetch_cut: int = 0
    prefetch_cut_rows: int = 0
    cpu_runs: int = 0  # experts computed on the host CPU (hybrid placement): not copied, not in hits/misses
    cpu_bytes_read: int = 0  # host bytes of the prefixes they read
    cpu_splits: int = 0  # of cpu_runs, the rows [split_at, width) of an expert split with the GPU (hybrid_split)
    transients: int = 0  # GPU tasks whose missing rows went to the split's transient buffer (not in hits / misses)
    transient_bytes: int = 0  # their bytes (also in bytes_h2d)

    def add(self, other: LayerStats) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


_SUMMED = ("bytes_h2d", "bytes_read", "bytes_routed", "hits", "misses", "widenings", "evictions", "expert_runs",
           "skipped", "copy_ms", "step_ms", "fallbacks", "serving_skips", "served_wider", "served_widened",
           "served_dominant_slots",
           "served_dominant_neurons", "served_aux_slots", "served_aux_neurons", "prefetches", "prefetch_bytes",
           "prefetch_rejected", "prefetch_hits", "prefetch_cut", "prefetch_cut_rows", "cpu_runs", "cpu_bytes_read",
           "cpu_splits", "transients", "transient_bytes")


class RuntimeStats:
    """Per-layer :class:`LayerStats` plus totals; ``as_dict()`` is what ``CrispHandle.stats()`` returns."""

    def __init__(self, layer_ids) -> None:
        self.layer_ids = tuple(layer_ids)
        self.layers: dict[int, LayerStats] = {i: LayerStats() for i in self.layer_ids}

    def reset(self) -> None:
        for i in self.layer_ids:
            self.layers[i] = LayerStats()

    def as_dict(self) -> dict:
        per_layer = {str(i): _layer_dict(s) for i, s in self.layers.items()}
        totals = {name: sum(getattr(s, name) for s in self.layers.values()) for name in _SUMMED}
        # Every MoE layer sees every token, so the model's count is the largest per-layer count.
        positions = max((s.tokens for s in self.layers.values()), default=0)
        tokens = max((s.tokens - s.padding for s in self.layers.values()), default=0)
        lookups = totals["hits"] + totals["misses"] + totals["widenings"] + totals["transients"]
        return {
            "tokens": tokens,
            "positions": positions,
            "padding": positions - tokens,
            **totals,
            "bytes_h2d_per_token": totals["bytes_h2d"] / tokens if tokens else 0.0,
            "bytes_read_per_token": totals["bytes_read"] / tokens if tokens else 0.0,
            "hit_rate": totals["hits"] / lookups if lookups else 0.0,
            "served_width_mean": {
                role: totals[f"served_{role}_neurons"] / totals[f"served_{role}_slots"]
                if totals[f"served_{role}_slots"] else None for role in ("dominant", "aux")},
            "layers": per_layer,
        }


def _layer_dict(s: LayerStats) -> dict:
    out = asdict(s)
    out["positions"] = out.pop("tokens")
    return {"tokens": s.tokens - s.padding, **out}
