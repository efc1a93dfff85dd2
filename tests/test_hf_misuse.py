"""The transformers drop-in used the wrong way: each case is a reproducer of one misuse.

save_pretrained while applied, a hub name given to load_model, a model run after restore() without
its experts, a pack made from other weights, nonsense budgets and formats, switching the experts
implementation away from CRISP, backward through CRISP experts, padding counted as tokens.
"""

from __future__ import annotations

import copy
import threading
import time
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf_dropin import TOKENS, assert_unchanged, logits, make_model, snapshot  # noqa: E402

from crisp_kernels import QuantFormat  # noqa: E402
from crisp_runtime import PackMismatchError, RuntimeConfig, apply, load_model, pack_model, parse_budget, save_pack  # noqa: E402
from crisp_runtime.execution.runtime import min_budget_bytes  # noqa: E402
from crisp_runtime.hf.handle import MAX_BUDGET_BYTES  # noqa: E402
from crisp_runtime.hf.moe_layers import find_moe_layers  # noqa: E402
from crisp_runtime.storage.pack import (  # noqa: E402
    model_info,
    weights_sha256,
)


def fingerprinted_info(model) -> dict:
    """pack.json fields as crisp-profile records them, weights fingerprint included."""
    return {**model_info(model), "model": {"weights_sha256": weights_sha256(find_moe_layers(model))}}


# ---------------------------------------------------------------------- save_pretrained while applied


@pytest.mark.parametrize("offload", [False, True])
def test_save_pretrained_while_applied_writes_the_original_experts(tmp_path, offload):
    from transformers import AutoModelForCausalLM

    model = make_model("mixtral")
    original = logits(model)
    keys = set(model.state_dict())
    with apply(model, gpu_budget="1MiB" if offload else None):
        assert set(model.state_dict()) == keys  # the kept originals stand in for the placeholders
        model.save_pretrained(tmp_path / "saved")
        crisp_logits = logits(model)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    assert torch.equal(logits(reloaded), original)  # full precision, not the 4-bit experts
    assert not torch.equal(crisp_logits, original)  # (the experts did run 4-bit while applied)
    assert set(model.state_dict()) == keys  # restored: no hook left adding anything


def test_save_pretrained_without_the_originals_is_refused(tmp_path):
    model = make_model("mixtral")
    model.save_pretrained(tmp_path / "ckpt")
    save_pack(tmp_path / "pack", pack_model(model), info=fingerprinted_info(model))
    loaded, handle = load_model(tmp_path / "ckpt", tmp_path / "pack")
    with pytest.raises(RuntimeError, match="were not kept.*no experts"):
        loaded.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out" / "model.safetensors").exists()
    dropped = make_model("mixtral")
    dropping = apply(dropped, config=RuntimeConfig(keep_original=False))
    with pytest.raises(RuntimeError, match="not kept"):
        dropped.state_dict()
    with pytest.warns(UserWarning, match="not kept"):
        dropping.restore()
    with pytest.warns(UserWarning, match="not kept"):
        handle.restore()
    with pytest.raises(RuntimeError, match="not kept"):  # still refused after restore(): there is nothing to save
        loaded.save_pretrained(tmp_path / "out")


# ---------------------------------------------------------------------- load_model: local folders only


@pytest.mark.parametrize("name", ["mistralai/Mixtral-8x7B-v0.1", "no-such-folder", "models/tiny-mixtral-crisp"])
def test_load_model_refuses_what_is_not_a_local_checkpoint_at_once(name):
    start = time.perf_counter()
    with pytest.raises(FileNotFoundError, match="checkpoint_dir: .*(not a local folder|no config.json)"):
        load_model(name, "models/tiny-mixtral-crisp")
    # Before: 24.7 s of hub retries for the first name (measured; the last back-off alone is 8 s). The check
    # reads two paths before anything is imported or loaded (measured 0.1 ms); 5 s leaves room for a loaded VM.
    assert time.perf_counter() - start < 5.0


