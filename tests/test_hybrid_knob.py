"""apply(..., cpu="off"|"on"|"auto") on the tiny Mixtral: off runs the configuration as given, on runs the
hybrid path with outputs equal to the CPU reference, auto decides and says so in stats()."""

from __future__ import annotations

import pytest
import torch

from crisp_runtime import apply
from crisp_runtime.cpu.knob import AUTO_MIN_CPU_TO_H2D, CpuMode, decide_cpu, measure_cpu_bytes_per_s
from crisp_runtime.execution.runtime import RuntimeConfig
from crisp_runtime.scheduling.scheduler import CostModel, Placement

transformers = pytest.importorskip("transformers")


def tiny_model(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64)
    return transformers.MixtralForCausalLM(cfg).eval()


@pytest.mark.parametrize("cpu", ["off", "on", "auto"])
def test_knob_outputs_and_stats(cpu):
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    model = tiny_model()
    # The reference: the same packed experts, all resident (no budget, the device path).
    ref_handle = apply(model, cpu="off")
    with torch.no_grad():
        ref = model(ids).logits
    ref_handle.restore()
    budget = 2 * 32 * 64  # two full experts of 32 neurons x 64 bytes: a budget that offloads
    handle = apply(model, gpu_budget=budget * 2, cpu=cpu,
                   config=RuntimeConfig(cost=CostModel(cpu_bytes_per_s=1e9)) if cpu == "on" else None)
    with torch.no_grad():
        out = model(ids).logits
    stats = handle.stats()
    decision = stats["cpu"]
    assert decision["mode"] == cpu
    if cpu == "on":
        assert decision["placement"] == "hybrid" and handle.runtime.serving.placement is Placement.HYBRID
    elif cpu == "off":  # as configured
        assert decision["placement"] == "gpu" and handle.runtime.serving.placement is Placement.GPU
        assert stats["cpu_runs"] == 0
    if cpu == "auto":  # this machine has no GPU: every expert on the CPU kernel, as the explicit CPU-only call
        assert decision["placement"] == "cpu_only" and handle.runtime.serving.placement is Placement.CPU
        assert "no GPU found" in decision["reason"] and stats["cpu_runs"] > 0 and stats["bytes_h2d"] == 0
        handle.restore()
        explicit = apply(model, gpu_budget=budget * 2, serving="cpu_only", cpu="on")
        with torch.no_grad():
            want = model(ids).logits
        explicit.restore()
        assert torch.equal(out, want)
    else:  # the widths served are the plan's (full here) whatever the placement: the logits equal the reference's
        assert torch.allclose(out, ref, rtol=1e-4, atol=1e-5)
    handle.restore()
    assert not handle.runtime._cpu.started


def test_cpu_kernel_without_a_budget_reports_none_given():
    """No budget on a CPU model: every expert on the CPU kernel, which reads the host store a budgeted runtime
    keeps; that store's own minimum is not the user's budget and is reported apart from it."""
    model = tiny_model()
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(2))
    with apply(model) as handle, torch.no_grad():
        model(ids)
        stats = handle.stats()
        assert stats["cpu"]["placement"] == "cpu_only" and stats["cpu_runs"] > 0
        assert handle.gpu_budget is None and stats["cache"]["budget_bytes"] is None
        assert stats["cache"]["host_store_bytes"] == handle.runtime.cache.budget > 0
    with apply(model, gpu_budget=8192) as handle:  # a budget given is reported as given, and alone
        stats = handle.stats()
        assert handle.gpu_budget == stats["cache"]["budget_bytes"] == 8192 and "host_store_bytes" not in stats["cache"]


def test_on_needs_a_budget_and_bad_values():
    model = tiny_model()
    with pytest.raises(ValueError, match="needs a gpu_budget"):
        apply(model, cpu="on")
    with pytest.raises(ValueError, match="cpu: expected 'off', 'on' or 'auto'"):
        apply(model, gpu_budget=10**6, cpu=True)


