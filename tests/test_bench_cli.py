"""crisp-bench: every subcommand on tiny inputs writes well-formed JSON; bad input exits 2 without a traceback."""

import json
import subprocess
import sys

import pytest
import torch
from crisp_bench import traces as tr
from crisp_bench.cli import main

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A random 2-layer Mixtral (H 64, I 128, 8 experts, top-2), its pack and a plan from its own routing."""
    transformers = pytest.importorskip("transformers")
    from crisp_runtime.storage.pack import model_info, pack_model, save_pack

    root = tmp_path_factory.mktemp("bench-model")
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=512)
    model = transformers.MixtralForCausalLM(cfg).eval()
    model.save_pretrained(root / "tiny")
    seqs = torch.randint(32, 127, (2, 64), generator=torch.Generator().manual_seed(0))
    trace = tr.record_trace(model, seqs, source="random bytes")
    info = {k: v for k, v in model_info(model).items() if k in ("model_type", "num_hidden_layers", "top_k")}
    save_pack(root / "tiny-crisp", pack_model(model), plan=tr.plan_from_trace(trace), info=info)
    text = root / "text.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 40)
    trace.save(root / "trace.npz")
    return root


def _json(path):
    doc = json.loads(path.read_text())
    assert doc["format"] == "crisp-bench" and doc["version"] == 1 and "environment" in doc
    assert isinstance(doc["records"], list) and doc["records"]
    return doc


def cpu_native_available() -> bool:
    from crisp_kernels import cpu_native

    return cpu_native.available()


def test_simulate_synthetic_trace(tmp_path, capsys):
    trace = tr.synthetic_trace(num_layers=4, num_tokens=96, intermediate_size=256)
    trace.save(tmp_path / "t.npz")
    out = tmp_path / "sim.json"
    rc = main(["simulate", "--trace", str(tmp_path / "t.npz"), "--plan", "auto", "--warmup", "16",
               "--json", str(out), "--plot", str(tmp_path / "sim.png")])
    assert rc == 0
    doc = _json(out)
    policies = {r["policy"] for r in doc["records"]}
    assert policies == {"full", "uniform", "skip_aux", "crisp"}
    for r in doc["records"]:
        assert r["tokens_per_s"] > 0 and r["bytes_per_token"] >= 0 and r["order"] in ("serial", "router",
                                                                                         "widest_first")
    by = {(r["policy"], r["order"]): r for r in doc["records"]}
    for p in policies:  # Johnson's order is optimal for each step, so never slower than router order
        assert by[p, "widest_first"]["tokens_per_s"] >= by[p, "router"]["tokens_per_s"] * (1 - 1e-12)
        assert by[p, "router"]["tokens_per_s"] >= by[p, "serial"]["tokens_per_s"] * (1 - 1e-12)
    assert (tmp_path / "sim.png").stat().st_size > 0
    assert "paper's MoE layer" in capsys.readouterr().out


def test_simulate_budget_sweep_native(tmp_path):
    trace = tr.synthetic_trace(num_layers=2, num_tokens=48)
    trace.save(tmp_path / "t.npz")
    out = tmp_path / "sweep.json"
    rc = main(["simulate", "--trace", str(tmp_path / "t.npz"), "--plan", "auto", "--target", "native",
               "--budget-sweep", "--orders", "widest_first", "--policies", "full,crisp", "--warmup", "8",
               "--json", str(out), "--plot", str(tmp_path / "sweep.png")])
    assert rc == 0
    recs = _json(out)["records"]
    assert len({r["budget_fraction"] for r in recs}) >= 5
    full = sorted((r["budget_fraction"], r["bytes_per_token"]) for r in recs if r["policy"] == "full")
    assert full[0][1] >= full[-1][1]  # more memory, fewer bytes copied


def test_simulate_records_and_replays_a_model(tiny_model, tmp_path):
    out, trace = tmp_path / "s.json", tmp_path / "rec.npz"
    rc = main(["simulate", "--model", str(tiny_model / "tiny"), "--text", str(tiny_model / "text.txt"),
               "--sequences", "2", "--seq-len", "32", "--warmup", "8", "--record-trace", str(trace),
               "--json", str(out), "--threads", "1"])
    assert rc == 0 and _json(out)["records"]
    assert tr.Trace.load(trace).num_tokens == 64


def test_e2e(tiny_model, tmp_path):
    out = tmp_path / "e2e.json"
    rc = main(["e2e", "--model", str(tiny_model / "tiny"), "--text", str(tiny_model / "text.txt"), "--tokens", "8",
               "--policies", "full,crisp", "--json", str(out), "--threads", "1"])
    assert rc == 0
    recs = _json(out)["records"]
    assert {r["policy"] for r in recs} >= {"full", "crisp"}
    for r in recs:
        assert r["tokens_per_s"] > 0 and 0 <= r["accuracy"] <= 1


def test_layer(tiny_model, tmp_path):
    out = tmp_path / "layer.json"
    rc = main(["layer", "--model", str(tiny_model / "tiny"), "--text", str(tiny_model / "text.txt"), "--steps", "2",
               "--policies", "full,crisp", "--json", str(out), "--threads", "1"])
    assert rc == 0
    recs = _json(out)["records"]
    assert {(r["policy"], r["order"]) for r in recs} == {(p, o) for p in ("full", "crisp")
                                                         for o in ("serial", "router", "widest_first")}


def test_simulate_compare_with_e2e(tiny_model, tmp_path):
    """e2e --default decodes what apply runs given only the budget (crisp-default, its serving choice recorded);
    its trace holds the next-layer predictions that choice's prefetch reads, so the simulator predicts the same
    record and --compare sets the two side by side."""
    e2e = tmp_path / "e2e.json"
    assert main(["e2e", "--model", str(tiny_model / "tiny"), "--text", str(tiny_model / "text.txt"), "--tokens", "8",
                 "--policies", "full,crisp", "--default", "--json", str(e2e), "--threads", "1",
                 "--record-trace", str(tmp_path / "e2e.npz")]) == 0
    default = next(r for r in _json(e2e)["records"] if r["policy"] == "crisp-default")
    assert default["tokens_per_s"] > 0 and 0 <= default["accuracy"] <= 1 and default["serving"]
    assert tr.Trace.load(tmp_path / "e2e.npz").predicted is not None
    out = tmp_path / "s.json"
    assert main(["simulate", "--trace", str(tmp_path / "e2e.npz"), "--plan", str(tiny_model / "tiny-crisp"),
                 "--target", "native", "--warmup", "2", "--compare", str(e2e), "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["comparison"]
    assert {r["policy"] for r in rows} == {"full", "crisp", "crisp-default"} and all("error" in r for r in rows)


def test_transfer_and_measured_profile(tmp_path, monkeypatch):
    out, prof = tmp_path / "tr.json", tmp_path / "prof.json"
    rc = main(["transfer", "--shapes", "tiny", "--widths", "0.5,1.0", "--repeats", "1", "--json", str(out),
               "--profile-out", str(prof), "--threads", "1"])
    assert rc == 0
    assert any(r["kind"] == "load" for r in _json(out)["records"])
    saved = json.loads(prof.read_text())
    if saved.get("cpu_bytes_per_s") is not None:  # the CPU side measured: its per-step handoff too
        assert 0 < saved["join_s"] < 0.1
    trace = tr.synthetic_trace(num_layers=2, num_tokens=24)
    trace.save(tmp_path / "t.npz")
    rc = main(["simulate", "--trace", str(tmp_path / "t.npz"), "--plan", "auto", "--profile", "measured",
               "--profile-file", str(prof), "--target", "native", "--warmup", "4", "--json", str(tmp_path / "s.json")])
    assert rc == 0


def test_kernels_subcommand_runs_or_says_why(tmp_path, capsys):
    out = tmp_path / "k.json"
    rc = main(["kernels", "--quick", "--shapes", "tiny", "--widths", "1.0", "--tokens", "1", "--json", str(out)])
    if rc == 0:
        _json(out)
    else:  # the kernels sweep is another engineer's module; without it the message is clean
        assert rc == 2 and "kernels" in capsys.readouterr().err


@pytest.mark.parametrize("argv, needle", [
    (["simulate", "--profile", "gtx480"], "unknown profile"),
    (["simulate", "--policies", "full,fastest"], "fastest"),
    (["simulate", "--trace", "/nonexistent.npz"], "no such trace"),
    (["simulate", "--budget", "0.003", "--trace", "TRACE", "--plan", "auto"], "one full-width expert"),
    (["simulate", "--trace", "TRACE", "--plan", "auto", "--plot", "/no/such/folder/x.png"], "does not exist"),
    (["e2e", "--model", "MODELDIR"], "no CRISP pack"),
    (["e2e", "--model", "/nonexistent"], "not a transformers checkpoint"),
    (["transfer", "--shapes", "huge"], "unknown shape"),
    (["layer", "--model", "MODELDIR"], "no CRISP pack"),
])
def test_bad_input_exit_2(argv, needle, tmp_path, capsys, tiny_model):
    trace = tr.synthetic_trace(num_layers=2, num_tokens=24)
    trace.save(tmp_path / "t.npz")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((tiny_model / "tiny" / "config.json").read_text())
    argv = [str(tmp_path / "t.npz") if a == "TRACE" else str(bare) if a == "MODELDIR" else a for a in argv]
    with pytest.raises(SystemExit) if needle == "fastest" else _nullcontext() as exc:
        rc = main(argv)
    if needle == "fastest":
        assert exc.value.code == 2
        assert "fastest" in capsys.readouterr().err
        return
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and "Traceback" not in err


@pytest.mark.parametrize("command", ["layer", "e2e"])
def test_a_pack_of_another_model_is_refused(command, tiny_model, tmp_path, capsys):
    from crisp_bench.common import REPO_ROOT

    other = REPO_ROOT / "models" / "tiny-deepseek-crisp"
    rc = main([command, "--model", str(tiny_model / "tiny"), "--pack", str(other), "--text",
               str(tiny_model / "text.txt"), "--json", str(tmp_path / "out.json")])
    err = capsys.readouterr().err
    assert rc == 2 and f"{command}: error: {other}: this CRISP pack was made for another model: " in err, err
    assert err.count("error:") == 1 and "Traceback" not in err and not (tmp_path / "out.json").exists()


def test_kernels_refuses_a_shape_larger_than_the_machine_before_allocating(tmp_path, capsys, monkeypatch):
    from crisp_bench import kernels

    monkeypatch.setattr(kernels, "copy_bandwidth_gbps", lambda *a, **k: pytest.fail("the sweep started"))
    rc = main(["kernels", "--shapes", "tiny,100000000x100000000", "--quick", "--json", str(tmp_path / "k.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "kernels: error: --shapes 100000000x100000000: one expert of H=100000000 x I=100000000 " in err
    assert "GB for the sweep" in err and "cpu has" in err and err.count("\n") == 1, err
    assert not (tmp_path / "k.json").exists()
    with pytest.raises(ValueError, match="shape 100000000x100000000: one expert .* needs about"):
        kernels.run_kernel_sweep(["100000000x100000000"], device="cpu")


@pytest.mark.parametrize("model, needle", [("none", "not a transformers checkpoint"), ("bare", "no CRISP pack")])
def test_default_suite_checks_model_before_any_step(model, needle, tmp_path, capsys, monkeypatch, tiny_model):
    from crisp_bench import cli

    for step in ("_cmd_transfer", "_cmd_kernels", "_cmd_layer", "_cmd_e2e", "_cmd_simulate"):
        monkeypatch.setattr(cli, step, lambda args: pytest.fail("a step of the suite ran"))
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text((tiny_model / "tiny" / "config.json").read_text())
    rc = main(["--model", str(tmp_path / model)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"crisp-bench: error: --model {tmp_path / model}: {needle}"), err
    assert err.count("\n") == 1


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_console_script_unknown_subcommand(capsys):
    proc = subprocess.run([sys.executable, "-m", "crisp_bench.cli", "frobnicate"], capture_output=True, text=True)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr and "Traceback" not in proc.stderr
    for sub in ("kernels", "transfer", "layer", "e2e", "simulate"):
        with pytest.raises(SystemExit) as exc:
            main([sub, "--help"])
        assert exc.value.code == 0
    assert "mixtral-8x7b" in capsys.readouterr().out


# ---------------------------------------------------------------------------- cpu --model, SIGTERM


@pytest.mark.parametrize("config, needle", [
    (None, "not a transformers checkpoint (no config.json)"),
    ("{not json", "config.json is not readable JSON"),
    ({"intermediate_size": None}, "has no 'intermediate_size'"),
    ({"hidden_size": "128"}, "'hidden_size' must be a positive integer, got '128'"),
    ({"intermediate_size": 0}, "'intermediate_size' must be a positive integer, got 0"),
    ({"num_experts_per_tok": 9}, "routes 9 of 8 experts"),
])
def test_cpu_model_that_is_not_a_checkpoint_exits_2(config, needle, tmp_path, capsys):
    from crisp_bench.common import DEFAULT_MODEL

    model = tmp_path / "model"
    model.mkdir()
    if isinstance(config, str):
        (model / "config.json").write_text(config)
    elif config is not None:
        cfg = json.loads((DEFAULT_MODEL / "config.json").read_text())
        cfg.update(config)
        cfg = {k: v for k, v in cfg.items() if v is not None}
        (model / "config.json").write_text(json.dumps(cfg))
    rc = main(["cpu", "--shapes", "tiny", "--widths", "1", "--tokens", "1", "--repeats", "1", "--model", str(model),
               "--json", str(tmp_path / "out.json")])
    err = capsys.readouterr().err
    assert rc == 2 and f"cpu: error: --model {model}: " in err and needle in err and err.count("\n") == 1, err
    assert not (tmp_path / "out.json").exists()


@pytest.mark.skipif(not cpu_native_available(), reason="the native CPU kernel does not build here")
@pytest.mark.parametrize("impl", ["auto", "native-q8", "native-fp32", "dequant-fp32,native-q8"])
def test_cpu_tokens_beyond_the_native_kernel_exit_2_before_any_work(impl, tmp_path, capsys):
    rc = main(["cpu", "--shapes", "tiny", "--widths", "1", "--tokens", "1,65", "--repeats", "1", "--impl", impl,
               "--json", str(tmp_path / "out.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "cpu: error: --tokens: native-" in err and "at most 64 tokens" in err and "got 65" in err, err
    assert err.count("\n") == 1 and "internal error" not in err
    assert not (tmp_path / "out.json").exists()


def test_tiny_shape_of_a_deepseek_checkpoint_is_its_routed_experts():
    from crisp_bench.common import REPO_ROOT
    from crisp_bench.shapes import resolve_shapes

    shape = resolve_shapes(["tiny"], REPO_ROOT / "models" / "tiny-deepseek")[0]
    # moe_intermediate_size 32 (intermediate_size 256 is the dense MLP's), 64 routed experts, top-6, 3 MoE layers
    assert (shape.name, shape.num_layers, shape.num_experts, shape.top_k, shape.hidden_size,
            shape.intermediate_size) == ("tiny-deepseek", 3, 64, 6, 128, 32)
    mixtral = resolve_shapes(["tiny"], REPO_ROOT / "models" / "tiny-mixtral")[0]
    assert (mixtral.name, mixtral.num_experts, mixtral.intermediate_size) == ("tiny-mixtral", 8, 256)


def test_cpu_help_names_what_auto_runs(capsys):
    with pytest.raises(SystemExit):
        main(["cpu", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "native-q8 with bf16, native-fp32 with fp32" in out and "native-fp32 where it builds" not in out


SIGTERM_CHILD = """
import os, signal, sys
from crisp_bench import cli

def work(args):
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        signal.pause()  # not reached when SIGTERM raises KeyboardInterrupt
    finally:
        open(sys.argv[1], "w").write("cleaned up")

cli._cmd_simulate = work
sys.exit(cli.main(["simulate"]))
"""


def test_sigterm_runs_the_cleanup_and_exits_as_ctrl_c(tmp_path):
    import signal

    marker = tmp_path / "finally-ran"
    proc = subprocess.run([sys.executable, "-c", SIGTERM_CHILD, str(marker)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 130 and "interrupted" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert marker.read_text() == "cleaned up"
    before = signal.getsignal(signal.SIGTERM)
    assert main(["report", "--check"]) == 0
    assert signal.getsignal(signal.SIGTERM) is before  # main puts the caller's handler back
