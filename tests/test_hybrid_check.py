"""bench/hybrid_check.py on this CPU (its GPU checks cannot run here: no GPU).

What can be checked without a GPU: the layer-step check runs end to end on the CPU (there the "GPU" is
the CPU too, so its ratio means nothing) and its prediction is the simulator's; the copy check and the
CLI refuse cleanly without CUDA.
"""

from __future__ import annotations

import pytest
import torch
from crisp_bench import hybrid_check
from crisp_bench.profiles import HardwareProfile

from crisp_runtime import CrispPlan, RuntimeConfig
from crisp_runtime.execution.runtime import CrispRuntime
from crisp_runtime.scheduling.scheduler import flow_shop_makespan, johnson_order


def test_step_check_runs_on_the_cpu():
    records = hybrid_check.hybrid_step_check(device="cpu", h2d_bytes_per_s=2e9, h2d_bytes_per_s_cpu_busy=1.2e9,
                                             hidden=128, intermediate=128, num_experts=4, repeats=1)
    assert [(r["placement"], r["case"]) for r in records] == [
        ("hybrid", "cold"), ("hybrid", "one_resident"), ("hybrid_split", "cold"), ("hybrid_split", "one_resident")]
    for r in records:
        assert r["measured_ms"] > 0 and r["predicted_ms"] > 0
        assert r["cpu_experts"] + r["split_experts"] <= 2 and r["cpu"]["precision"] == "q8"


@pytest.mark.parametrize("resident", [0, 1])
def test_prediction_is_the_simulators_flow_shop_for_a_gpu_step(resident):
    """All experts on the GPU: the simulator's step is Johnson's flow shop of the copies the runtime made."""
    from runtime_helpers import random_layers

    layers = random_layers(layer_ids=(0,), num_experts=4, inter=64, hidden=128)
    nb = layers[0].neuron_nbytes
    profile = HardwareProfile("t", 1e6, 0.0, 4e6, 0.0, 0.0, 0.0, cpu_bytes_per_s=1.0)  # a CPU too slow to use
    runtime = CrispRuntime(layers, CrispPlan.full(4, 2, 64, [0]), device="cpu", gpu_budget=4 * 64 * nb,
                           config=RuntimeConfig(serving="hybrid", cost=profile.cost_model()))
    if resident:
        runtime.prefetch(0, [(1, 64)])
    runtime.forward(0, torch.randn(1, 128), torch.tensor([[1, 2]]), torch.tensor([[0.6, 0.4]]))
    step = runtime.last_step[0]
    assert not any(t.on_cpu for t in step.tasks)
    load = [profile.load_s(t.copy_bytes) for t in step.tasks]
    compute = [profile.compute_s(t.width * nb) for t in step.tasks]
    want = flow_shop_makespan(johnson_order(load, compute), load, compute)
    got = hybrid_check.simulated_step_s(step, runtime.last_served[0], profile, nb)
    assert got == pytest.approx(want, rel=1e-12)
    runtime.close()


def test_prefetch_check_runs_on_the_cpu():
    records = hybrid_check.prefetch_step_check(device="cpu", h2d_bytes_per_s=2e9, hidden=128, intermediate=64,
                                               repeats=1)
    assert [r["prefetch"] for r in records] == [False, True]
    assert all(r["measured_ms"] > 0 and r["predicted_ms"] > 0 for r in records)


@pytest.mark.parametrize("h2d,saves", [(1e6, True), (1e12, False)])
def test_simulated_prefetch_pair(h2d, saves):
    """The simulator's two-step timeline: layer 1's copies overlap layer 0's compute when prefetched (cut at
    layer 1's start), so the pair is faster with prefetch when copies are slow, and equal when they are free."""
    profile = HardwareProfile("t", h2d, 0.0, 4e6, 0.0, 0.0, 0.0)
    nb, width = 100, 64
    plain, fetched = (hybrid_check.simulated_prefetch_pair_s(profile, [0, 1], [2, 3], width, nb, 10**6, p)
                      for p in (False, True))
    compute = 4 * profile.compute_s(width * nb)  # two experts in each of the two steps
    assert plain >= fetched >= compute * (1 - 1e-12)
    assert (fetched < plain * (1 - 1e-6)) is saves
    if not saves:
        assert plain == pytest.approx(compute, rel=1e-6)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
@pytest.mark.parametrize("what", [[], ["copy"], ["step"], ["prefetch"]])
def test_cli_refuses_without_cuda(what, capsys):
    assert hybrid_check.main(what) == 2
    assert capsys.readouterr().out.startswith("error: bench.hybrid_check needs a CUDA GPU")
