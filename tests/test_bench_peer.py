"""crisp-bench peer: records, arguments, the work folder, the GGUF layout and the engines' workers.

The llama.cpp tests need the ``peers`` extra (llama-cpp-python, gguf) and skip cleanly without it.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from crisp_bench import cli, peer, peer_engines
from crisp_bench import peer_models as pm

TINY = str(pm.TINY_MODEL)
TINY_PACK = str(pm.TINY_PACK)


def _record(**over):
    kw = {"engine": "crisp", "model": "large", "quant": peer.CRISP_QUANT, "width": "full", "threads": 2,
          "decode_s": [1.0, 2.0, 4.0], "prompt_s": [0.5, 0.25, 1.0], "decode_tokens": 64, "prompt_tokens": 32,
          "peak_rss_mib": 100.0}
    kw.update(over)
    return peer.make_record(**kw)


def test_record_has_the_schema_keys_and_median_rates():
    rec = _record()
    peer.check_record(rec)
    assert rec["decode_tokens_per_s"] == pytest.approx(64 / 2.0)  # the median round
    assert rec["decode_tokens_per_s_best"] == pytest.approx(64 / 1.0)
    assert rec["prompt_tokens_per_s"] == pytest.approx(32 / 0.5)
    json.dumps(rec, allow_nan=False)


def test_pair_rounds_divides_llama_cpp_by_crisp_within_each_round():
    llama = _record(engine="llama.cpp", quant="Q4_0", decode_s=[1.0, 3.0, 2.0])
    k_m = _record(engine="llama.cpp", quant="Q4_K_M", decode_s=[9.0, 9.0, 9.0])
    crisp = _record(decode_s=[2.0, 3.0, 1.0])
    other_threads = _record(threads=1, decode_s=[1.0, 1.0, 1.0])  # no Q4_0 record at 1 thread
    records = [llama, k_m, crisp, other_threads]
    peer.pair_rounds(records)
    # round by round: 1/2, 3/3, 2/1; the separate medians' ratio (2.0 / 2.0 = 1.0) would hide the spread
    assert crisp["vs_q4_0_per_round"] == {"median": 1.0, "min": 0.5, "max": 2.0, "rounds": 3}
    assert "vs_q4_0_per_round" not in other_threads
    assert "vs_q4_0_per_round" not in llama and "vs_q4_0_per_round" not in k_m
    assert crisp["decode_s_per_round"] == [2.0, 3.0, 1.0]
    json.dumps(records, allow_nan=False)


def test_pair_rounds_refuses_records_of_different_runs():
    records = [_record(engine="llama.cpp", quant="Q4_0", decode_s=[1.0, 2.0]), _record(decode_s=[1.0, 2.0, 3.0])]
    with pytest.raises(ValueError, match="3 CRISP rounds against 2"):
        peer.pair_rounds(records)


@pytest.mark.parametrize("over", [{"engine": "vllm"}, {"width": "half"}, {"decode_s": []}, {"decode_tokens": 0}])
def test_record_refuses_bad_fields(over):
    with pytest.raises(ValueError):
        _record(**over)


@pytest.mark.parametrize("drop", [*peer.RECORD_KEYS, "accuracy"])
def test_check_record_names_a_missing_key(drop):
    rec = _record(model="tiny", accuracy=0.5)
    del rec[drop]
    with pytest.raises(ValueError, match=drop):
        peer.check_record(rec)


@pytest.mark.parametrize("argv", [
    ["peer", "--models", "huge"], ["peer", "--threads", "0"], ["peer", "--threads", "a"],
    ["peer", "--quants", "Q8_0"], ["peer", "--tokens", "0"], ["peer", "--rounds", "-1"], ["peer", "--models", ""],
])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_without_the_peers_extra_the_command_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    assert cli.main(["peer", "--models", "tiny"]) == 2
    err = capsys.readouterr().err
    assert "crisp-moe[peers]" in err and err[-1] == "\n" and err.count("\n") == 1


def test_help_runs(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["peer", "--help"])
    assert exc.value.code == 0
    assert "llama.cpp" in capsys.readouterr().out


# ---------------------------------------------------------------------------- the work folder


def test_cached_builds_once_and_reuses_by_marker(tmp_path):
    calls = []

    def build(folder):
        calls.append(folder)
        (folder / "x.bin").write_bytes(b"1")

    a = pm.cached(tmp_path, "thing", {"v": 1}, build, log=lambda *_: None)
    b = pm.cached(tmp_path, "thing", {"v": 1}, build, log=lambda *_: None)
    c = pm.cached(tmp_path, "thing", {"v": 2}, build, log=lambda *_: None)
    assert a == b != c and len(calls) == 2
    assert (a / "x.bin").read_bytes() == b"1" and (a / pm.MARKER).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([a.name, c.name])  # no temporary left


def test_cached_names_a_work_folder_that_cannot_be_made(tmp_path):
    """A --work-dir on a file system that takes no folders (here a file standing where its parent should be) is a
    one-line PeerError naming the folder, not an OSError from inside the build."""
    (tmp_path / "file").write_text("mine")
    root = tmp_path / "file" / "work"
    with pytest.raises(pm.PeerError, match=f"{root}: cannot make the work folder"):
        pm.cached(root, "thing", {"v": 1}, lambda f: None, log=lambda *_: None)
    assert (tmp_path / "file").read_text() == "mine"


def test_cached_refuses_a_folder_without_its_marker_and_keeps_it(tmp_path):
    final = tmp_path / f"thing-{pm.digest({'v': 1})}"
    final.mkdir()
    (final / "user.txt").write_text("mine")
    with pytest.raises(pm.PeerError, match="without a complete marker"):
        pm.cached(tmp_path, "thing", {"v": 1}, lambda f: None, log=lambda *_: None)
    assert (final / "user.txt").read_text() == "mine"


@pytest.mark.parametrize("damage", ["truncated", "grown", "removed"])
def test_cached_names_a_built_file_whose_size_changed_and_keeps_the_folder(tmp_path, damage):
    def build(folder):
        (folder / "sub").mkdir()
        (folder / "sub" / "model.gguf").write_bytes(b"x" * 100)
        (folder / "a.json").write_text("{}")

    final = pm.cached(tmp_path, "thing", {"v": 1}, build, log=lambda *_: None)
    gguf = final / "sub" / "model.gguf"
    if damage == "removed":
        gguf.unlink()
    else:
        gguf.write_bytes(b"x" * (50 if damage == "truncated" else 101))
    got = {"truncated": "is 50 bytes", "grown": "is 101 bytes", "removed": "is missing"}[damage]
    with pytest.raises(pm.PeerError, match=f"sub/model.gguf {got}, built as 100 bytes"):
        pm.cached(tmp_path, "thing", {"v": 1}, build, log=lambda *_: None)
    assert (final / "a.json").read_text() == "{}"  # nothing removed: the user decides
    # a marker of an earlier build that lists no sizes is still reused as it was
    marker = final / pm.MARKER
    marker.write_text(json.dumps({k: v for k, v in json.loads(marker.read_text()).items() if k != "files"}))
    assert pm.cached(tmp_path, "thing", {"v": 1}, build, log=lambda *_: None) == final


def test_a_failed_build_leaves_nothing(tmp_path):
    def build(folder):
        (folder / "half").write_bytes(b"")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        pm.cached(tmp_path, "thing", {"v": 1}, build, log=lambda *_: None)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("bad", [{"hidden_size": 0}, {"num_attention_heads": 3}, {"num_experts_per_tok": 9},
                                 {"init_std": 0.0}, {"seed": -1}])
def test_large_shape_validates(bad):
    with pytest.raises(ValueError):
        pm.LargeShape(**bad)


@pytest.mark.parametrize("name", ["large", "mixtral-layer"])
def test_random_models_have_half_a_gigabyte_of_4bit_experts(name):
    from crisp_bench import peer

    shape = peer.RANDOM_SHAPES[name]
    neuron_bytes = 3 * (shape.hidden_size // 2 + shape.hidden_size // 64 * 3)  # codes + fp16 scales + zeros
    assert shape.num_hidden_layers * shape.num_local_experts * shape.intermediate_size * neuron_bytes >= 0.5e9


def test_the_mixtral_layer_has_mixtral_8x7bs_layer_shape_and_runs_only_when_asked():
    from crisp_bench import peer

    shape = peer.RANDOM_SHAPES["mixtral-layer"]
    assert (shape.hidden_size, shape.intermediate_size, shape.num_attention_heads, shape.num_key_value_heads,
            shape.num_local_experts, shape.num_experts_per_tok) == (4096, 14336, 32, 8, 8, 2)
    assert peer.DEFAULT_MODELS == ("tiny", "large") and set(peer.DEFAULT_MODELS) < set(peer.MODELS)


@pytest.mark.parametrize("n_head,head_dim", [(1, 4), (2, 8), (4, 2)])
def test_rope_permutation_interleaves_each_heads_halves(n_head, head_dim):
    w = torch.arange(n_head * head_dim * 3, dtype=torch.float32).reshape(n_head * head_dim, 3)
    got = pm._permute_rope(w, n_head)
    half = head_dim // 2
    for h in range(n_head):
        for i in range(half):  # llama.cpp's pair (2i, 2i + 1) = Hugging Face's rows (i, i + d/2)
            assert torch.equal(got[h * head_dim + 2 * i], w[h * head_dim + i])
            assert torch.equal(got[h * head_dim + 2 * i + 1], w[h * head_dim + half + i])


def test_expert_bytes_per_token_counts_q4_0_blocks():
    cfg = json.loads((pm.TINY_MODEL / "config.json").read_text())
    weights = 2 * cfg["num_hidden_layers"] * 3 * cfg["hidden_size"] * cfg["intermediate_size"]
    assert peer.expert_bytes_per_token(pm.TINY_MODEL, "Q4_0") == weights * 18 / 32


# ---------------------------------------------------------------------------- the CRISP worker (no llama.cpp)


def test_crisp_engine_serves_runs_and_accuracy_in_process():
    ids = list(range(40, 40 + 24))
    replies = []
    requests = [json.dumps(r) for r in (
        {"op": "run", "ids": ids, "prompt": 16, "logits": True},
        {"op": "accuracy", "windows": [ids, ids[4:]]},
        {"op": "applied"},
        {"op": "run", "ids": ids, "prompt": 16, "width": "full", "logits": True},
        {"op": "run", "ids": ids, "prompt": 16, "width": "plan"},
        {"op": "bogus"},
        {"op": "quit"},
    )]
    peer_engines.serve({"engine": "crisp", "model": TINY, "pack": TINY_PACK, "threads": 1, "n_ctx": 64,
                        "reference": True}, requests, replies.append)
    ready, fp32, acc, applied, full, plan, bogus, bye = replies
    assert ready["ready"] and applied["applied"] and bye["bye"] and "error" in bogus
    assert len(fp32["pred"]) == len(full["pred"]) == len(plan["pred"]) == len(ids)
    assert acc["total"] == 2 * len(ids) - 4 - 2 and 0 <= acc["correct"] <= acc["total"]
    # 4-bit experts at full width against the fp32 model: close, not equal
    assert 0 < peer.rel_err(full["logits"], fp32["logits"]) < 0.1
    assert bye["peak_rss_mib"] > 0


# ---------------------------------------------------------------------------- with llama.cpp


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory):
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")
    return pm.gguf_files(pm.TINY_MODEL, pm.PEER_QUANTS, tmp_path_factory.mktemp("peer"), threads=1,
                         log=lambda *_: None)


def test_f32_gguf_computes_what_the_fp32_model_does(tiny_ggufs):
    ids = list(range(60, 60 + 48))
    llama = peer_engines.LlamaCppEngine(str(tiny_ggufs["F32"]), 1, 64)
    got = llama.run(ids, 48, logits=True)
    ours = peer_engines.CrispEngine(TINY, TINY_PACK, 1, 64, reference=True)
    want = ours.run(ids, 48, logits=True)
    assert peer.rel_err(got["logits"], want["logits"]) <= peer.CONVERSION_TOL["F32"]
    assert got["pred"] == want["pred"]


@pytest.mark.parametrize("quant", pm.PEER_QUANTS)
def test_quantized_gguf_stays_near_the_fp32_model(tiny_ggufs, quant):
    ids = list(range(60, 60 + 48))
    got = peer_engines.LlamaCppEngine(str(tiny_ggufs[quant]), 1, 64).run(ids, 40, logits=True)
    want = peer_engines.CrispEngine(TINY, TINY_PACK, 1, 64, reference=True).run(ids, 40, logits=True)
    # 4-bit weights: a few percent of the logits' norm, far from an unrelated model's ~100%
    assert 0 < peer.rel_err(got["logits"], want["logits"]) < 0.2
    assert got["decode_s"] > 0 and got["prompt_s"] > 0


def test_cpu_profiles_fit_bandwidth_and_latency_per_kernel_from_the_widths():
    # native-fp32: 1 ms fixed + 10 GB/s; native-q8: 0.5 ms + 16 GB/s; two widths each give both back
    rates = {"native-fp32": (1e-3, 10e9), "native-q8": (0.5e-3, 16e9)}
    kernel = {"threads": 2, "read_gbps": 20.0, "kernel": [
        {"impl": impl, "prefix_bytes": b, "ms": 1e3 * (lat + b / bw), "width_frac": f, "gbps": 0.0, "pct_read": 0.0}
        for impl, (lat, bw) in rates.items() for f, b in ((0.5, 50e6), (1.0, 100e6))]}
    profs = peer.cpu_profiles(kernel)
    assert [p["impl"] for p in profs] == list(rates)
    for prof in profs:
        lat, bw = rates[prof["impl"]]
        assert prof["cpu_bytes_per_s"] == pytest.approx(bw, rel=1e-9)
        assert prof["cpu_latency_s"] == pytest.approx(lat, rel=1e-6)
        assert prof["read_bytes_per_s"] == 20e9 and prof["threads"] == 2


def test_the_crisp_engines_arithmetics_are_the_named_ones():
    from crisp_kernels import cpu_native
    from crisp_kernels.cpu_expert import CpuImpl

    if not cpu_native.available():
        pytest.skip("the native CPU kernel does not build here")
    assert peer_engines.crisp_cpu_experts("fp32").impl is CpuImpl.NATIVE_FP32
    assert peer_engines.crisp_cpu_experts("q8", 2).impl is CpuImpl.NATIVE_Q8
    assert peer_engines.crisp_runtime_config("q8").dense.value == "keep"
    dense = peer_engines.crisp_runtime_config("q8-dense4", 1)
    assert dense.dense.value == "q4" and dense.cpu_experts.impl is CpuImpl.NATIVE_Q8 and not dense.keep_original
    bf16 = peer_engines.crisp_runtime_config("q8-dense16", 1)
    assert bf16.dense.value == "bf16" and bf16.cpu_experts.impl is CpuImpl.NATIVE_Q8
    int8 = peer_engines.crisp_runtime_config("q8-dense8", 1)
    assert int8.dense.value == "q8" and int8.cpu_experts.impl is CpuImpl.NATIVE_Q8
    # the records' quant names, which bench/results/index.json's peer tables select on
    assert peer.CRISP_PRECISIONS == {"fp32": "crisp-int4-g64", "q8": "crisp-int4-g64-q8",
                                     "q8-dense4": "crisp-int4-g64-q8-dense4", "q8-dense8": "crisp-int4-g64-q8-dense8",
                                     "q8-dense16": "crisp-int4-g64-q8-dense16"}
    with pytest.raises(ValueError, match="precision"):
        peer_engines.crisp_cpu_experts("int4")


def test_a_timed_crisp_engine_is_load_model_and_computes_what_apply_does():
    """A timed CRISP worker loads the checkpoint with ``load_model`` (the expert weights never loaded whole): the same
    logits, bitwise, at both widths, as the whole fp32 model with CRISP applied in the same configuration."""
    from crisp_kernels import cpu_native

    if not cpu_native.available():
        pytest.skip("the native CPU kernel does not build here")
    ids = list(range(40, 40 + 24))
    timed = peer_engines.CrispEngine(TINY, TINY_PACK, 1, 64, precision="q8-dense8")
    assert timed.handle is not None and timed.model.model.layers[0].mlp.experts.gate_up_proj.device.type == "meta"
    reference = peer_engines.CrispEngine(TINY, TINY_PACK, 1, 64, reference=True, precision="q8-dense8")
    assert reference.reference_done()["applied"]
    for width in ("full", "plan"):
        got, want = (engine.run(ids, 16, width, logits=True) for engine in (timed, reference))
        assert got["logits"] == want["logits"], width
    assert timed.stats()["cpu"]["placement"] == reference.stats()["cpu"]["placement"] == "cpu_only"
    assert timed.stats()["dense"]["chosen"] == reference.stats()["dense"]["chosen"] == "q8"


def test_breakdown_times_the_native_calls_then_the_step_without_them_and_puts_them_back():
    """The breakdown's parts add up to its step, the native dense layers are timed (the default swaps attention's
    layers and the lm head), the step with the native calls skipped is timed too, and afterwards the engine
    computes what it did before (the kernels restored, the timing hooks removed)."""
    from crisp_kernels import cpu_native

    if not cpu_native.available():
        pytest.skip("the native CPU kernel does not build here")
    ids = list(range(40, 40 + 24))
    engine = peer_engines.CrispEngine(TINY, TINY_PACK, 1, 64, precision="q8-dense8")
    before = engine.run(ids, 16, "full", logits=True)["logits"]
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in engine.model.modules())
    got = engine.breakdown(ids, 16, "full")
    assert got["tokens"] == 8 and got["kernel_calls_per_token"] > 0
    assert got["kernel_s"] > 0 and got["dense_kernel_s"] > 0 and got["floor_step_s"] > 0
    # only the timed decode's calls are counted, not a prompt's: per token and layer, the two routed experts (full
    # width) and attention's two dense calls (q, k and v as one; o); per token, the lm head's
    assert got["kernel_calls_per_token"] == 2 * got["layers"]
    assert got["dense_calls_per_token"] == 2 * got["layers"] + 1
    assert got["moe_outside_kernel_s"] > 0 and got["outside_native_s"] > 0
    assert got["outside_native_s"] == pytest.approx(got["step_s"] - got["kernel_s"] - got["dense_kernel_s"])
    assert got["cache_effect_s"] == pytest.approx(got["outside_native_s"] - got["floor_step_s"])
    assert got["step_s"] == pytest.approx(got["kernel_s"] + got["moe_outside_kernel_s"] + got["attention_s"]
                                          + got["lm_head_s"] + got["rest_s"])
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in engine.model.modules()) == hooks
    assert engine.run(ids, 16, "full", logits=True)["logits"] == before


def test_the_default_variant_is_what_applys_one_call_runs_on_a_cpu_model():
    """The records' CRISP default ("q8-dense8", run with serving="cpu_only", cpu="on" and the engine's
    configuration) is what ``apply(model, pack)`` with nothing else runs on a CPU model: the same placement, expert
    kernel and attention format, bitwise the same logits at the pack's widths."""
    from transformers import AutoModelForCausalLM

    from crisp_kernels import cpu_native
    from crisp_runtime import apply
    from crisp_runtime.storage.pack import load_pack

    if not cpu_native.available():
        pytest.skip("the native CPU kernel does not build here")
    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32, local_files_only=True).eval()
    pack = load_pack(TINY_PACK)
    ids = torch.arange(40, 64).unsqueeze(0)
    runs = {}
    for name, kwargs in (("default", {}),
                         ("peer", {"serving": "cpu_only", "cpu": "on", "gpu_budget": 1 << 20,
                                   "config": peer_engines.crisp_runtime_config("q8-dense8")})):
        handle = apply(model, pack, **kwargs)
        with torch.no_grad():
            st = handle.stats()
            runs[name] = (model(ids).logits, st["cpu"]["placement"], st["cpu"]["experts"]["impl"],
                          st["dense"]["chosen"], st["dense"]["layers"])
        if name == "peer":  # the engine drops the fp32 experts once packed (its serving footprint)
            with pytest.warns(UserWarning, match="not kept"):
                handle.restore()
        else:
            handle.restore()
    assert runs["default"][1:] == runs["peer"][1:] and runs["default"][1:4] == ("cpu_only", "native-q8", "q8")
    assert runs["default"][4] > 0
    assert torch.equal(runs["default"][0], runs["peer"][0])


