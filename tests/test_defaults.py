"""What apply / load_model / the per-expert blocks run with only a GPU budget (crisp_runtime.planning.defaults):
the pack's stored choice for the budget (pack.json serving version 2, version 1 still read), the rule for budgets
in between, the default rule from the pack's statistics, explicit arguments and serving="paper", cpu="auto" on a
CPU-only machine, and the simulator's crisp-default making the decisions apply's default makes."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from crisp_bench.profiles import HardwareProfile, get_profile
from crisp_bench.shapes import ModelShape
from crisp_bench.sim_policies import DEFAULT_POLICY, default_configuration
from crisp_bench.simulate import simulate_decode
from crisp_bench.traces import plan_from_trace, synthetic_trace
from runtime_helpers import TracePredictor, decode_trace, random_layers

from crisp_kernels import PackFormatError
from crisp_runtime import RuntimeConfig, apply
from crisp_runtime.cpu.knob import CpuMode
from crisp_runtime.execution.runtime import CrispRuntime
from crisp_runtime.hf.dropin import serving_choice_for
from crisp_runtime.planning.defaults import (
    HYBRID_DOMINANT_FLOOR,
    ChoiceSource,
    PackFacts,
    choose_serving,
    default_family,
    pack_facts,
)
from crisp_runtime.planning.plan import CrispPlan
from crisp_runtime.planning.serving import SERVING_POLICIES
from crisp_runtime.residency.ledger import ResidencyLedger
from crisp_runtime.scheduling.prefetch import Prefetcher, PrefetchPolicy, PrefetchWidth
from crisp_runtime.scheduling.scheduler import CostModel, Placement
from crisp_runtime.storage.pack import CrispPack, load_pack
from crisp_runtime.storage.serving_record import ServingChoices, ServingRecord, serving_choices, serving_record

REPO = Path(__file__).resolve().parents[1]
MIXTRAL, MIXTRAL_PACK = REPO / "models/tiny-mixtral", REPO / "models/tiny-mixtral-crisp"
CRISP_TOP2 = PackFacts("crisp", 2, 1)


def _record(fraction, serving="resident-floor75", prefetch=None, eviction="next_use", **search):
    return ServingRecord(SERVING_POLICIES[serving], prefetch, eviction, fraction,
                         {"profile": "rtx4090-pcie4", **search})


CHOICES = ServingChoices((_record(0.5, "resident"), _record(0.1, "plan", PrefetchPolicy(), "lru"),
                          _record(0.25, "resident-floor75", PrefetchPolicy(width="serving"))))


# ---------------------------------------------------------------------------- stored choices


def test_choices_round_trip_sorted_and_version_1_still_reads():
    data = CHOICES.to_dict()
    assert data["version"] == 2 and [c["gpu_budget_fraction"] for c in data["choices"]] == [0.1, 0.25, 0.5]
    back = serving_choices({"serving": json.loads(json.dumps(data))})
    assert back == CHOICES and back.fractions == (0.1, 0.25, 0.5)
    one = _record(0.25, prefetch=PrefetchPolicy(width="serving"))
    old = serving_choices({"serving": one.to_dict()})  # a version 1 field: one choice
    assert one.to_dict()["version"] == 1 and old.choices == (one,)
    assert serving_record({"serving": one.to_dict()}) == one
    with pytest.raises(PackFormatError, match="budgets 0.1, 0.25, 0.5: say which budget"):
        serving_record({"serving": data})
    assert serving_record({"serving": data}, budget_fraction=0.3) == CHOICES.choices[1]
    assert serving_choices({}) is None


def test_a_stored_prefetch_window_reads_back():
    from crisp_runtime.scheduling.copy_window import PrefetchWindow

    window = PrefetchWindow(row_nbytes=210, h2d_bytes_per_s=25e9, copy_latency_s=1e-5, compute_bytes_per_s=1e12,
                            compute_latency_s=1e-5, lead_s=1e-4, name="test", cpu_bytes_per_s=5e10)
    record = _record(0.25, "resident", PrefetchPolicy(extra_experts=1, window=window))
    data = json.loads(json.dumps(ServingChoices((record,)).to_dict()))
    back = serving_choices({"serving": data}).choices[0]
    assert back == record and back.prefetch.window == window


@pytest.mark.parametrize(("mutate", "match"), [
    (lambda d: d.update(version=3), "serving.version is 3"),
    (lambda d: d.update(extra=1), r"unknown keys \['extra'\]"),
    (lambda d: d.update(choices=[]), "non-empty list"),
    (lambda d: d["choices"][1].pop("eviction"), r"choices\[1\] has unknown keys \[\] / lacks \['eviction'\]"),
    (lambda d: d["choices"][0].update(gpu_budget_fraction=1.5), r"choices\[0\]: .*fraction in \(0, 1\]"),
    (lambda d: d["choices"][2].update(gpu_budget_fraction=0.1), "two choices for the budget 0.1"),
    (lambda d: d["choices"][0].update(eviction="fifo"), "eviction must be one of"),
    (lambda d: d["choices"][0]["policy"].update(dominant_floor=0.5),
     r"choices\[0\]: .*'plan' differs from the built-in"),
    (lambda d: d["choices"][0]["prefetch"].update(rule="oracle"), r"choices\[0\]: .*prefetch.rule is 'oracle'"),
    (lambda d: d["choices"][0]["prefetch"].update(window={"row_nbytes": 1}), r"choices\[0\]: .*PrefetchWindow"),
])
def test_stored_choices_are_parsed_strictly(mutate, match):
    data = CHOICES.to_dict()
    mutate(data)
    with pytest.raises(PackFormatError, match=match):
        serving_choices({"serving": data})


@pytest.mark.parametrize(("fraction", "stored"), [
    (0.1, 0.1), (0.1 - 1e-12, 0.1), (0.0999, None), (0.05, None), (0.2499, 0.1), (0.25, 0.25), (0.49, 0.25),
    (0.5, 0.5), (1.0, 0.5)])
def test_the_largest_stored_budget_at_or_below_applies(fraction, stored):
    got = CHOICES.for_fraction(fraction)
    assert (None if got is None else got.gpu_budget_fraction) == stored
    choice = choose_serving({"serving": CHOICES.to_dict()}, CRISP_TOP2, fraction)
    if stored is None:  # below every stored budget: the default rule, which says what the pack stores
        assert choice.source is ChoiceSource.DEFAULT_RULE and "stores choices for 10%, 25%, 50%" in choice.reason
    else:
        assert choice.source is ChoiceSource.STORED and choice.stored.gpu_budget_fraction == stored
        assert choice.config == got.runtime_config() and choice.cpu is CpuMode.AUTO
        # its hybrid form: the neuron split at the stored widths
        assert choice.hybrid.serving.placement is Placement.SPLIT
        assert choice.hybrid.serving.dominant_floor == got.policy.dominant_floor


def test_without_a_budget_only_a_choice_for_every_expert_applies():
    assert choose_serving({"serving": CHOICES.to_dict()}, CRISP_TOP2, None).source is ChoiceSource.DEFAULT_RULE
    whole = CHOICES.with_choice(_record(1.0, "resident"))
    choice = choose_serving({"serving": whole.to_dict()}, CRISP_TOP2, None)
    assert choice.source is ChoiceSource.STORED and choice.stored.gpu_budget_fraction == 1.0


# ---------------------------------------------------------------------------- the default rule, explicit, paper


@pytest.mark.parametrize(("facts", "roles"), [
    (PackFacts("crisp", 2, 1), True), (PackFacts("crisp", 2, 1, tail=True), True), (PackFacts("crisp", 6, 2), True),
    (PackFacts("full", 2, 2), False), (PackFacts("crisp", 1, 1), False), (PackFacts("uniform", 2, 1), False)])
def test_default_rule_from_the_pack_statistics(facts, roles):
    gpu, hybrid, why = default_family(facts)
    assert facts.has_roles is roles
    assert gpu.prefetch == PrefetchPolicy() and gpu.eviction == "next_use" and hybrid.prefetch == PrefetchPolicy()
    assert hybrid.eviction == "lru" and hybrid.serving.placement is Placement.SPLIT
    if roles:
        assert gpu.serving == SERVING_POLICIES["resident"]
        assert hybrid.serving.dominant_floor == HYBRID_DOMINANT_FLOOR
    else:
        assert gpu.serving == SERVING_POLICIES["plan"] and hybrid.serving == SERVING_POLICIES["hybrid_split"]
    assert ("2-bit tail" in why) is facts.tail
    choice = choose_serving({}, facts, 0.25)
    assert (choice.source, choice.config, choice.hybrid, choice.cpu) == (ChoiceSource.DEFAULT_RULE, gpu, hybrid,
                                                                        CpuMode.AUTO)
    resident = choose_serving({}, facts, None)  # every expert resident: the plan's widths, nothing to prefetch
    assert resident.config == RuntimeConfig() and resident.hybrid is None


def test_pack_facts_read_the_plan_and_tail():
    plan = CrispPlan.full(8, 2, 16, (0, 1))
    assert pack_facts({}, None, 2) == PackFacts("full", 2, 2)
    assert pack_facts({"tail_start": 12}, plan, 2) == PackFacts("full", 2, plan.num_dominant, tail=True)
    pack = load_pack(MIXTRAL_PACK)
    assert pack_facts(pack.info, pack.plan, 2).has_roles


def test_explicit_arguments_win_and_paper_is_the_papers_configuration():
    info = {"serving": CHOICES.to_dict()}
    named = choose_serving(info, CRISP_TOP2, 0.25, serving="resident-floor75")
    assert named.source is ChoiceSource.EXPLICIT and named.config == RuntimeConfig(serving="resident-floor75")
    assert named.cpu is CpuMode.OFF and named.hybrid is None
    cfg = RuntimeConfig(eviction="frequency", prefetch=PrefetchPolicy())
    given = choose_serving(info, CRISP_TOP2, 0.25, config=cfg, cpu="on")
    assert given.config == cfg and given.cpu is CpuMode.ON
    paper = choose_serving(info, CRISP_TOP2, 0.25, serving="paper")
    assert paper.source is ChoiceSource.PAPER and paper.config == RuntimeConfig() and paper.cpu is CpuMode.OFF
    assert paper.config.prefetch is None and paper.config.eviction == "lru" and paper.config.serving.name == "plan"
    with pytest.raises(ValueError, match="cpu: expected"):
        choose_serving(info, CRISP_TOP2, 0.25, cpu="sometimes")
    kept = choose_serving(info, CRISP_TOP2, 0.25, serving="paper", config=RuntimeConfig(dense="keep"))
    assert kept.config == RuntimeConfig(dense="keep")  # a config of other fields goes with the paper's
    same = choose_serving(info, CRISP_TOP2, 0.25, serving="resident", config=RuntimeConfig(serving="resident"))
    assert same.config == RuntimeConfig(serving="resident")
    with pytest.raises(ValueError, match="budget_fraction"):
        choose_serving(info, CRISP_TOP2, -0.25)


@pytest.mark.parametrize(("serving", "config", "match"), [
    ("paper", RuntimeConfig(eviction="next_use"), r"serving='paper' runs .* config sets eviction='next_use'"),
    ("paper", RuntimeConfig(prefetch=PrefetchPolicy()), "config sets prefetch=PrefetchPolicy"),
    ("paper", RuntimeConfig(serving="resident"), "config sets serving='resident'"),
    ("plan", RuntimeConfig(serving="resident-floor75"),
     "serving='plan' and config.serving='resident-floor75' disagree"),
])
def test_serving_and_a_config_that_contradict_each_other_are_refused(serving, config, match):
    with pytest.raises(ValueError, match=match):
        choose_serving({}, CRISP_TOP2, 0.25, serving=serving, config=config)


# ---------------------------------------------------------------------------- apply, load_model, blocks


@pytest.fixture(scope="module")
def mixtral():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(MIXTRAL).eval()


@pytest.fixture(scope="module")
def stored_pack(tmp_path_factory):
    """The committed tiny Mixtral pack with CHOICES stored (experts and plan unchanged)."""
    out = tmp_path_factory.mktemp("stored") / "pack"
    shutil.copytree(MIXTRAL_PACK, out)
    info = json.loads((out / "pack.json").read_text())
    info["serving"] = CHOICES.to_dict()
    (out / "pack.json").write_text(json.dumps(info))
    return out


def _budget(pack_dir, fraction):
    from crisp_runtime.storage.serving_record import budget_base_bytes

    return int(fraction * budget_base_bytes(load_pack(pack_dir).layers))


IDS = torch.randint(0, 200, (1, 12), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(("fraction", "expect"), [(0.3, "resident-floor75"), (0.6, "resident"), (0.12, "plan")])
def test_apply_runs_the_stored_choice_and_says_so(mixtral, stored_pack, fraction, expect, caplog):
    rec = CHOICES.for_fraction(fraction)
    # the stored choice as a GPU runs it (cpu="off": the device path on this CPU)
    with apply(mixtral, stored_pack, gpu_budget=_budget(stored_pack, fraction), cpu="off") as handle:
        with torch.no_grad():
            mixtral(IDS)
        stats = handle.stats()
        assert handle.runtime.config.serving == rec.policy and handle.runtime.config.prefetch == rec.prefetch
        assert stats["serving"]["source"] == "stored" and stats["serving"]["running"]["serving"] == expect
        assert stats["serving"]["stored_budget_fraction"] == rec.gpu_budget_fraction
    # the default (cpu="auto") on this machine without a GPU: the stored choice, then every expert on the CPU kernel
    with caplog.at_level("INFO", logger="crisp_runtime"):
        handle = apply(mixtral, stored_pack, gpu_budget=_budget(stored_pack, fraction))
    try:
        with torch.no_grad():
            mixtral(IDS)
        stats = handle.stats()
        assert stats["serving"]["source"] == "stored" and stats["serving"]["stored_budget_fraction"] == (
            rec.gpu_budget_fraction)
        assert stats["serving"]["running"] == {"serving": "cpu_only", "placement": "cpu_only", "prefetch": None,
                                               "eviction": stats["serving"]["running"]["eviction"]}
        assert stats["cpu"]["mode"] == "auto" and "no GPU found" in stats["cpu"]["reason"]
        assert stats["cpu"]["cpu_bytes_per_s"] > 0 and stats["cpu_runs"] > 0 and stats["bytes_h2d"] == 0
        line = [r.getMessage() for r in caplog.records if r.name == "crisp_runtime"]
        assert len(line) == 1 and "stored" in line[0] and "no GPU found" in line[0]
    finally:
        handle.restore()


def test_apply_paper_and_explicit_override_the_stored_choice(mixtral, stored_pack):
    budget = _budget(stored_pack, 0.3)
    with apply(mixtral, stored_pack, gpu_budget=budget, serving="paper") as handle:
        assert handle.runtime.config == RuntimeConfig() and handle.stats()["serving"]["source"] == "paper"
        assert handle.stats()["cpu"]["mode"] == "off"
    with apply(mixtral, stored_pack, gpu_budget=budget, serving="resident") as handle:
        assert handle.runtime.config == RuntimeConfig(serving="resident")
        assert handle.stats()["serving"]["source"] == "explicit"


def test_paper_outputs_equal_the_plans_widths_and_the_default_is_exact_where_it_serves_the_plan(mixtral):
    """serving='paper' at a budget gives the all-resident plan-width outputs (the paper's configuration is
    cache-independent); the default on a full-width pack (no roles: plan widths + prefetch + next-use) too."""
    pack = load_pack(MIXTRAL_PACK)
    with apply(mixtral, pack, cpu="off"), torch.no_grad():  # the device path (a GPU's) throughout, on this CPU
        ref = mixtral(IDS).logits
    budget = _budget(MIXTRAL_PACK, 0.25)
    with apply(mixtral, pack, gpu_budget=budget, serving="paper"), torch.no_grad():
        assert torch.equal(mixtral(IDS).logits, ref)
    full = CrispPack(pack.layers, CrispPlan.full(8, 2, 256, tuple(sorted(pack.layers))), pack.info)
    with apply(mixtral, full, cpu="off"), torch.no_grad():
        full_ref = mixtral(IDS).logits
    with apply(mixtral, full, gpu_budget=budget, cpu="off") as handle, torch.no_grad():
        assert handle.runtime.config.prefetch == PrefetchPolicy() and handle.runtime.config.serving.name == "plan"
        assert torch.equal(mixtral(IDS).logits, full_ref)


def test_load_model_runs_the_stored_choice(stored_pack):
    import crisp_runtime

    model, handle = crisp_runtime.load_model(MIXTRAL, stored_pack, gpu_budget=_budget(stored_pack, 0.25),
                                             cpu="off")  # the stored choice as a GPU runs it, on this CPU
    try:
        assert handle.stats()["serving"]["source"] == "stored"
        assert handle.runtime.config.serving == SERVING_POLICIES["resident-floor75"]
        with torch.no_grad():
            assert torch.isfinite(model(IDS).logits).all()
    finally:
        with pytest.warns(UserWarning, match="original expert weights were not kept"):  # load_model keeps none
            handle.restore()


def test_blocks_run_the_stored_choice(tmp_path):
    from test_blocks_per_expert import TOKENS, make_model

    from crisp_runtime.hf.blocks import find_moe_blocks, pack_blocks

    model = make_model("mixtral_v4")
    layers = pack_blocks(find_moe_blocks(model), None)
    plan = CrispPlan.full(4, 2, 32, tuple(sorted(layers)))
    choices = ServingChoices((ServingRecord(SERVING_POLICIES["resident"], PrefetchPolicy(), "next_use", 0.3),))
    pack = CrispPack(layers, plan, {"serving": choices.to_dict()})
    from crisp_runtime.storage.serving_record import budget_base_bytes

    budget = int(0.5 * budget_base_bytes(layers))
    with apply(model, pack, gpu_budget=budget, cpu="off") as handle, torch.no_grad():  # as a GPU runs it
        model(TOKENS)
        assert handle.stats()["serving"]["source"] == "stored"
        assert handle.runtime.config.serving == SERVING_POLICIES["resident"]
        assert handle.runtime.config.prefetch == PrefetchPolicy()
    with apply(model, CrispPack(layers, plan, {}), gpu_budget=budget) as handle:  # no stored choice: the rule
        assert handle.stats()["serving"]["source"] == "default rule"
        assert handle.runtime.config.eviction == "next_use"


@pytest.mark.parametrize(("share", "stored"), [("25%", 0.25), (" 10 % ", 0.1), ("50.0%", 0.5), ("100%", 0.5),
                                               ("9.99%", None)])
def test_a_share_budget_is_the_packs_expert_bytes_and_runs_the_choice_stored_for_it(mixtral, stored_pack, share,
                                                                                    stored):
    """gpu_budget="25%" is 25% of the pack's expert bytes (rounded up, so a choice stored for exactly that share
    applies), as crisp-profile --gpu-budget and the stored choices count it."""
    from crisp_runtime.storage.serving_record import budget_base_bytes

    base = budget_base_bytes(load_pack(stored_pack).layers)
    fraction = float(share.strip().rstrip("%")) / 100
    with apply(mixtral, stored_pack, gpu_budget=share, cpu="off") as handle:
        assert handle.gpu_budget == math.ceil(fraction * base) >= fraction * base
        serving = handle.stats()["serving"]
        assert serving["source"] == ("default rule" if stored is None else "stored")
        assert serving.get("stored_budget_fraction") == stored
        if stored is not None:
            assert handle.runtime.config.serving == CHOICES.for_fraction(stored).policy


@pytest.mark.parametrize(("share", "match"), [("0%", r"gpu_budget: '0%' is not a share in \(0%, 100%\]"),
                                              ("100.5%", "not a share"), ("-5%", "cannot read"),
                                              ("nan%", "cannot read"), ("25 %%", "cannot read"),
                                              ("1e1%", "cannot read")])
def test_a_share_out_of_range_or_unreadable_is_refused_before_the_model_changes(mixtral, stored_pack, share, match):
    before = {k: v.clone() for k, v in mixtral.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        apply(mixtral, stored_pack, gpu_budget=share)
    assert all(torch.equal(before[k], v) for k, v in mixtral.state_dict().items())
    import crisp_runtime

    with pytest.raises(ValueError, match=match):
        crisp_runtime.load_model(MIXTRAL, stored_pack, gpu_budget=share)


def test_load_model_and_blocks_take_a_share_budget(stored_pack):
    from test_blocks_per_expert import make_model

    import crisp_runtime
    from crisp_runtime.hf.blocks import find_moe_blocks, pack_blocks
    from crisp_runtime.storage.serving_record import budget_base_bytes

    model, handle = crisp_runtime.load_model(MIXTRAL, stored_pack, gpu_budget="25%", cpu="off")
    try:
        assert handle.gpu_budget == math.ceil(0.25 * budget_base_bytes(load_pack(stored_pack).layers))
        assert handle.stats()["serving"]["stored_budget_fraction"] == 0.25
        assert handle.runtime.config.serving == SERVING_POLICIES["resident-floor75"]
    finally:
        with pytest.warns(UserWarning, match="original expert weights were not kept"):
            handle.restore()
    blocks_model = make_model("mixtral_v4")
    layers = pack_blocks(find_moe_blocks(blocks_model), None)
    pack = CrispPack(layers, CrispPlan.full(4, 2, 32, tuple(sorted(layers))), {})
    with apply(blocks_model, pack, gpu_budget="60%", cpu="off") as handle:
        assert handle.gpu_budget == math.ceil(0.6 * budget_base_bytes(layers))


# ---------------------------------------------------------------------------- apply's default = simulator's


LAYERS, EXPERTS, INTER, HIDDEN = 3, 8, 16, 64



@pytest.mark.parametrize("stored", [None, "resident-floor75", "plan"])
def test_apply_default_and_the_simulators_crisp_default_make_the_same_decisions(monkeypatch, stored):
    """One trace through the configuration apply's default resolves to (hf.serving_choice_for) in the runtime,
    with its prefetcher, and through the simulator's crisp-default: identical ledger requests and prefetches."""
    log: list = []
    request, prefetch = ResidencyLedger.request, ResidencyLedger.prefetch

    def logged_request(self, layer_id, expert, width, **kw):
        d = request(self, layer_id, expert, width, **kw)
        log.append((d.key, d.kind, d.old_width, d.new_width, d.copy_bytes, d.evicted))
        return d

    def logged_prefetch(self, layer_id, expert, width, **kw):
        d = prefetch(self, layer_id, expert, width, **kw)
        log.append(("prefetch", layer_id, expert, width, None if d is None else (d.kind, d.copy_bytes, d.evicted)))
        return d

    monkeypatch.setattr(ResidencyLedger, "request", logged_request)
    monkeypatch.setattr(ResidencyLedger, "prefetch", logged_prefetch)
    trace = synthetic_trace(num_layers=LAYERS, num_tokens=20, num_experts=EXPERTS, intermediate_size=INTER, seed=5)
    predicted = np.full((LAYERS, trace.num_tokens, 2), -1, dtype=np.int64)
    predicted[:-1] = trace.index[1:]
    plan = plan_from_trace(trace)
    layers = random_layers(layer_ids=tuple(range(LAYERS)), num_experts=EXPERTS, inter=INTER, hidden=HIDDEN)
    from crisp_runtime.storage.serving_record import budget_base_bytes

    fraction = 0.3
    info = {} if stored is None else {"serving": ServingChoices((ServingRecord(
        SERVING_POLICIES[stored], PrefetchPolicy(width=PrefetchWidth.SERVING if stored != "plan" else "plan"),
        "next_use", 0.25),)).to_dict()}
    budget = int(fraction * budget_base_bytes(layers))
    profile = HardwareProfile("fast-copy", h2d_bytes_per_s=1e15, copy_latency_s=0.0, compute_bytes_per_s=1e6,
                              compute_latency_s=0.0, router_s=1e-5, other_s=2e-5)
    choice = serving_choice_for(CrispPack(layers, plan, info), plan, layers, 2, budget, serving=None, config=None,
                                cpu=None)
    assert choice.source is (ChoiceSource.DEFAULT_RULE if stored is None else ChoiceSource.STORED)
    cfg = choice.config  # a CPU-only machine and a profile without a CPU: GPU placement in both
    cost = CostModel(h2d_bytes_per_s=profile.h2d_bytes_per_s, device_bytes_per_s=profile.compute_bytes_per_s)
    runtime = CrispRuntime(layers, plan, device="cpu", gpu_budget=budget,
                           config=RuntimeConfig(serving=cfg.serving, eviction=cfg.eviction, cost=cost))
    token = [0]
    prefetcher = Prefetcher(TracePredictor(predicted, token, LAYERS), runtime, cfg.prefetch)
    decode_trace(runtime, trace, HIDDEN, prefetcher, token)
    by_runtime = list(log)
    log.clear()
    shape = ModelShape("toy", LAYERS, EXPERTS, 2, HIDDEN, INTER)
    sim_policy, sim_choice, uses_cpu = default_configuration(plan, info, 2, fraction, profile)
    assert sim_policy.name == DEFAULT_POLICY and not uses_cpu and sim_choice == choice
    assert (sim_policy.serving, sim_policy.eviction, sim_policy.prefetch) == (cfg.serving, cfg.eviction, True)
    simulate_decode(trace, sim_policy, profile, shape, budget, orders=["widest_first"], predicted=predicted)
    assert log == by_runtime
    assert any(d[0] == "prefetch" for d in by_runtime) and any(d[1] == "miss" for d in by_runtime)