@pytest.mark.parametrize(("kwargs", "err", "match"), [
    ({"device": "foo"}, ValueError, "device: 'foo' is not a device"),
    ({"device": "meta"}, ValueError, "device: 'meta'"),
    ({"device": 3}, TypeError, "device: expected a device name"),
    ({"dtype": "float33"}, TypeError, "dtype: expected"),
    ({"dtype": torch.int8}, TypeError, "dtype: expected"),
    ({"gpu_budget": "12 GG"}, ValueError, "gpu_budget: unknown unit"),
    ({"config": "fast"}, TypeError, "config: expected RuntimeConfig"),
    ({"plan": "plan.json"}, TypeError, "plan: expected CrispPlan"),
    ({"allow_weights_mismatch": "yes"}, TypeError, "allow_weights_mismatch"),
    ({"dtype": torch.float64}, ValueError, "dtype: torch.float64 is not a dtype CRISP runs; .*torch.float32"),
    ({"dtype": "float64"}, ValueError, "dtype: torch.float64 is not a dtype CRISP runs"),
])
def test_load_model_bad_arguments_name_the_argument(kwargs, err, match):
    with pytest.raises(err, match=match):
        load_model("models/tiny-mixtral", "models/tiny-mixtral-crisp", **kwargs)


@pytest.mark.parametrize(("pack_dir", "err"), [(None, TypeError), (5, TypeError), (b"models", TypeError),
                                                (["x"], TypeError), ("", ValueError), ("  ", ValueError)])
def test_load_model_pack_dir_that_is_no_folder_names_the_argument(pack_dir, err):
    with pytest.raises(err, match="pack_dir: expected a CRISP pack folder"):
        load_model("models/tiny-mixtral", pack_dir)


def test_load_model_refuses_a_too_small_budget_before_reading_the_checkpoint(monkeypatch):
    import transformers as tf

    def no_read(*args, **kwargs):
        raise AssertionError("the checkpoint was read")

    monkeypatch.setattr(tf.AutoModelForCausalLM, "from_pretrained", no_read)
    with pytest.raises(ValueError, match="gpu_budget of 1000 bytes is too small: .* 2 experts"):
        load_model("models/tiny-mixtral", "models/tiny-mixtral-crisp", gpu_budget=1000)


@pytest.mark.parametrize("dtype", ["auto", "float32", torch.float32])
def test_load_model_dtype_spellings(dtype):
    model, handle = load_model("models/tiny-mixtral", "models/tiny-mixtral-crisp", dtype=dtype)
    assert model.dtype == torch.float32  # the checkpoint's own dtype
    assert handle.active


def test_load_model_without_cuda_says_so():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ValueError, match="device: 'cuda' but no CUDA device"):
        load_model("models/tiny-mixtral", "models/tiny-mixtral-crisp", device="cuda")


# ---------------------------------------------------------------------- after restore() without originals


@pytest.mark.parametrize("how", ["load_model", "keep_original=False"])
def test_model_run_after_restore_without_its_experts_is_refused(tmp_path, how):
    model = make_model("qwen2_moe")
    if how == "load_model":
        model.save_pretrained(tmp_path / "ckpt")
        save_pack(tmp_path / "pack", pack_model(model), info=fingerprinted_info(model))
        model, handle = load_model(tmp_path / "ckpt", tmp_path / "pack")
    else:
        handle = apply(model, config=RuntimeConfig(keep_original=False))
    crisp = logits(model)
    with pytest.warns(UserWarning, match="not kept"):
        handle.restore()
    with pytest.raises(RuntimeError, match=r"model\.layers\.0\.mlp\.experts: the expert weights of this model are "
                                           "not loaded"):
        logits(model)
    # applying a pack again makes the model usable again, with the same result
    again = apply(model, pack_model_from(tmp_path, how, handle), allow_weights_mismatch=True,
                  cpu=None if how == "load_model" else "off")  # as the first run: load_model's default, or a config's
    assert torch.equal(logits(model), crisp)
    with pytest.warns(UserWarning, match="not kept"):
        again.restore()
    with pytest.raises(RuntimeError, match="not loaded"):
        logits(model)


def pack_model_from(tmp_path, how, handle):
    """The packed layers the handle ran (a pack folder for load_model, the layers otherwise)."""
    return tmp_path / "pack" if how == "load_model" else handle.layers


# ---------------------------------------------------------------------- the weights fingerprint