# ---------------------------------------------------------------------------- outputs and the work folder


@pytest.mark.parametrize("where", ["TINY/x.json", "TINY/config.json", "CALIB", "WORK/large-mixtral-x/model.gguf",
                                   "DEFAULT_WORK/x.json"])
def test_json_is_never_written_onto_or_into_peers_inputs(where, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CRISP_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "work" / "large-mixtral-x").mkdir(parents=True)
    (tmp_path / "cache" / "peer").mkdir(parents=True)
    (tmp_path / "text.txt").write_text("def f(x):\n    return x\n" * 20)
    subs = {"TINY": TINY, "CALIB": str(peer.CALIB_TEXT), "WORK": str(tmp_path / "work"),
            "DEFAULT_WORK": str(tmp_path / "cache" / "peer")}
    head, _, tail = where.partition("/")
    path = subs[head] + (f"/{tail}" if tail else "")
    monkeypatch.setattr(cli, "_cmd_peer", lambda args: 0)  # nothing runs: the check comes before the work
    work = [] if head == "DEFAULT_WORK" else ["--work-dir", str(tmp_path / "work")]
    rc = cli.main(["peer", "--models", "tiny", "--text", str(tmp_path / "text.txt"), *work, "--json", path])
    err = capsys.readouterr().err
    assert rc == 2 and f"--json {path}: " in err and "input" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("kind, needle", [("file", "exists and is not a folder"),
                                          ("no-parent", "its parent folder")])