def test_the_simulators_default_uses_the_cpu_where_the_profile_says_it_pays():
    trace = synthetic_trace(num_layers=LAYERS, num_tokens=8, num_experts=EXPERTS, intermediate_size=INTER, seed=1)
    plan = plan_from_trace(trace)
    gpu_only, _, cpu = default_configuration(plan, {}, 2, 0.25, get_profile("rtx4090-pcie4"))
    assert not cpu and gpu_only.serving == SERVING_POLICIES["resident"] and gpu_only.eviction == "next_use"
    hybrid, _, cpu = default_configuration(plan, {}, 2, 0.25, get_profile("rtx4090-pcie4-ddr5"))
    assert cpu and hybrid.serving.placement is Placement.SPLIT and hybrid.eviction == "lru" and hybrid.prefetch
    assert hybrid.serving.dominant_floor == HYBRID_DOMINANT_FLOOR


# ---------------------------------------------------------------------------- the CLIs


@pytest.mark.parametrize("bad", ["lots", "0%", "150%", "1.5", "-2GiB", "3 parsecs"])
def test_gpu_budget_nonsense_is_refused_naming_the_argument(bad, capsys):
    from crisp_tools.profiler.cli import build_parser

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--model", "m", "--data", "d", "--out", "o", "--gpu-budget", bad])
    assert exc.value.code == 2
    assert "--gpu-budget" in capsys.readouterr().err


