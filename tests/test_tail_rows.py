"""2-bit tail rows (crisp_kernels.format, "2-bit tail rows"): the storage layout decoded independently, the
quantizer, packs on disk, plans in storage rows, and the runtime's outputs at the widths it served."""

from __future__ import annotations

import json

import pytest
import torch
from runtime_helpers import random_layers

from crisp_kernels import PackedLayer, QuantFormat, dequantize_expert, expert_mlp, pack_layer
from crisp_kernels.expert_mlp import Backend
from crisp_kernels.format import (
    TAIL_CLIP_RATIOS,
    layer_neuron_rows,
    neurons_in_rows,
    pack_crumbs,
    quantize_tail_rows,
    rows_for_neurons,
    unpack_crumbs,
    with_tail,
)
from crisp_kernels.io import PackFormatError, PackIntegrityError, load_packed, read_packed_metadata, save_packed
from crisp_runtime import CrispPlan, RuntimeConfig, Tier, TierWidths
from crisp_runtime.execution.runtime import CrispRuntime, min_budget_bytes, plan_for_layers
from crisp_runtime.planning.plan import LayerPlan, PlanError
from crisp_runtime.storage.pack import load_pack, save_pack


def original_rows(gate_up, down, order):
    """(E, I, 3, H) gate row, up row, down column in stored order."""
    inter = gate_up.shape[1] // 2
    rows = torch.stack((gate_up[:, :inter], gate_up[:, inter:], down.transpose(1, 2)), dim=2)
    return rows.gather(1, order[:, :, None, None].expand_as(rows))


