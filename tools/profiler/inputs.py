"""Everything ``crisp-profile`` checks before it writes anything: ``prepare`` validates the settings,
loads the model and the calibration text, draws the windows and keys the run's checkpoint folder.

Every bad input is a :class:`~crisp_tools.calibration.CliError` raised here (exit code 2), before
any output exists; the later steps (statistics, dominance, search, output) take a
:class:`ProfileInputs` and only compute.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from crisp_kernels.format import QuantFormat
from crisp_runtime.hf.moe_layers import MoeLayerRef, model_top_k
from crisp_runtime.planning.plan import TierCutoffs
from crisp_runtime.storage.outputs import OutputPathError, check_not_input_folder

from ..calibration import (
    CliError,
    check_seq_len,
    check_vocab,
    load_texts,
    log,
    model_fingerprint,
    random_windows,
    resolve_device,
    split_texts,
)
from ..placement import ExpertSource, PlacedModel, load_placed, loading_from_options
from ..workdir import WorkFolder
from .config import DOMINANCE_RULES, IMPORTANCE_KINDS, STATS_FILE, ProfileConfig
from .out_folder import check_out_dir, check_out_files
from .throughput import accuracy_windows_of, check_tier_widths


class ProgressLog:
    """``[crisp-profile   12.3s] message`` on stderr, timed from the run's start; silent with --quiet."""

    def __init__(self, quiet: bool):
        self.t0 = time.time()
        self.quiet = quiet

    def elapsed(self) -> float:
        return time.time() - self.t0

    def __call__(self, msg: str) -> None:
        log(f"[crisp-profile {self.elapsed():6.1f}s] {msg}", quiet=self.quiet)


@dataclass(frozen=True)
class ProfileInputs:
    """The checked settings, the loaded model and the calibration windows of one run."""

    cfg: ProfileConfig
    out: Path
    fmt: QuantFormat
    cutoffs: TierCutoffs
    device: torch.device
    model: torch.nn.Module
    layers: list[MoeLayerRef]
    top_k: int
    fingerprint: dict
    windows: torch.Tensor  # statistics windows (samples, seq_len)
    dom_windows: torch.Tensor  # dominance windows, drawn from the same (calibration) part
    search_windows: torch.Tensor | None  # held-out calibration windows (search, --dominance auto)
    # --plan-for-throughput's held-out calibration windows (decoded; the first --throughput-windows traced)
    throughput_windows: torch.Tensor | None
    run_key: str
    work: WorkFolder
    placed: PlacedModel  # the placement; its close() removes the offload folder (pipeline.Profiler.run)

    @property
    def experts(self) -> ExpertSource:
        """The full-precision experts wherever they are (module, checkpoint): packing, scores, forwards."""
        return self.placed.experts

    @property
    def layer_ids(self) -> list[int]:
        return [r.layer_id for r in self.layers]

    @property
    def num_experts(self) -> int:
        return self.layers[0].num_experts

    @property
    def inter(self) -> int:
        return self.layers[0].intermediate_size

    @property
    def hidden(self) -> int:
        return self.layers[0].hidden_size


def _sha256_bytes(*chunks: bytes) -> str:
    h = hashlib.sha256()
    for c in chunks:
        h.update(c)
    return h.hexdigest()


def _check_settings(cfg: ProfileConfig) -> tuple[TierCutoffs, QuantFormat]:
    """The checks that need neither the model nor the text."""
    if cfg.samples < 1:
        raise CliError(f"--samples must be positive, got {cfg.samples}")
    if cfg.batch_size < 1:
        raise CliError(f"--batch-size must be positive, got {cfg.batch_size}")
    if not 0.0 < cfg.holdout_fraction < 1.0:
        raise CliError(f"--holdout-fraction must lie in (0, 1), got {cfg.holdout_fraction}")
    if not 0.0 <= cfg.warm_width <= 1.0:
        raise CliError(f"--warm-width is a fraction of the full width in [0, 1], got {cfg.warm_width}")
    if cfg.search_target_bytes is not None and not 0.0 < cfg.search_target_bytes <= 1.0:
        raise CliError(f"--search-target-bytes is a fraction of full width in (0, 1], got {cfg.search_target_bytes}")
    cold = tuple(cfg.search_cold_widths)
    if not cold or any(isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f < 1.0 for f in cold):
        raise CliError(f"--search-cold-widths: fractions of full width in [0, 1), got {list(cold)}")
    if cold != (0.0,) and cfg.search_target_bytes is None:
        raise CliError("--search-cold-widths: only with --search-target-bytes (the widths are searched candidates)")
    if cfg.search_tier_widths and cfg.throughput_budget is None:
        raise CliError("--search-tier-widths: only with --plan-for-throughput (the widths are searched candidates)")
    if cfg.importance not in IMPORTANCE_KINDS:
        raise CliError(f"--importance must be 'weighted' or 'mean-abs', got {cfg.importance!r}")
    try:
        cutoffs = TierCutoffs(cfg.hot_mass, cfg.cold_mass)
    except ValueError as exc:
        raise CliError(f"--hot-mass {cfg.hot_mass} / --cold-mass {cfg.cold_mass}: {exc}") from exc
    try:
        fmt = QuantFormat(group_size=cfg.group_size, symmetric=cfg.symmetric)
    except ValueError as exc:
        raise CliError(f"--group-size {cfg.group_size}: {exc}") from exc
    return cutoffs, fmt