def test_gpu_budget_values():
    from crisp_tools.profiler.throughput import STANDARD_BUDGETS, budget_fractions, gpu_budget_arg

    specs = [gpu_budget_arg(v) for v in ("25%", "0.5", "1000", "standard")]
    assert specs[:3] == [0.25, 0.5, 1000] and specs[3] == "standard"
    assert budget_fractions(specs, 4000) == sorted({0.25, 0.5, *STANDARD_BUDGETS})
    with pytest.raises(ValueError, match="--gpu-budget 8000 bytes holds every expert"):
        budget_fractions([8000], 4000)


def test_crisp_profile_refuses_gpu_budget_with_plan_for_throughput(tmp_path, capsys):
    from crisp_tools.profiler.cli import main

    rc = main(["--model", str(MIXTRAL), "--data", str(REPO / "data/stdlib-calib.txt"), "--out", str(tmp_path / "o"),
               "--gpu-budget", "25%", "--plan-for-throughput", "0.25"])
    assert rc == 2 and "--gpu-budget and --plan-for-throughput" in capsys.readouterr().err
    rc = main(["--model", str(MIXTRAL), "--data", str(REPO / "data/stdlib-calib.txt"), "--out", str(tmp_path / "o"),
               "--heldout-data", str(REPO / "data/stdlib-heldout.txt")])
    assert rc == 2 and "--heldout-data: only with --gpu-budget" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