def test_pack_made_from_other_weights_is_refused_unless_allowed(tmp_path):
    model = make_model("mixtral", seed=0)
    other = make_model("mixtral", seed=1)  # same architecture, other weights
    snap = snapshot(model)
    save_pack(tmp_path / "other", pack_model(other), info=fingerprinted_info(other))
    save_pack(tmp_path / "own", pack_model(model), info=fingerprinted_info(model))
    with pytest.raises(PackMismatchError, match="other weights.*allow_weights_mismatch=True"):
        apply(model, tmp_path / "other")
    assert_unchanged(model, snap)
    with apply(model, tmp_path / "other", allow_weights_mismatch=True) as handle:
        assert handle.layers[0].qweight.equal(pack_model(other)[0].qweight)
    with apply(model, tmp_path / "own"):
        pass
    model.save_pretrained(tmp_path / "ckpt")
    with pytest.raises(PackMismatchError, match="other weights"):
        load_model(tmp_path / "ckpt", tmp_path / "other")
    loaded, handle = load_model(tmp_path / "ckpt", tmp_path / "other", allow_weights_mismatch=True)
    assert handle.layers[1].qweight.equal(pack_model(other)[1].qweight)  # the other model's experts, as asked
    loaded, handle = load_model(tmp_path / "ckpt", tmp_path / "own")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle.restore()
    # placeholders cannot be fingerprinted: refused unless the caller vouches for the pack
    with pytest.raises(PackMismatchError, match="cannot check.*not loaded"):
        apply(loaded, tmp_path / "own")
    again = apply(loaded, tmp_path / "own", allow_weights_mismatch=True)
    with pytest.warns(UserWarning, match="not kept"):
        again.restore()


# ---------------------------------------------------------------------- budgets and formats


@pytest.mark.parametrize(("budget", "err", "match"), [
    (-5, ValueError, "gpu_budget must be positive"),
    ("-1GB", ValueError, "gpu_budget: cannot read"),
    (2**63, ValueError, "gpu_budget .* beyond any device"),
    ("10000000000 TB", ValueError, "gpu_budget .* beyond any device"),
    ("9" * 400, ValueError, "gpu_budget .* beyond any device"),
    ("12 GG", ValueError, "gpu_budget: unknown unit 'GG'"),
    ("12GBs", ValueError, "gpu_budget: unknown unit"),
    ("1e9", ValueError, "gpu_budget: cannot read"),
    ("1,5GB", ValueError, "gpu_budget: cannot read"),
    ("nan", ValueError, "gpu_budget: cannot read"),
    ("inf GB", ValueError, "gpu_budget: cannot read"),
    ("", ValueError, "gpu_budget: cannot read"),
    ("25%", ValueError, "gpu_budget: '25%' is a share of a pack's expert bytes; parse_budget reads bytes"),
    (" 0.25 % ", ValueError, "is a share"),
    ("0.25", ValueError, r"gpu_budget: '0.25' reads as a fraction, not bytes; a budget is whole bytes \('6GiB', "
                         r"'512 MB', 107520\) or a share of the pack's expert bytes \('25%'\)"),
    ("1.0", ValueError, r"'1.0' reads as a fraction, not bytes.*\('100%'\)"),
    ("1.9", ValueError, r"gpu_budget: '1.9' is not a whole number of bytes; a budget is whole bytes .*\('25%'\)"),
    ("0.5 B", ValueError, r"reads as a fraction, not bytes.*\('50%'\)"),
    ("1.0001KB", ValueError, "is not a whole number of bytes"),
    (2e9, TypeError, "gpu_budget: expected bytes .* got float 2000000000.0"),
    (float("nan"), TypeError, "gpu_budget: .* got float nan"),
    (0.5, TypeError, "for a share of the pack's expert bytes pass a string such as '25%'"),
    (True, TypeError, "gpu_budget: .* got a bool"),
    ([1024], TypeError, "gpu_budget: .* got list"),
])
def test_nonsense_budgets_are_refused_naming_the_argument(budget, err, match):
    with pytest.raises(err, match=match):
        parse_budget(budget)


@pytest.mark.parametrize(("text", "expected"), [
    ("12 GB", 12 * 10**9), ("1.1GB", 1_100_000_000), (" 512 mib ", 512 * 2**20), ("3.", 3), (".5KB", 500),
    (str(MAX_BUDGET_BYTES), MAX_BUDGET_BYTES),
])
def test_budget_text_is_read_exactly(text, expected):
    assert parse_budget(text) == expected


def test_numpy_integer_budget_is_accepted():
    np = pytest.importorskip("numpy")
    assert parse_budget(np.int64(4096)) == 4096