def make(num_experts=3, inter=13, hidden=128, group=32, tail_start=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.1
    down = torch.randn(num_experts, hidden, inter, generator=g) * 0.1
    order = torch.stack([torch.randperm(inter, generator=g) for _ in range(num_experts)])
    plain = pack_layer(gate_up, down, QuantFormat(group_size=group), order)
    return plain, with_tail(plain, original_rows(gate_up, down, order), tail_start)


def decode_neuron(layer: PackedLayer, e: int, n: int) -> torch.Tensor:
    """Neuron n of expert e as (3, H) float64, read from the storage rows byte by byte (no view tricks)."""
    hidden, ts = layer.hidden_size, layer.tail_start
    group = layer.fmt.group_size
    if ts is None or n < ts:
        q = layer.qweight[e, n].reshape(3, hidden // 2).long()
        codes = torch.stack((q & 15, q >> 4), -1).reshape(3, hidden)
        s, z = layer.scales[e, n].double(), layer.zeros[e, n].double()
        idx = torch.arange(hidden) // group
        return (codes.double() - z[:, idx]) * s[:, idx]
    row, member = ts + (n - ts) // 2, (n - ts) % 2
    qb = layer.qweight[e, row].reshape(-1)[member * 3 * hidden // 4:(member + 1) * 3 * hidden // 4].reshape(3, -1)
    tg = 2 * group
    ng = hidden // tg
    sb = layer.scales[e, row].reshape(-1)[member * 3 * ng:(member + 1) * 3 * ng].reshape(3, ng).double()
    zb = layer.zeros[e, row].reshape(-1)[member * 3 * ng:(member + 1) * 3 * ng].reshape(3, ng).double()
    out = torch.empty(3, hidden, dtype=torch.float64)
    for el in range(hidden):
        code = (qb[:, el // 4].long() >> (2 * (el % 4))) & 3
        out[:, el] = (code.double() - zb[:, el // tg]) * sb[:, el // tg]
    return out


# ---------------------------------------------------------------------------- the layout


def test_crumbs_round_trip_every_value():
    q = torch.arange(256, dtype=torch.int64).reshape(-1, 1)
    codes = torch.stack([(q >> s) & 3 for s in (0, 2, 4, 6)], -1).reshape(256, 4).to(torch.uint8)
    assert torch.equal(pack_crumbs(codes).reshape(-1), torch.arange(256, dtype=torch.uint8))
    assert torch.equal(unpack_crumbs(pack_crumbs(codes)), codes)
    with pytest.raises(ValueError, match="multiple of 4"):
        pack_crumbs(torch.zeros(2, 6, dtype=torch.uint8))


@pytest.mark.parametrize("tail_start", [None, 0, 1, 7])
def test_rows_and_neurons_are_inverse(tail_start):
    for n in range(40):
        r = rows_for_neurons(n, tail_start)
        assert neurons_in_rows(r, tail_start) >= n
        assert r == 0 or neurons_in_rows(r - 1, tail_start) < n  # the least such r
    assert neurons_in_rows(10, tail_start) == (10 if tail_start is None else tail_start + 2 * (10 - tail_start))


@pytest.mark.parametrize("inter,tail_start", [(13, 5), (12, 0), (9, 8), (16, 4)])
@pytest.mark.parametrize("group", [32, 64])
def test_storage_rows_decode_independently(inter, tail_start, group):
    plain, tail = make(inter=inter, group=group, tail_start=tail_start)
    assert tail.intermediate_size == rows_for_neurons(inter, tail_start) and tail.num_neurons == inter
    assert tail.neuron_nbytes == plain.neuron_nbytes  # a storage row costs one 4-bit row
    assert tail.neurons(tail.intermediate_size) == inter  # the padding neuron of an odd tail is not counted
    assert tail.neurons(tail_start + 1) == min(tail_start + 2, inter) and plain.neurons(7) == 7
    assert torch.equal(tail.qweight[:, :tail_start], plain.qweight[:, :tail_start])  # the head bit for bit
    assert torch.equal(tail.scales[:, :tail_start], plain.scales[:, :tail_start])
    rows = layer_neuron_rows(tail, torch.float64)
    assert rows.shape == (3, inter, 3, 128)
    for e in range(3):
        for n in range(inter):
            assert torch.equal(rows[e, n], decode_neuron(tail, e, n)), (e, n)
        # dequantize_expert at every width: the first neurons_in_rows(w) neurons, a padding neuron of zeros
        for w in range(tail.intermediate_size + 1):
            gate, up, down = dequantize_expert(tail.expert(e), w, torch.float64)
            k = neurons_in_rows(w, tail_start)
            assert gate.shape[0] == k and down.shape[1] == k
            real = min(k, inter)
            assert torch.equal(gate[:real], rows[e, :real, 0]) and torch.equal(down[:, :real], rows[e, :real, 2].t())
            assert not gate[real:].any() and not up[real:].any() and not down[:, real:].any()


def test_quantizer_grid_clip_search_and_bytes():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(5, 3, 256, generator=g)
    q, s, z = quantize_tail_rows(w, 128)
    assert q.max() <= 3 and z.max() <= 3 and s.dtype == torch.float16 and (s > 0).all()
    idx = torch.arange(256) // 128
    deq = (q.double() - z[..., idx].double()) * s[..., idx].double()
    q2, s2, z2 = quantize_tail_rows(deq.float(), 128)  # a weight on the grid round-trips exactly
    assert torch.equal(((q2.double() - z2[..., idx].double()) * s2[..., idx].double()), deq)
    # the search never does worse than plain min-max (its first ratio) on any group
    assert TAIL_CLIP_RATIOS[0] == 1.0
    lo, hi = w.reshape(5, 3, 2, 128).amin(-1).clamp(max=0), w.reshape(5, 3, 2, 128).amax(-1).clamp(min=0)
    s0 = ((hi - lo) / 3).to(torch.float16).double()
    z0 = torch.round(-lo / s0).clamp(0, 3)
    q0 = torch.round(w.reshape(5, 3, 2, 128) / s0[..., None] + z0[..., None]).clamp(0, 3)
    err0 = ((q0 - z0[..., None]) * s0[..., None] - w.reshape(5, 3, 2, 128)).square().sum(-1)
    err = (deq - w.double()).reshape(5, 3, 2, 128).square().sum(-1)
    assert bool((err <= err0 + 1e-9).all()) and bool((err < err0 - 1e-6).any())
    with pytest.raises(ValueError, match="group_size"):
        quantize_tail_rows(w, 96)
    # 25% of the neurons 4-bit, the rest 2-bit g128, H=4096 g64: 62.5% of the 4-bit bytes
    assert rows_for_neurons(14336, 3584) / 14336 == 0.625


def test_layer_validation():
    plain, tail = make()
    with pytest.raises(ValueError, match="asymmetric"):
        sym = pack_layer(torch.randn(2, 16, 128), torch.randn(2, 128, 8), QuantFormat(group_size=32, symmetric=True))
        with_tail(sym, torch.randn(2, 8, 3, 128), 2)
    with pytest.raises(ValueError, match="already has a 2-bit tail"):
        with_tail(tail, torch.randn(3, 13, 3, 128), 2)
    with pytest.raises(ValueError, match="tail_start"):
        with_tail(plain, torch.randn(3, 13, 3, 128), 13)
    with pytest.raises(ValueError, match="stored_rows"):
        with_tail(plain, torch.randn(3, 12, 3, 128), 4)
    with pytest.raises(ValueError, match="NaN"):
        with_tail(plain, torch.full((3, 13, 3, 128), float("nan")), 4)
    with pytest.raises(ValueError, match="neuron_order"):
        PackedLayer(tail.fmt, tail.qweight, tail.scales, tail.zeros, tail.neuron_order[:, :10],
                    tail_start=tail.tail_start)
    with pytest.raises(ValueError, match="past the"):
        PackedLayer(tail.fmt, tail.qweight, tail.scales, tail.zeros, tail.neuron_order, tail_start=10)
    with pytest.raises(ValueError, match="tail_start"):
        PackedLayer(tail.fmt, tail.qweight, tail.scales, tail.zeros, tail.neuron_order, tail_start=True)
    with pytest.raises(ValueError, match="must divide"):  # H = 96: groups of 64 do not divide it
        odd = pack_layer(torch.randn(1, 4, 96), torch.randn(1, 96, 2), QuantFormat(group_size=32))
        with_tail(odd, torch.randn(1, 2, 3, 96), 1)


# ---------------------------------------------------------------------------- kernels (torch reference)


def test_expert_mlp_reference_is_the_mlp_of_the_rows_neurons():
    _, tail = make(inter=13, tail_start=5)
    rows = layer_neuron_rows(tail, torch.float64)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 128, generator=g)
    tw = torch.tensor([0, 1, 5, 6, 9, 40])  # rows: 0, head only, all head, one tail row, the full 9, clamped
    for e in range(3):
        for width in (0, 1, 4, 5, 6, 8, 9):
            out = expert_mlp(x, tail.expert(e), width, token_widths=tw, backend=Backend.TORCH).double()
            for t in range(6):
                k = min(neurons_in_rows(min(width, int(tw[t])), 5), 13)
                gate, up, down = rows[e, :k, 0], rows[e, :k, 1], rows[e, :k, 2]
                want = down.t() @ (torch.nn.functional.silu(gate @ x[t].double()) * (up @ x[t].double()))
                assert torch.allclose(out[t], want, rtol=1e-5, atol=1e-6), (e, width, t)


# ---------------------------------------------------------------------------- files


def test_save_load_round_trip_and_version(tmp_path):
    plain, tail = make()
    save_packed(tmp_path / "t.safetensors", {0: tail, 2: tail})
    meta = read_packed_metadata(tmp_path / "t.safetensors")
    assert meta["format_version"] == "2" and meta["tail_start"] == "5" and meta["num_neurons"] == "13"
    back = load_packed(tmp_path / "t.safetensors")[2]
    for name in ("qweight", "scales", "zeros", "neuron_order"):
        assert torch.equal(getattr(back, name), getattr(tail, name))
    assert back.tail_start == 5
    save_packed(tmp_path / "p.safetensors", {0: plain})
    assert read_packed_metadata(tmp_path / "p.safetensors")["format_version"] == "1"
    assert "tail_start" not in read_packed_metadata(tmp_path / "p.safetensors")


def _rewrite_metadata(path, **changes):
    """The file with its metadata fields changed (None deletes one); the header's length updated."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    for k, v in changes.items():
        if v is None:
            header["__metadata__"].pop(k, None)
        else:
            header["__metadata__"][k] = v
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + n:])


@pytest.mark.parametrize("changes,match", [
    ({"format_version": "1"}, "come together"),  # a tail read as a plain pack: refused, never 4-bit rows
    ({"tail_start": None}, "come together|without"),
    ({"num_neurons": None}, "without"),
    ({"num_neurons": "20"}, "do not fill"),
    ({"tail_start": "9"}, "do not fill"),
    ({"tail_start": "-1"}, "tail_start"),
    ({"format_version": "3"}, "not supported"),
])
def test_corrupt_tail_metadata_is_refused(tmp_path, changes, match):
    _, tail = make()
    path = tmp_path / "t.safetensors"
    save_packed(path, {0: tail})
    _rewrite_metadata(path, **changes)
    with pytest.raises(PackFormatError, match=match):
        load_packed(path)


def test_a_tail_zero_point_above_3_is_refused(tmp_path):
    _, tail = make()
    zeros = tail.zeros.clone()
    zeros[1, 7, 2, 0] = 4  # a 2-bit row's zero point: valid for 4-bit rows, not here
    bad = PackedLayer(tail.fmt, tail.qweight, tail.scales, zeros, tail.neuron_order, tail_start=5)
    with pytest.raises(ValueError, match="2-bit tail zero point"):
        save_packed(tmp_path / "t.safetensors", {0: bad})
    ok = zeros.clone()
    ok[1, 7, 2, 0] = 3
    ok[1, 2, 2, 0] = 15  # a head row: 4-bit
    save_packed(tmp_path / "t.safetensors", {0: PackedLayer(tail.fmt, tail.qweight, tail.scales, ok,
                                                            tail.neuron_order, tail_start=5)})
    path = tmp_path / "t.safetensors"
    data = bytearray(path.read_bytes())
    # flip that zero point to 4 in the file: the value check catches it at load
    target = load_packed(path)[0].zeros
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    start = header["layers.0.zeros"]["data_offsets"][0] + 8 + n
    flat = (1 * target.shape[1] + 7) * target.shape[2] * target.shape[3] + 2 * target.shape[3]
    assert data[start + flat] == 3
    data[start + flat] = 4
    path.write_bytes(bytes(data))
    with pytest.raises(PackIntegrityError, match="2-bit tail zero point"):
        load_packed(path)


def test_pack_folder_keeps_the_plan_in_neurons(tmp_path):
    plain, tail = make(inter=13, tail_start=5)
    layers = {0: tail, 1: tail}
    plan = CrispPlan.crisp(3, 2, 13, {0: LayerPlan({}, {}), 1: LayerPlan({}, {})}, TierWidths(13, 8, 3))
    save_pack(tmp_path / "p", layers, plan=plan)
    info = json.loads((tmp_path / "p" / "pack.json").read_text())
    assert (info["intermediate_size"], info["tail_start"], info["num_neurons"]) == (9, 5, 13)
    pack = load_pack(tmp_path / "p")
    assert pack.plan.intermediate_size == 13 and pack.layers[0].tail_start == 5
    with pytest.raises(PlanError, match="intermediate_size"):  # a plan in rows is not a pack's plan
        save_pack(tmp_path / "q", layers, plan=plan.in_storage_rows(5))


# ---------------------------------------------------------------------------- plans and the runtime


def test_plan_in_storage_rows():
    layers = {0: LayerPlan({(0, 1): Tier.COLD}, {})}
    plan = CrispPlan.crisp(4, 2, 13, layers, TierWidths(13, 6, 1))
    rows = plan.in_storage_rows(5)
    assert (rows.intermediate_size, rows.tier_widths) == (9, TierWidths(9, 6, 1))  # 6 neurons = 5 head + 1 tail row
    assert CrispPlan.uniform(4, 2, 13, [0], 8).in_storage_rows(5).uniform_width == 7
    assert plan.in_storage_rows(None) is plan
    with pytest.raises(PlanError, match="tail_start"):
        plan.in_storage_rows(13)
    _, tail = make(inter=13, tail_start=5)
    assert plan_for_layers(plan, {0: tail}).intermediate_size == 9
    assert plan_for_layers(rows, {0: tail}) is rows  # already in rows


E, TOP_K, INTER, TS = 6, 2, 16, 4
PLAIN_LAYERS = random_layers(layer_ids=(0, 1), num_experts=E, inter=INTER, hidden=128, seed=5)


def _tail_layers():
    g = torch.Generator().manual_seed(9)
    out = {}
    for i, layer in PLAIN_LAYERS.items():
        rows = layer_neuron_rows(layer) + 0.01 * torch.randn(E, INTER, 3, 128, generator=g)
        out[i] = with_tail(layer, rows, TS)
    return out


TAIL_LAYERS = _tail_layers()
TAIL_ROWS = {i: layer_neuron_rows(layer, torch.float64) for i, layer in TAIL_LAYERS.items()}


def reference(layer_id, x, index, weights, widths):
    """sum over slots of weight x expert over the neurons of its served storage rows, float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for s in range(index.shape[1]):
            e, w = int(index[t, s]), int(widths[t, s])
            k = min(neurons_in_rows(w, TS), INTER)
            if k == 0:
                continue
            rows = TAIL_ROWS[layer_id][e, :k]
            xt = x[t].double()
            out[t] += float(weights[t, s]) * (rows[:, 2].t() @ (torch.nn.functional.silu(rows[:, 0] @ xt)
                                                                * (rows[:, 1] @ xt)))
    return out


@pytest.mark.parametrize("serving", ["plan", "resident-floor75"])
@pytest.mark.parametrize("extra_rows", [0, 7, 40])
def test_runtime_serves_tail_rows_as_the_reference_at_served_widths(serving, extra_rows):
    layer_plans = {i: LayerPlan({(0, 1): Tier.HOT, (2, 3): Tier.COLD}, {}) for i in (0, 1)}
    plan = CrispPlan.crisp(E, TOP_K, INTER, layer_plans, TierWidths(INTER, 9, 3))  # in neurons
    nb = TAIL_LAYERS[0].neuron_nbytes
    budget = min_budget_bytes(TAIL_LAYERS, TOP_K) + extra_rows * nb
    rt = CrispRuntime(TAIL_LAYERS, plan, device="cpu", gpu_budget=budget, config=RuntimeConfig(serving=serving))
    assert rt.plan.intermediate_size == TAIL_LAYERS[0].intermediate_size == 10
    g = torch.Generator().manual_seed(11)
    for step in range(12):
        layer_id = step % 2
        tokens = 1 + step % 3
        x = torch.randn(tokens, 128, generator=g)
        index = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(tokens)])
        weights = torch.softmax(torch.randn(tokens, TOP_K, generator=g), -1)
        out = rt.forward(layer_id, x, index, weights)
        served = rt.last_served[layer_id].widths
        ref = reference(layer_id, x, index, weights, served)
        assert (out.double() - ref).norm() <= 1e-5 * ref.norm()
        assert rt.cache.used <= budget
        if serving == "plan":  # exact: the plan's widths in rows, whatever is resident
            assert torch.equal(served, rt.plan.token_widths(layer_id, index, weights))
    stats = rt.stats.as_dict()
    assert stats["bytes_h2d"] % nb == 0 and stats["bytes_h2d"] > 0


def test_cpu_placement_is_refused_for_tail_rows():
    plan = CrispPlan.full(E, TOP_K, INTER, (0, 1))
    from crisp_runtime.scheduling.scheduler import CostModel

    cost = CostModel(cpu_bytes_per_s=1e10)
    with pytest.raises(ValueError, match="2-bit tail"):
        CrispRuntime(TAIL_LAYERS, plan, device="cpu", gpu_budget=min_budget_bytes(TAIL_LAYERS, TOP_K),
                     config=RuntimeConfig(serving="hybrid", cost=cost))


def test_crisp_experts_module_with_a_tail():
    from crisp_kernels import CrispExperts

    module = CrispExperts(TAIL_LAYERS[0])
    assert module.layer.tail_start == TS and "2-bit tail" in repr(module)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 128, generator=g)
    index = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(5)])
    weights = torch.softmax(torch.randn(5, TOP_K, generator=g), -1)
    full = torch.full((5, TOP_K), TAIL_LAYERS[0].intermediate_size)
    ref = reference(0, x, index, weights, full)
    assert (module(x, index, weights).double() - ref).norm() <= 1e-5 * ref.norm()


# ---------------------------------------------------------------------------- the Triton path: head + tail


@pytest.mark.parametrize("num_tokens", [1, 3, 20])
@pytest.mark.parametrize("width", [0, 3, 4, 5, 7, 10])  # TS = 4: head only, the boundary, one tail row, full
def test_triton_head_plus_tail_equals_the_reference(device, kernel_backend, num_tokens, width):
    """The public entries on a tail expert: the 4-bit kernels for rows [0, tail_start), the 2-bit ones after,
    against the torch reference (itself checked against the independent decode above)."""
    from crisp_kernels import expert_mlp_accumulate_

    g = torch.Generator().manual_seed(width * 7 + num_tokens)
    expert = TAIL_LAYERS[1].expert(2).to(device)
    x = torch.randn(num_tokens, 128, generator=g).to(device)
    tw = torch.randint(-1, 12, (num_tokens,), generator=g).to(device)
    ref = expert_mlp(x.cpu(), TAIL_LAYERS[1].expert(2), width, token_widths=tw.cpu(), backend=Backend.TORCH)
    out = expert_mlp(x, expert, width, token_widths=tw, backend=kernel_backend).cpu()
    scale = ref.norm().clamp_min(1e-6)
    assert (out - ref).norm() <= 1e-5 * scale  # fp32 accumulation order over H and the neurons
    rows = torch.arange(num_tokens, device=device).flip(0)
    weights = torch.rand(num_tokens, generator=g).to(device)
    acc = torch.zeros(num_tokens + 2, 128, device=device)
    expert_mlp_accumulate_(acc, torch.cat((x, torch.zeros(2, 128, device=device))), expert, width,
                           rows=rows, weights=weights, token_widths=tw, backend=kernel_backend)
    # slot t reads x[rows[t]] at token_widths[t]: out[rows[t]] += weights[t] * expert(x[rows[t]])
    slots = expert_mlp(x.cpu()[rows.cpu()], TAIL_LAYERS[1].expert(2), width, token_widths=tw.cpu(),
                       backend=Backend.TORCH)
    want = torch.zeros(num_tokens + 2, 128)
    want[rows.cpu()] += weights.cpu()[:, None] * slots
    assert (acc.cpu() - want).norm() <= 1e-5 * want.norm().clamp_min(1e-6)
    assert not acc[num_tokens:].any()


def test_the_kernel_benchmark_times_a_tail_beside_the_4bit_rows(capsys):
    """crisp-bench kernels --tail-start: the same neurons from tail rows, checked against their own reference
    before timing; the record says how many rows and bytes that is."""
    from crisp_bench import cli as bench_cli
    from crisp_bench.kernels import run_kernel_sweep

    # the torch backend: the interpreter's tail path is checked above; this is the benchmark's bookkeeping
    recs = run_kernel_sweep(["128x256"], [0.5, 1.0], [1], device="cpu", quick=True, tail_start=0.25, backend="torch")
    assert len(recs) == 2
    for r in recs:
        assert r["tail_start"] == 64 and r["tail_rows"] == rows_for_neurons(r["width"], 64)
        assert r["err_crisp_tail"] <= 2 * 2.0**-11 and r["us_crisp_tail"] > 0  # fp16 output rounding (2u)
        assert r["bytes_read_tail"] < r["bytes_read"] or r["width"] <= 64
    full = next(r for r in recs if r["width_fraction"] == 1.0)
    x_bytes = full["tokens"] * 128 * 2  # the fp16 activations, counted in both
    assert (full["bytes_read_tail"] - x_bytes) / (full["bytes_read"] - x_bytes) == 0.625
    with pytest.raises(ValueError, match="tail_start"):
        run_kernel_sweep(["tiny"], [1.0], [1], device="cpu", quick=True, tail_start=1.0)
    with pytest.raises(ValueError, match="asymmetric"):
        run_kernel_sweep(["tiny"], [1.0], [1], device="cpu", quick=True, tail_start=0.5, symmetric=True)
    assert bench_cli.main(["kernels", "--quick", "--shapes", "tiny", "--widths", "1", "--tokens", "1",
                           "--tail-start", "0.25", "--backend", "torch"]) == 0
    assert "2-bit tail" in capsys.readouterr().out