# The committed packs' plans, as crisp-profile's byte-target search chose them: a CRISP tier plan on the tiny
# Mixtral, the skip-auxiliary baseline on the tiny DeepSeek (held-out calibration loss 1.2666 against 1.2697 for
# the best tier setting over both combination keys, pack.json "search").
@pytest.mark.parametrize(("name", "plan_kind", "serving"), [("tiny-mixtral-crisp", "crisp", "resident"),
                                                            ("tiny-deepseek-crisp", "skip_aux", "plan")])
def test_committed_packs_get_a_choice_and_say_where_it_came_from(name, plan_kind, serving):
    """The committed packs: a stored choice when they hold one, else the default rule's family for the plan: the
    residency-aware one for a CRISP plan (dominant and auxiliary slots), every slot at the plan's width otherwise."""
    pack = load_pack(REPO / "models" / name)
    assert pack.plan.policy.value == plan_kind
    choice = choose_serving(pack.info, pack_facts(pack.info, pack.plan, pack.info["top_k"]), 0.25)
    choices = serving_choices(pack.info)
    if choices is not None and choices.for_fraction(0.25) is not None:
        assert choice.source is ChoiceSource.STORED and choice.config == choices.for_fraction(0.25).runtime_config()
    else:
        assert choice.source is ChoiceSource.DEFAULT_RULE
        assert choice.config.serving == SERVING_POLICIES[serving] and choice.config.eviction == "next_use"