@pytest.mark.parametrize(("kwargs", "err", "match"), [
    ({"fmt": "g64"}, TypeError, "fmt: expected a QuantFormat .* got str 'g64'"),
    ({"fmt": 64}, TypeError, "fmt: expected a QuantFormat"),
    ({"fmt": "g64", "source": "models/tiny-mixtral-crisp"}, TypeError, "fmt: expected a QuantFormat"),
    ({"gpu_budget": "12 GG"}, ValueError, "gpu_budget"),
    ({"plan": "plan.json"}, TypeError, "plan: expected CrispPlan"),
    ({"config": RuntimeConfig(device="foo")}, ValueError, "config.device: 'foo' is not a device"),
    ({"config": RuntimeConfig(device="meta")}, ValueError, "config.device: 'meta'"),
    ({"allow_weights_mismatch": 1}, TypeError, "allow_weights_mismatch"),
    ({"source": ""}, ValueError, "source: expected a CRISP pack folder, got ''"),
    ({"source": {"a": 1}}, TypeError, r"source: a \{layer_id: PackedLayer\} mapping takes integer layer ids, .*'a'"),
    ({"shapes": 5}, TypeError, "shapes: expected None or a sequence of .*BlockShape"),
    ({"shapes": ("mixtral",)}, TypeError, "shapes: expected None or a sequence of .*BlockShape"),
    ({"config": RuntimeConfig(), "serving": "cpu_only", "gpu_budget": "1MiB"}, ValueError,
     "serving placement 'cpu_only' computes experts on the CPU .*pass cpu='on' or cpu='auto'"),
])
def test_apply_bad_arguments_leave_the_model_as_it_was(kwargs, err, match):
    model = make_model("mixtral")
    snap = snapshot(model)
    with pytest.raises(err, match=match):
        apply(model, **kwargs)
    assert_unchanged(model, snap)
    apply(model, fmt=QuantFormat(group_size=32)).restore()


def test_a_float64_model_is_refused_before_anything_is_modified():
    model = make_model("mixtral").double()
    snap = snapshot(model)
    with pytest.raises(ValueError, match=r"model: parameter .* is torch.float64; CRISP runs models in torch.float32, "
                                         "torch.bfloat16 or torch.float16"):
        apply(model)
    assert_unchanged(model, snap)


def test_set_plan_on_a_restored_handle_is_refused():
    from crisp_runtime import CrispPlan

    model = make_model("mixtral")
    handle = apply(model)
    handle.restore()
    with pytest.raises(RuntimeError, match=r"set_plan: CRISP is not applied \(this handle was restored\)"):
        handle.set_plan(CrispPlan.uniform(4, 2, 32, [0, 1], 8))


# ---------------------------------------------------------------------- set_experts_implementation while applied


@pytest.mark.parametrize("impl", ["eager", "batched_mm", "grouped_mm"])
@pytest.mark.parametrize("how", ["model", "inner model", "config"])
def test_switching_the_experts_implementation_while_applied_is_refused(impl, how):
    model = make_model("mixtral")
    original = logits(model)
    handle = apply(model)
    crisp = logits(model)
    if how == "model":
        model.set_experts_implementation(impl)
    elif how == "inner model":
        model.model.set_experts_implementation(impl)
    else:
        model.config._experts_implementation = impl
    with pytest.raises(RuntimeError, match=f"CRISP is applied .* now '{impl}'.*handle.restore"):
        logits(model)
    model.set_experts_implementation("crisp")  # back: runs as before
    assert torch.equal(logits(model), crisp)
    handle.restore()
    assert torch.equal(logits(model), original)
    model.set_experts_implementation(impl)  # restored: every implementation works on the real weights again
    torch.testing.assert_close(logits(model), original, rtol=1e-5, atol=1e-5)
    assert not any(ref.module._forward_pre_hooks for ref in find_moe_layers(model))  # no hook left behind


def test_restore_after_switching_brings_the_original_implementation_back():
    model = make_model("olmoe")
    before = model.get_experts_implementation()
    original = logits(model)
    handle = apply(model)
    model.set_experts_implementation("eager")
    handle.restore()
    assert model.get_experts_implementation() == before
    assert torch.equal(logits(model), original)


# ---------------------------------------------------------------------- a dtype conversion while applied


@pytest.mark.parametrize("dense", [None, "keep"], ids=["default", "keep"])
@pytest.mark.parametrize("convert", ["to_bf16", "half"])
def test_restore_after_a_dtype_conversion_while_applied_gives_the_converted_model(dense, convert):
    model = make_model("mixtral")
    expected = copy.deepcopy(model)
    handle = apply(model, config=None if dense is None else RuntimeConfig(dense=dense))
    for m in (model, expected):
        m.to(torch.bfloat16) if convert == "to_bf16" else m.half()
    logits(model)  # runs while applied
    handle.restore()
    got, want = model.state_dict(), expected.state_dict()
    assert list(got) == list(want)
    for key, value in want.items():  # the held originals converted as .to(dtype) converts: same dtype, same bits
        assert got[key].dtype == value.dtype, key
        assert torch.equal(got[key], value), key
    assert torch.equal(logits(model), logits(expected))