def test_auto_rule_and_measurement(monkeypatch):
    from runtime_helpers import random_layers

    import crisp_runtime.cpu.knob as knob

    layers = random_layers(layer_ids=(0,), num_experts=2, inter=64, hidden=256)
    assert measure_cpu_bytes_per_s(layers[0]) > 0

    class FakeCuda:  # the rule as on a GPU; the H2D rate is then the cost model's, not measured
        type = "cuda"

    monkeypatch.setattr(knob, "_measure_h2d_bytes_per_s", lambda layer, device: 25e9)
    slow, fast = AUTO_MIN_CPU_TO_H2D * 0.5 * 25e9, AUTO_MIN_CPU_TO_H2D * 2 * 25e9
    for cpu_bps, expect in ((slow, Placement.GPU), (fast, Placement.HYBRID)):
        config = RuntimeConfig(cost=CostModel(h2d_bytes_per_s=25e9, cpu_bytes_per_s=cpu_bps))
        new, decision = decide_cpu("auto", config=config, budget=10**6, device=FakeCuda(), layers=layers)
        assert decision.placement is expect and new.serving.placement is expect
        assert decision.mode is CpuMode.AUTO and decision.cpu_bytes_per_s == cpu_bps
        if expect is Placement.HYBRID:  # the worker's handoff measured into the cost model (join_s was 0)
            assert 0 < new.cost.join_s < 0.1 and decision.join_s == new.cost.join_s
        assert new.cost.cpu_ridge_tokens == 4.0  # the configuration gave the CPU's figures: its ridge is kept
    # no CPU figures configured: bandwidth and ridge measured together (8 tokens against 1)
    bps, ridge = knob.measure_cpu(layers[0])
    assert bps > 0 and 1.0 <= ridge <= knob.RIDGE_PROBE_TOKENS
    for bad in (0, 1, 65, 2.5, True):
        with pytest.raises(ValueError, match="ridge_at"):
            knob.measure_cpu(layers[0], ridge_at=bad)
    with pytest.raises(ValueError, match="repeats"):
        knob.measure_cpu(layers[0], repeats=0)
    config = RuntimeConfig(cost=CostModel(h2d_bytes_per_s=25e9))
    new, decision = decide_cpu("on", config=config, budget=10**6, device=FakeCuda(), layers=layers)
    assert new.cost.has_cpu and 1.0 <= new.cost.cpu_ridge_tokens <= knob.RIDGE_PROBE_TOKENS
    assert decision.to_dict()["cpu_ridge_tokens"] == new.cost.cpu_ridge_tokens
    with pytest.raises(ValueError, match="cpu_ridge_tokens"):
        CostModel(cpu_ridge_tokens=0.5)
    # a fractional ridge: 10 tokens at a ridge of 2.5 take 4 times one token's streaming time
    assert CostModel(cpu_bytes_per_s=1e9, cpu_ridge_tokens=2.5).cpu_time(10**6, 10) == pytest.approx(4e-3)
    # a join_s the configuration sets is kept, not measured over
    config = RuntimeConfig(cost=CostModel(h2d_bytes_per_s=25e9, cpu_bytes_per_s=fast, join_s=7e-6))
    new, decision = decide_cpu("on", config=config, budget=10**6, device=FakeCuda(), layers=layers)
    assert new.cost.join_s == 7e-6 and decision.to_dict()["join_s"] == 7e-6


def test_the_cpu_model_rule_and_the_replay_mode():
    """auto serves on the CPU kernel exactly where the model is not on a GPU and no layer has 2-bit tail rows; a
    tool replaying a GPU's run turns it off only off the GPU."""
    from types import SimpleNamespace

    from crisp_runtime.cpu.knob import replay_cpu, serves_on_cpu

    plain, tailed = {0: SimpleNamespace(tail_start=None)}, {0: SimpleNamespace(tail_start=None),
                                                             1: SimpleNamespace(tail_start=16)}
    assert serves_on_cpu("auto", "cpu", plain) and serves_on_cpu("auto", torch.device("cpu"), plain)
    assert not serves_on_cpu("auto", "cpu", tailed)
    assert not serves_on_cpu("auto", torch.device("cuda", 0), plain)
    assert not serves_on_cpu("on", "cpu", plain) and not serves_on_cpu("off", "cpu", plain)
    assert replay_cpu("cpu") == "off" and replay_cpu(torch.device("cpu")) == "off"
    assert replay_cpu("cuda") is None and replay_cpu(torch.device("cuda", 1)) is None