def _check_paths(cfg: ProfileConfig) -> tuple[Path, Path]:
    """(--out, the work root), absolute; neither may be, contain or lie inside --model / --data."""
    out = Path(cfg.out).absolute()
    inputs = {"--model": cfg.model, "--data": list(cfg.data)}
    try:
        check_not_input_folder("--out", out, inputs)
        work_root = Path(cfg.work_dir).absolute() if cfg.work_dir else out.parent / f".{out.name}.crisp-work"
        check_not_input_folder("--work-dir", work_root, {**inputs, "--out": str(out)})
    except OutputPathError as exc:
        raise CliError(str(exc)) from exc
    check_out_files(out)  # before the (possibly slow) model load; the model is checked below
    return out, work_root


def _check_model(cfg: ProfileConfig, model, layers: list[MoeLayerRef], fmt: QuantFormat) -> int:
    """The model's top-k, after checking that CRISP and the settings apply to it."""
    check_seq_len(model, cfg.seq_len)
    if cfg.throughput_budget is not None or cfg.gpu_budget is not None:  # the throughput search's windows
        check_seq_len(model, cfg.throughput_seq_len, "--throughput-seq-len")
    top_k = model_top_k(model)
    if top_k < 2:
        raise CliError(f"--model: routes top-{top_k}; CRISP's combinations need top-k >= 2")
    if cfg.num_dominant is not None and not 1 <= cfg.num_dominant < top_k:
        raise CliError(f"--num-dominant {cfg.num_dominant}: the model routes top-{top_k}, expected "
                       f"1..{top_k - 1} (top-k dominants would be full width everywhere)")
    try:
        fmt.check_hidden_size(layers[0].hidden_size)
    except ValueError as exc:
        raise CliError(f"--group-size {cfg.group_size}: {exc}") from exc
    return top_k


def prepare(cfg: ProfileConfig) -> ProfileInputs:
    """Check everything that can fail on bad input, in the order cheapest first; see the module docstring."""
    cutoffs, fmt = _check_settings(cfg)
    out, work_root = _check_paths(cfg)
    device = resolve_device(cfg.device)
    loading = loading_from_options(cfg.placement, cfg.device_map, cfg.max_memory, cfg.offload_folder)
    texts = load_texts(cfg.data)  # cheap checks on the text before the (possibly slow) model load
    placed = load_placed(cfg.model, device, cfg.dtype, loading, beside=out.parent,
                         protected={"--model": cfg.model, "--data": list(cfg.data), "--out": str(out),
                                    "--work-dir": str(work_root)})
    try:
        return _prepare_loaded(cfg, out, work_root, cutoffs, fmt, texts, placed)
    except BaseException:
        placed.close()  # the offload folder is the run's: gone with a refused run
        raise


def _prepare_loaded(cfg: ProfileConfig, out: Path, work_root: Path, cutoffs: TierCutoffs, fmt: QuantFormat,
                    texts: list[str], placed: PlacedModel) -> ProfileInputs:
    model, layers, device = placed.model, placed.layers, placed.input_device
    top_k = _check_model(cfg, model, layers, fmt)
    fingerprint = model_fingerprint(model, layers, placed.experts.weights_sha256())
    check_out_dir(out, fingerprint)

    stats_texts, holdout_texts = split_texts(texts, cfg.holdout_fraction)
    windows = random_windows(stats_texts, cfg.samples, cfg.seq_len, cfg.seed, "--data (calibration part)")
    dom_windows = random_windows(stats_texts, cfg.dominance_samples, cfg.seq_len, cfg.seed + 1,
                                 "--data (calibration part)")
    if cfg.dominance not in DOMINANCE_RULES:
        raise CliError(f"--dominance: expected one of {DOMINANCE_RULES}, got {cfg.dominance!r}")
    search_windows = None
    if cfg.search_target_bytes is not None or cfg.dominance == "auto":
        search_windows = random_windows(
            holdout_texts, cfg.search_samples, cfg.seq_len, cfg.seed + 2,
            f"--data (held-out calibration part, last {cfg.holdout_fraction:.0%})",
        )
    throughput_windows = None
    if cfg.search_tier_widths:
        try:
            check_tier_widths(cfg.search_tier_widths, layers[0].intermediate_size)
        except ValueError as exc:
            raise CliError(str(exc)) from None
    if cfg.throughput_budget is not None or cfg.gpu_budget is not None:
        count = cfg.accuracy_window_count
        throughput_windows = accuracy_windows_of(holdout_texts, count, cfg.throughput_seq_len, cfg.seed,
                                                 cfg.holdout_fraction)
    check_vocab(model, windows)

    # The checkpoint belongs to one model, data and set of settings that change the statistics.
    data_digest = _sha256_bytes(windows.numpy().tobytes(), dom_windows.numpy().tobytes())
    run_key = _sha256_bytes(
        json.dumps(fingerprint, sort_keys=True).encode(), data_digest.encode(),
        json.dumps([cfg.batch_size, cfg.dominance_min_tokens, cfg.dominance_max_windows]).encode(),
    )
    work = WorkFolder(work_root, run_key, STATS_FILE)
    work.check()
    return ProfileInputs(cfg=cfg, out=out, fmt=fmt, cutoffs=cutoffs, device=device, model=model, layers=layers,
                         top_k=top_k, fingerprint=fingerprint, windows=windows, dom_windows=dom_windows,
                         search_windows=search_windows, throughput_windows=throughput_windows, run_key=run_key,
                         work=work, placed=placed)