# ---------------------------------------------------------------------- threads


def test_forwards_from_several_threads_take_turns_and_give_the_serial_logits():
    model = make_model("mixtral")
    inputs = [torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    layers = pack_model(model)
    budget = min_budget_bytes(layers, model.config.num_experts_per_tok)  # the smallest: every step evicts
    with apply(model, layers, gpu_budget=budget, serving="plan", cpu="off"):
        with torch.no_grad():
            serial = [model(x).logits for x in inputs]
        errors, results = [], {i: [] for i in range(len(inputs))}

        def work(i):
            try:
                for _ in range(10):
                    with torch.no_grad():
                        results[i].append(model(inputs[i]).logits)
            except Exception as exc:  # noqa: BLE001 - every failure is reported
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []
    for i, want in enumerate(serial):
        assert len(results[i]) == 10
        for got in results[i]:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------- gradients


# 8-bit dense layers (the lm head the last of them) refuse first; with them kept (what a model on the device path
# gets: these fp32 weights are no bf16 values), the experts
REFUSALS = {"q8": r"dense layers \(RuntimeConfig.dense\) do not support gradients.*no gradient.*restore",
            "keep": "experts.*do not support gradients.*router.*would get no gradient.*restore"}


@pytest.mark.parametrize(("family", "dense"), [("mixtral", "keep"), ("deepseek_v3", "keep"), ("mixtral", "q8")])
def test_backward_through_crisp_experts_is_refused(family, dense):
    from crisp_kernels import cpu_native

    if dense == "q8" and not cpu_native.available():
        pytest.skip("the native CPU kernel does not build here")
    model = make_model(family)
    with apply(model, config=RuntimeConfig(dense=dense)):
        out = model(TOKENS).logits  # grad enabled: the forward runs (inference without no_grad is common)
        assert out.requires_grad
        with pytest.raises(RuntimeError, match=REFUSALS[dense]):
            out.sum().backward()
        with torch.no_grad():
            assert torch.equal(model(TOKENS).logits, out.detach())  # same values either way
    out = model(TOKENS).logits  # restored: training works again
    out.sum().backward()
    router = next(m for n, m in model.named_modules() if n.endswith("layers.1.mlp.gate") or n.endswith(
        "layers.1.block_sparse_moe.gate"))
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_inputs_without_grad_do_not_take_the_refusing_path():
    model = make_model("mixtral")
    model.requires_grad_(False)
    with apply(model):
        out = model(TOKENS).logits
    assert not out.requires_grad


# ---------------------------------------------------------------------- padding is not counted as tokens


@pytest.mark.parametrize("offload", [False, True])
def test_stats_count_real_tokens_not_padding(offload):
    model = make_model("mixtral")
    mask = torch.ones_like(TOKENS)
    mask[0, :4] = 0  # left padding of the first row: 4 positions
    layers = pack_model(model)
    budget = min_budget_bytes(layers, 2) if offload else None
    with apply(model, layers, gpu_budget=budget) as handle:
        with torch.no_grad():
            model(TOKENS, attention_mask=mask)
        st = handle.stats()
        assert (st["tokens"], st["positions"], st["padding"]) == (TOKENS.numel() - 4, TOKENS.numel(), 4)
        assert st["bytes_read_per_token"] == st["bytes_read"] / (TOKENS.numel() - 4)
        assert all(v["tokens"] == TOKENS.numel() - 4 and v["positions"] == TOKENS.numel()
                   for v in st["layers"].values())
        handle.reset_stats()
        with torch.no_grad():
            model(TOKENS)  # no mask: every position is a token
            model(TOKENS, attention_mask=torch.ones_like(TOKENS))
        st = handle.stats()
        assert st["tokens"] == st["positions"] == 2 * TOKENS.numel() and st["padding"] == 0


def test_stats_during_generate_with_a_kv_cache_count_each_new_token_once():
    model = make_model("mixtral")
    mask = torch.ones_like(TOKENS)
    mask[1, :3] = 0
    new = 3
    with apply(model) as handle, torch.no_grad():
        model.generate(TOKENS, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                       pad_token_id=0)
        st = handle.stats()
    rows = TOKENS.shape[0]
    # prefill: the real prompt tokens; then one forward per further new token, one position per row
    assert st["tokens"] == int(mask.sum()) + (new - 1) * rows
    assert st["positions"] == TOKENS.numel() + (new - 1) * rows