def test_work_dir_must_be_a_folder_with_an_existing_parent(kind, needle, tmp_path, monkeypatch, capsys):
    def no_run():
        raise pm.PeerUnavailable("the run went past the work folder's check")

    monkeypatch.setattr(pm, "require_peers", no_run)
    (tmp_path / "file").write_text("mine")
    work = tmp_path / ("file" if kind == "file" else "missing/deep")
    rc = cli.main(["peer", "--models", "tiny", "--work-dir", str(work)])
    err = capsys.readouterr().err
    assert rc == 2 and f"--work-dir {work}: {needle}" in err and err.count("\n") == 1, err
    assert (tmp_path / "file").read_text() == "mine" and not (tmp_path / "missing").exists()


@pytest.mark.parametrize("models, extra, needle", [
    ("tiny", ["--prompt", "500", "--tokens", "13"], "--prompt 500 + --tokens 13: model tiny takes at most 512"),
    ("tiny", ["--window", "600"], "--window 600: model tiny takes at most 512"),
    ("large,mixtral-layer", ["--prompt", "4000", "--tokens", "97"], "model large takes at most 4096"),
])
def test_lengths_beyond_a_models_positions_are_refused_before_any_build(models, extra, needle, tmp_path,
                                                                        monkeypatch, capsys):
    def no_run():
        raise pm.PeerUnavailable("the run went past the length check")

    monkeypatch.setattr(pm, "require_peers", no_run)
    rc = cli.main(["peer", "--models", models, "--work-dir", str(tmp_path / "work"), *extra])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and err.count("\n") == 1, err
    assert not (tmp_path / "work").exists()
    # at the limit the check passes
    at_limit = cli.build_parser().parse_args(["peer", "--models", models, "--prompt", "500", "--tokens", "12",
                                              "--window", "512"])
    assert peer._check_lengths(at_limit) is None


