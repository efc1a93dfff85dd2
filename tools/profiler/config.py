"""The settings of one ``crisp-profile`` run (``ProfileConfig``) and their defaults."""

from __future__ import annotations

from dataclasses import dataclass, field

from crisp_runtime.planning.pairs import CombinationKey

from ..calibration import EVAL_SEQ_LEN

# The calibration statistics checkpoint inside a run's work folder (resumed after an interruption).
STATS_FILE = "stats.safetensors"

# Defaults of the tier cut-offs and the Warm width. The paper does not state its values; these are
# set by arithmetic for the byte target, <= 55% of full-width expert bytes per token at top-2.
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

# Which expert of a combination is dominant: a fixed per-pair label measured by masking
# ("measured", the paper's rule), or the heavier expert of each token by routing weight
# ("routing-weight": the plan stores no label). "auto" keeps whichever has the lower loss on the
# held-out calibration windows. On the trained tiny Mixtral (models/tiny-mixtral) the fixed labels
# lost at every setting: all-Cold at 50% bytes, accuracy 0.565 (measured labels) vs 0.707
# (routing weight) on calibration windows (docs/profile-and-eval.md), so per-token information
# beats a per-pair label there.
DOMINANCE_RULES = ("auto", "routing-weight", "measured")
# What the tiers are keyed on (crisp_runtime.planning.pairs.CombinationKey): "auto" searches both keys at top-k > 2
# with --search-target-bytes (tiers per key) and --plan-for-throughput (the plan's tiers over the other key too);
# the leading pair elsewhere (at top-2 it is the whole combination).
COMBINATION_KEYS = ("auto", "leading-pair", "leading-expert")
_KEY_OPTIONS = {"leading-pair": CombinationKey.LEADING_PAIR, "leading-expert": CombinationKey.LEADING_EXPERT}
IMPORTANCE_KINDS = ("weighted", "mean-abs")
# --throughput-accuracy-windows' default floor: 128 x 128 decoded windows hold a standard error of ~0.2-0.3 point
# of relative loss near 2% (a search at 25%), 16 x 128 held ~1.4
DEFAULT_ACCURACY_WINDOWS = 128


def accuracy_window_count(traced: int, given: int | None) -> int:
    """The throughput search's scored windows: --throughput-accuracy-windows, else max(128, traced); ValueError
    when fewer than the traced windows (they are scored too)."""
    if given is not None and given < traced:
        raise ValueError(f"--throughput-accuracy-windows ({given}) must be at least --throughput-windows "
                         f"({traced}): the traced windows are scored too")
    return given or max(DEFAULT_ACCURACY_WINDOWS, traced)


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
    num_dominant: int | None = None  # None: 1, or searched with search_target_bytes (search.py)
    combination_key: str = "auto"  # COMBINATION_KEYS
    search_target_bytes: float | None = None
    search_samples: int = 32
    # Widths (fractions of I) the search tries for the auxiliary of a Cold pair: (0.0,) is the paper's rule
    # (Cold = the dominant only). On the tiny Mixtral a Cold auxiliary at 16/256 neurons took the loss of the
    # plan's widths from 1.32% to 0.92% for 1.5 points more bytes (docs/serving-and-residency.md).
    search_cold_widths: tuple[float, ...] = (0.0,)
    # --plan-for-throughput (throughput.py): the serving choice for tokens/s at this GPU budget (a fraction
    # of the expert bytes) on a hardware profile, within a relative accuracy loss, stored in pack.json
    throughput_budget: float | None = None
    # --gpu-budget (throughput.search_budgets): one stored choice per budget (fractions, bytes, or "standard"),
    # from the short search of the default families; --heldout-data: each choice's loss decoded on held-out text
    gpu_budget: tuple | None = None
    heldout_data: tuple | None = None
    heldout_windows: int = 32
    budget_search: str = "short"  # throughput.BUDGET_SEARCHES: the default families, or the plan's widths alone
    max_accuracy_loss: float = 0.02
    hardware_profile: str = "rtx4090-pcie4"
    throughput_windows: int = 16  # held-out calibration windows traced (the speed), and the decode's look size
    # windows decoded per accepted candidate (None: max(128, throughput_windows)); 16 x 128 held a standard
    # error of ~1.4 points near 2% loss (tools/loss_estimate.py), 128 x 128 about a third of that
    throughput_accuracy_windows: int | None = None
    # their length: crisp-eval's, so the search bounds the loss crisp-eval reports (why: calibration.EVAL_SEQ_LEN).
    # A decode is one forward per token, so a look at 256 tokens costs twice one at 128.
    throughput_seq_len: int = EVAL_SEQ_LEN
    accuracy_confidence: float = 0.95  # one-sided confidence that the loss is within max_accuracy_loss
    simulation_workers: int = 1  # processes simulating the candidates (the CLI's default: throughput.default_workers)
    # other Hot / Warm / Cold widths (neurons, crisp_runtime.planning.plan.TierWidths) the throughput search also tries
    search_tier_widths: tuple = ()
    work_dir: str | None = None
    keep_work: bool = False
    threads: int | None = None
    quiet: bool = False
    # where the model is measured (crisp_tools.placement): resident / stream, or accelerate's device_map
    placement: str = "resident"
    device_map: str | None = None  # "auto" | "balanced" | ... | a JSON object {module: device}
    max_memory: str | None = None  # a JSON object {device: size}, with device_map
    offload_folder: str | None = None  # created for the run and removed after it; default beside --out
    extra: dict = field(default_factory=dict)

    @property
    def accuracy_window_count(self) -> int:
        """--plan-for-throughput's scored windows (:func:`accuracy_window_count`)."""
        return accuracy_window_count(self.throughput_windows, self.throughput_accuracy_windows)

    def candidate_keys(self, top_k: int) -> list[CombinationKey]:
        """The combination keys this run's plans may take (see COMBINATION_KEYS), the leading pair first."""
        if self.combination_key == "auto":
            wide = top_k > 2 and (self.search_target_bytes is not None or self.throughput_budget is not None)
            return [CombinationKey.LEADING_PAIR] + ([CombinationKey.LEADING_EXPERT] if wide else [])
        return [_KEY_OPTIONS[self.combination_key]]

    def candidate_rules(self, key: CombinationKey = CombinationKey.LEADING_PAIR) -> list[str]:
        """The dominance rules this run compares under ``key`` ("auto": the measured labels first, then routing
        weight; a leading-expert combination has one expert, the heaviest: the routing-weight rule only)."""
        if key is CombinationKey.LEADING_EXPERT:
            return ["routing-weight"]
        return ["measured", "routing-weight"] if self.dominance == "auto" else [self.dominance]