def test_only_the_quants_asked_for_are_built(monkeypatch, tmp_path):
    asked = []

    def gguf_files(model_dir, quants, root, *, threads, log):
        asked.append(tuple(quants))
        return {"F32": tmp_path / "f32.gguf", **{q: tmp_path / f"{q}.gguf" for q in quants}}

    monkeypatch.setattr(pm, "gguf_files", gguf_files)
    inputs = peer.prepare("tiny", tmp_path, 1, ["Q4_0"], log=lambda *_: None)
    assert asked == [("Q4_0",)] and set(inputs.ggufs) == {"F32", "Q4_0"} and inputs.base == "F32"


def test_a_worker_that_cannot_load_a_cached_gguf_names_the_folder_to_delete(tmp_path):
    pytest.importorskip("llama_cpp")
    folder = tmp_path / "tiny-mixtral-gguf-Q4_0-0123456789abcdef"
    folder.mkdir()
    (folder / "model.gguf").write_bytes(b"GGUF" + b"\0" * 60)  # damaged: a header and nothing else
    with pytest.raises(peer.PeerBenchError) as exc:
        peer.Worker({"engine": "llama.cpp", "gguf": str(folder / "model.gguf"), "quant": "Q4_0", "threads": 1,
                     "n_ctx": 16})
    msg = str(exc.value)
    assert "\n" not in msg and f"delete its folder {folder}" in msg and "Traceback" not in msg, msg
