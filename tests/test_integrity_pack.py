"""Pack integrity: byte-identical saves, digests, value checks, the folder swap, the
binding of experts / plan / pack.json, loads that survive a rewritten file, the weights
fingerprint, and the ``crisp-pack verify`` command."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from runtime_helpers import random_layers

import crisp_runtime.storage.pack as pack_mod
from crisp_kernels import PackFormatError, QuantFormat, pack_expert, pack_layer
from crisp_kernels.io import DigestStatus, PackCheck, PackIntegrityError, read_packed, save_packed
from crisp_runtime import CrispPlan, PlanError, load_pack, save_pack, verify_pack
from crisp_runtime.storage.pack import FingerprintStatus, PackMismatchError, check_weights_fingerprint, weights_sha256

COMMITTED_PACK = Path(__file__).resolve().parents[1] / "models" / "tiny-mixtral-crisp"


def _plan(layers, width=8):
    first = next(iter(layers.values()))
    return CrispPlan.uniform(first.num_experts, 2, first.intermediate_size, sorted(layers), width)


@pytest.fixture
def layers():
    return random_layers()


@pytest.fixture(scope="module")
def old_pack(tmp_path_factory) -> Path:
    """The committed tiny-Mixtral pack as a pack written before digests: no ``tensor_sha256`` in the experts
    file's metadata and no ``files`` binding in pack.json (the two fields digests added), everything else as is."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("old") / "tiny-mixtral-crisp"
    shutil.copytree(COMMITTED_PACK, out)
    path = out / "experts.safetensors"
    with safe_open(str(path), "pt") as f:
        meta = {k: v for k, v in f.metadata().items() if k != "tensor_sha256"}
    save_file(load_file(str(path)), str(path), metadata=meta)
    info = json.loads((out / "pack.json").read_text())
    info.pop("files", None)
    (out / "pack.json").write_text(json.dumps(info, indent=1, sort_keys=True))
    return out


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _data_offset(path: Path, tensor: str) -> int:
    """Byte offset in the file of the first byte of ``tensor``."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return 8 + n + json.loads(raw[8 : 8 + n])[tensor]["data_offsets"][0]


def _poke(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


# ----------------------------------------------------------------------------- determinism, digests


def test_same_inputs_give_byte_identical_packs(tmp_path, layers):
    info = {"model_type": "mixtral", "b": 2, "a": {"z": 1, "y": 2}}
    save_pack(tmp_path / "one", layers, plan=_plan(layers), info=info)
    save_pack(tmp_path / "two", dict(reversed(list(layers.items()))), plan=_plan(layers),
              info=dict(reversed(list(info.items()))))
    assert _files(tmp_path / "one") == _files(tmp_path / "two")
    raw = (tmp_path / "one" / "experts.safetensors").read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    assert list(header) == sorted(header) and list(header["__metadata__"]) == sorted(header["__metadata__"])


@pytest.fixture
def stamps(tmp_path, monkeypatch) -> Path:
    """A cache folder of this test's own: where the digest stamps go."""
    monkeypatch.setenv("CRISP_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "verified"


@pytest.fixture
def stamp_at_once(monkeypatch):
    """Stamp files however recently they changed (the real minimum age, 3 s, guards a race these tests avoid by
    sleeping past a clock tick instead: an edit within the tick of the file's last change would not show)."""
    import crisp_kernels.io as io_mod

    monkeypatch.setattr(io_mod, "STAMP_MIN_AGE_S", 0)


def _past_a_tick() -> None:
    time.sleep(0.05)  # > the coarse clock's tick (1-10 ms) that file times are kept in


def test_digests_recorded_and_verified(tmp_path, layers, stamps):
    save_pack(tmp_path / "p", layers, plan=_plan(layers))
    result = verify_pack(tmp_path / "p")
    assert (result.tensors, result.binding) == (DigestStatus.VERIFIED, DigestStatus.VERIFIED)
    assert load_pack(tmp_path / "p", check=PackCheck.VALUES).digests is DigestStatus.NOT_CHECKED
    assert load_pack(tmp_path / "p", check=PackCheck.DIGESTS).digests is DigestStatus.VERIFIED
    # just written: the default verifies at every read, stamping nothing (an edit within the same mtime tick
    # would not show)
    assert load_pack(tmp_path / "p").digests is DigestStatus.VERIFIED
    assert not stamps.exists() or not list(stamps.iterdir())


def test_the_default_verifies_once_then_trusts_the_unchanged_file(tmp_path, layers, stamps, stamp_at_once,
                                                                   monkeypatch):
    import crisp_kernels.io as io_mod

    save_pack(tmp_path / "p", layers, plan=_plan(layers))
    assert load_pack(tmp_path / "p").digests is DigestStatus.VERIFIED
    assert len(list(stamps.iterdir())) == 1
    hashed = []
    real = io_mod.tensor_sha256
    monkeypatch.setattr(io_mod, "tensor_sha256", lambda t: hashed.append(1) or real(t))
    assert load_pack(tmp_path / "p").digests is DigestStatus.VERIFIED_BEFORE and not hashed
    assert load_pack(tmp_path / "p", check=PackCheck.DIGESTS).digests is DigestStatus.VERIFIED and hashed
    # a copy is another file: verified on its own
    shutil.copytree(tmp_path / "p", tmp_path / "copy")
    hashed.clear()
    assert load_pack(tmp_path / "copy").digests is DigestStatus.VERIFIED and hashed


@pytest.mark.parametrize("stamped", ["no", "edited", "times-put-back"])
def test_flipped_weight_bit_is_refused_by_the_default_load(tmp_path, layers, stamps, stamp_at_once, stamped):
    save_pack(tmp_path / "p", layers)
    path = tmp_path / "p" / "experts.safetensors"
    if stamped != "no":  # verified and stamped while intact, then edited in place (the same inode and size)
        assert load_pack(tmp_path / "p").digests is DigestStatus.VERIFIED
        _past_a_tick()
    before = os.stat(path)
    offset = _data_offset(path, "layers.1.qweight") + 5
    byte = path.read_bytes()[offset]
    _poke(path, offset, bytes([byte ^ 0x10]))
    if stamped == "times-put-back":  # as `cp -p` of a damaged backup or `touch -r` leave it: only ctime tells
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        assert os.stat(path).st_mtime_ns == before.st_mtime_ns
    # qweight values have no invalid bit pattern: only the digest sees it
    load_pack(tmp_path / "p", check=PackCheck.VALUES)
    match = r"experts.safetensors: tensor layers.1.qweight: sha256 differs"
    with pytest.raises(PackIntegrityError, match=match):
        load_pack(tmp_path / "p")
    with pytest.raises(PackIntegrityError, match=match):
        verify_pack(tmp_path / "p")


@pytest.mark.parametrize("damage", ["cache-is-a-file", "stamp-nested-too-deep"])
def test_a_broken_cache_only_means_verifying_every_time(tmp_path, layers, monkeypatch, stamp_at_once, damage):
    import crisp_kernels.io as io_mod

    blocker = tmp_path / "cache-is-a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("CRISP_CACHE_DIR", str(blocker if damage == "cache-is-a-file" else tmp_path / "cache"))
    save_pack(tmp_path / "p", layers)
    if damage == "stamp-nested-too-deep":
        stamp = io_mod._stamp_path(tmp_path / "p" / "experts.safetensors")
        stamp.parent.mkdir(parents=True)
        stamp.write_text("[" * 100_000)
        monkeypatch.setattr(io_mod, "_write_stamp", lambda *a: None)  # the broken stamp stays
    for _ in range(2):
        assert load_pack(tmp_path / "p").digests is DigestStatus.VERIFIED
    assert blocker.read_text() == "not a folder"


@pytest.mark.parametrize(
    "tensor, value, match",
    [("scales", b"\x00\x7e", r"layers.0.scales: 1 value\(s\) are NaN"),  # fp16 0x7e00 = NaN
     ("scales", b"\x00\x7c", r"layers.0.scales: 1 value\(s\) are NaN, infinite"),  # fp16 0x7c00 = inf
     ("scales", b"\x00\xbc", r"layers.0.scales: .* <= 0"),  # fp16 0xbc00 = -1
     ("zeros", b"\x10", "layers.0.zeros: zero point 16 is above 15")],
    ids=["nan-scale", "inf-scale", "negative-scale", "zero-point-16"],
)
def test_bad_payload_values_refused_at_load(tmp_path, layers, tensor, value, match):
    save_pack(tmp_path / "p", layers)
    path = tmp_path / "p" / "experts.safetensors"
    _poke(path, _data_offset(path, f"layers.0.{tensor}"), value)
    with pytest.raises(PackIntegrityError, match=match):
        load_pack(tmp_path / "p")


def test_old_pack_without_digests_loads_and_reports_unavailable(old_pack):
    assert verify_pack(COMMITTED_PACK).tensors is DigestStatus.VERIFIED  # the fixture removed what it checks
    pack = load_pack(old_pack, check=PackCheck.DIGESTS)
    assert pack.digests is DigestStatus.UNAVAILABLE and pack.plan is not None
    result = verify_pack(old_pack)
    assert (result.tensors, result.binding) == (DigestStatus.UNAVAILABLE, DigestStatus.UNAVAILABLE)


def test_save_refuses_payload_with_bad_values(tmp_path, layers):
    bad = layers[0]
    bad.scales.view(-1)[3] = float("nan")
    with pytest.raises(ValueError, match=r"layers\[0\].scales: 1 value\(s\) are NaN"):
        save_packed(tmp_path / "x.safetensors", layers)
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- pack_expert inputs


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("which", ["gate", "up", "down"])
def test_pack_expert_refuses_non_finite_weights(which, bad):
    w = {"gate": torch.randn(4, 64), "up": torch.randn(4, 64), "down": torch.randn(64, 4)}
    w[which][1, 2] = bad
    with pytest.raises(ValueError, match=f"{which}: 1 weight\\(s\\) are NaN or infinite"):
        pack_expert(w["gate"], w["up"], w["down"])


def test_pack_layer_refuses_non_finite_weights():
    gate_up, down = torch.randn(2, 8, 64), torch.randn(2, 64, 4)
    down[1, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="down_proj: 1 weight"):
        pack_layer(gate_up, down)


@pytest.mark.parametrize("fmt", ["int4-g64", 64, {"group_size": 64}])
def test_quant_format_must_be_a_quant_format(fmt):
    with pytest.raises(TypeError, match="fmt: expected a crisp_kernels.QuantFormat"):
        pack_expert(torch.randn(4, 64), torch.randn(4, 64), torch.randn(64, 4), fmt)
    with pytest.raises(TypeError, match="fmt: expected a crisp_kernels.QuantFormat"):
        pack_layer(torch.randn(2, 8, 64), torch.randn(2, 64, 4), fmt)


@pytest.mark.parametrize("kwargs, match", [(dict(group_size="64"), "group_size: expected int, got str"),
                                           (dict(group_size=True), "group_size: expected int, got bool"),
                                           (dict(symmetric="false"), "symmetric: expected bool, got str"),
                                           (dict(symmetric=0), "symmetric: expected bool, got int")])
def test_quant_format_field_types(kwargs, match):
    with pytest.raises(TypeError, match=match):
        QuantFormat(**kwargs)


# ----------------------------------------------------------------------------- the folder swap


def test_resave_swaps_the_whole_folder(tmp_path, layers):
    target = tmp_path / "p"
    save_pack(target, layers, plan=_plan(layers))
    new_layers = random_layers(seed=1)
    save_pack(target, new_layers)  # no plan: the old plan must not survive
    pack = load_pack(target)
    assert pack.plan is None and torch.equal(pack.layers[0].qweight, new_layers[0].qweight)
    assert sorted(p.name for p in target.iterdir()) == ["experts.safetensors", "pack.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p"]  # no staging or old folder left
    assert oct(target.stat().st_mode & 0o777) == oct(0o755)
    assert all(oct(p.stat().st_mode & 0o777) == oct(0o644) for p in target.iterdir())


def test_user_files_beside_a_pack_are_kept(tmp_path, layers):
    target = tmp_path / "model"
    target.mkdir()
    (target / "model.safetensors").write_bytes(b"the checkpoint")
    (target / "notes.txt").write_text("mine")
    save_pack(target, layers, plan=_plan(layers))
    save_pack(target, random_layers(seed=1), plan=_plan(layers, 4))
    save_pack(target, random_layers(seed=2))
    assert (target / "model.safetensors").read_bytes() == b"the checkpoint"
    assert (target / "notes.txt").read_text() == "mine"
    assert load_pack(target).plan is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_interrupted_save_keeps_the_old_pack(tmp_path, layers, monkeypatch):
    target = tmp_path / "p"
    save_pack(target, layers, plan=_plan(layers))
    before = _files(target)

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pack_mod, "commit_pack_folder", crash)
    with pytest.raises(KeyboardInterrupt):
        save_pack(target, random_layers(seed=1), plan=_plan(layers, 4))
    assert _files(target) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p"]


@pytest.mark.parametrize("foreign", [{"experts.safetensors": b"someone's"}, {"plan.json": b"{}"},
                                     {"pack.json": b'{"format": "other"}'}])
def test_foreign_pack_named_files_are_refused(tmp_path, layers, foreign):
    target = tmp_path / "d"
    target.mkdir()
    for name, data in foreign.items():
        (target / name).write_bytes(data)
    with pytest.raises(FileExistsError, match="refusing to overwrite"):
        save_pack(target, layers)
    assert _files(target) == foreign
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_save_onto_a_file_is_refused(tmp_path, layers):
    (tmp_path / "f").write_text("x")
    with pytest.raises(FileExistsError, match="not a folder"):
        save_pack(tmp_path / "f", layers)


@pytest.mark.parametrize("swap", ["experts.safetensors", "plan.json"])
def test_files_from_different_saves_are_refused(tmp_path, layers, swap):
    """A torn save (new experts with the old plan or pack.json) must not load."""
    save_pack(tmp_path / "a", layers, plan=_plan(layers, 8))
    save_pack(tmp_path / "b", random_layers(seed=1), plan=_plan(layers, 4))
    shutil.copyfile(tmp_path / "b" / swap, tmp_path / "a" / swap)
    with pytest.raises(PackIntegrityError, match=f"{swap} is not the one pack.json records; the files are from "
                                                 f"different saves"):
        load_pack(tmp_path / "a")


def test_plan_added_to_a_planless_pack_is_refused(tmp_path, layers):
    save_pack(tmp_path / "a", layers)
    _plan(layers).save(tmp_path / "a" / "plan.json")
    with pytest.raises(PackIntegrityError, match="plan.json is present but pack.json records a pack without a plan"):
        load_pack(tmp_path / "a")


# ----------------------------------------------------------------------------- plan.json that is not a file


@pytest.mark.parametrize("kind", ["directory", "dangling-symlink"])
def test_plan_path_that_is_not_a_file_is_an_error(tmp_path, layers, kind):
    save_pack(tmp_path / "p", layers)
    plan_path = tmp_path / "p" / "plan.json"
    if kind == "directory":
        plan_path.mkdir()
    else:
        plan_path.symlink_to(tmp_path / "nowhere.json")
    with pytest.raises(PlanError, match="plan.json: (not a regular file|a dangling symbolic link)"):
        CrispPlan.load(plan_path)
    with pytest.raises((PlanError, PackIntegrityError), match="plan.json"):
        load_pack(tmp_path / "p")


def test_old_pack_with_plan_directory_is_an_error(tmp_path, old_pack):
    """Without the pack.json binding (an old pack), a plan.json folder is still refused, not ignored."""
    shutil.copytree(old_pack, tmp_path / "old")
    (tmp_path / "old" / "plan.json").unlink()
    (tmp_path / "old" / "plan.json").mkdir()
    with pytest.raises(PlanError, match="plan.json: not a regular file"):
        load_pack(tmp_path / "old")


# ----------------------------------------------------------------------------- no mmap: rewrite after load


def test_rewriting_the_file_after_load_does_not_touch_loaded_tensors(tmp_path, layers):
    """Loaded tensors are not memory-mapped: truncating a mapped file in place would kill the process (SIGBUS)."""
    save_pack(tmp_path / "p", layers)
    path = tmp_path / "p" / "experts.safetensors"
    pack = load_pack(tmp_path / "p")
    size = path.stat().st_size
    with open(path, "r+b") as f:  # in place: same inode, as `cp` or a careless tool would do
        f.truncate(0)
        f.write(b"\0" * size)
    for idx, layer in layers.items():
        for name, t in layer.tensors().items():
            assert torch.equal(pack.layers[idx].tensors()[name], t), (idx, name)


def test_loaded_tensors_own_their_memory(tmp_path, layers):
    save_packed(tmp_path / "x.safetensors", layers)
    loaded = read_packed(tmp_path / "x.safetensors").layers
    loaded[0].qweight.add_(1)  # writable and private: a mmap'd read-only buffer would refuse or leak
    assert not torch.equal(loaded[0].qweight, layers[0].qweight)


# ----------------------------------------------------------------------------- weights fingerprint


@pytest.fixture(scope="module")
def tiny_model():
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=64, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                           num_experts_per_tok=2, max_position_embeddings=32)
    return MixtralForCausalLM(config).eval()


def test_weights_fingerprint(tmp_path, tiny_model):
    from crisp_runtime.hf.moe_layers import find_moe_layers
    from crisp_runtime.storage.pack import pack_model

    refs = find_moe_layers(tiny_model)
    digest = weights_sha256(refs)
    info = {"model": {"weights_sha256": digest}}
    save_pack(tmp_path / "p", pack_model(tiny_model), info=info)
    pack = load_pack(tmp_path / "p")
    assert check_weights_fingerprint(pack, tiny_model) is FingerprintStatus.MATCH
    assert check_weights_fingerprint({}, tiny_model) is FingerprintStatus.NOT_RECORDED
    other = {"model": {"weights_sha256": "0" * 64}}
    with pytest.raises(PackMismatchError, match="made from other weights than this model.*allow_mismatch=True"):
        check_weights_fingerprint(other, tiny_model)
    assert check_weights_fingerprint(other, tiny_model, allow_mismatch=True) is FingerprintStatus.MISMATCH_ALLOWED
    original = refs[0].module.gate_up_proj[0, 0, 0].item()
    with torch.no_grad():  # the same architecture, other weights
        refs[0].module.gate_up_proj[0, 0, 0] = original + 1.0
    try:
        with pytest.raises(PackMismatchError, match="other weights"):
            check_weights_fingerprint(pack, tiny_model)
    finally:
        with torch.no_grad():
            refs[0].module.gate_up_proj[0, 0, 0] = original
    assert weights_sha256(refs) == digest


def test_pack_json_edits_are_blamed_on_pack_json_and_mismatches_name_the_pack(tmp_path):
    import re

    from transformers import AutoModelForCausalLM

    from crisp_runtime import apply, load_model

    checkpoint = COMMITTED_PACK.parent / "tiny-mixtral"
    pack = tmp_path / "pack"
    shutil.copytree(COMMITTED_PACK, pack)
    info = json.loads((pack / "pack.json").read_text())
    where = re.escape(str(pack))

    (pack / "pack.json").write_text(json.dumps({**info, "top_k": 3}))
    with pytest.raises(PlanError, match=f"{where}/pack.json: top_k 3 differs from the plan's, 2 in {where}/plan.json"):
        load_pack(pack)

    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    (pack / "pack.json").write_text(json.dumps({**info, "model_type": "llama"}))
    with pytest.raises(PackMismatchError, match=f"{where}: this CRISP pack was made for another model: model_type"):
        apply(model, pack)

    (pack / "pack.json").write_text(json.dumps({**info, "model": {**info["model"], "weights_sha256": "0" * 64}}))
    other = (f"{where}: this CRISP pack was made from other weights than this model \\(weights fingerprint "
             "000000000000\\.\\.\\. in pack.json, [0-9a-f]{12}\\.\\.\\. in the model; .*another dtype.*\\); "
             "pass allow_weights_mismatch=True")
    with pytest.raises(PackMismatchError, match=other):
        apply(model, pack)
    with pytest.raises(PackMismatchError, match=other):
        load_model(checkpoint, pack)
    assert model.get_experts_implementation() != "crisp"


def test_weights_fingerprint_is_the_one_crisp_profile_records(tiny_model):
    from crisp_runtime.hf.moe_layers import find_moe_layers
    from tools.calibration import model_fingerprint

    refs = find_moe_layers(tiny_model)
    assert model_fingerprint(tiny_model, refs)["weights_sha256"] == weights_sha256(refs)


# ----------------------------------------------------------------------------- crisp-pack verify


def test_verify_command(tmp_path, layers, old_pack, capsys):
    save_pack(tmp_path / "good", layers, plan=_plan(layers))
    assert pack_mod.main(["verify", str(tmp_path / "good"), str(old_pack)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"ok: {tmp_path / 'good'}: 2 layers, a plan; tensor digests: verified")
    assert "tensor digests: unavailable" in out[1]
    shutil.copytree(tmp_path / "good", tmp_path / "bad")
    path = tmp_path / "bad" / "experts.safetensors"
    offset = _data_offset(path, "layers.0.qweight") + 1
    _poke(path, offset, bytes([path.read_bytes()[offset] ^ 0x01]))
    assert pack_mod.main(["verify", str(tmp_path / "bad")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "sha256 differs" in err and err.count("\n") == 1
    assert pack_mod.main(["verify", str(tmp_path / "missing")]) == 2
    assert "error: CRISP pack folder not found" in capsys.readouterr().err


def test_verify_module_entry_point(tmp_path, layers, monkeypatch, capsys):
    """``python -m crisp_runtime verify DIR`` (run in-process: a subprocess would re-import torch)."""
    import runpy
    import sys

    save_pack(tmp_path / "p", layers)
    monkeypatch.setattr(sys, "argv", ["crisp_runtime", "verify", str(tmp_path / "p")])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("crisp_runtime", run_name="__main__")
    assert exit_info.value.code == 0 and capsys.readouterr().out.startswith("ok: ")


def test_pack_json_info_with_bad_types_is_refused(tmp_path, layers):
    save_pack(tmp_path / "p", layers)
    info = json.loads((tmp_path / "p" / "pack.json").read_text())
    info["num_experts"] = True  # == 1 in Python; must not pass as an integer
    (tmp_path / "p" / "pack.json").write_text(json.dumps(info))
    with pytest.raises(PackFormatError, match="pack.json: field num_experts is True"):
        load_pack(tmp_path / "p")


def test_tools_verify_digests_when_loading_a_pack(tmp_path, layers):
    """crisp-eval and evidence read packs through load_pack_dir, which checks every tensor digest."""
    from tools.calibration import CliError, load_pack_dir

    save_pack(tmp_path / "p", layers, plan=_plan(layers))
    assert sorted(load_pack_dir(tmp_path / "p")[0]) == [0, 1]
    path = tmp_path / "p" / "experts.safetensors"
    offset = _data_offset(path, "layers.0.qweight") + 7
    _poke(path, offset, bytes([path.read_bytes()[offset] ^ 0x80]))
    with pytest.raises(CliError, match="tensor layers.0.qweight: sha256 differs"):
        load_pack_dir(tmp_path / "p")


def test_save_through_a_link_replaces_the_folder_it_names(tmp_path, layers):
    real = tmp_path / "real"
    save_pack(real, layers)
    (tmp_path / "link").symlink_to(real)
    new_layers = random_layers(seed=3)
    assert save_pack(tmp_path / "link", new_layers) == tmp_path / "link"
    assert (tmp_path / "link").is_symlink() and (tmp_path / "link").resolve() == real.resolve()
    assert torch.equal(load_pack(real).layers[1].scales, new_layers[1].scales)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="dangling symbolic link"):
        save_pack(tmp_path / "dangling", layers)
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("native", [True, False], ids=["renameat2", "two-renames"])
def test_exchange_folders(tmp_path, monkeypatch, native):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("from a")
    (b / "y").write_text("from b")
    if not native:  # a system without renameat2: the fallback through a third name
        monkeypatch.setattr(pack_mod.ctypes, "CDLL", lambda *args, **kwargs: object())
    pack_mod.exchange_folders(a, b)
    assert [p.name for p in a.iterdir()] == ["y"] and [p.name for p in b.iterdir()] == ["x"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


@pytest.mark.parametrize("info", [{"when": object()}, {1: "a", "b": 2}])
def test_info_must_be_json(tmp_path, layers, info):
    with pytest.raises(TypeError, match="info: must be JSON-serializable"):
        save_pack(tmp_path / "p", layers, info=info)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("device", ["foo", "cuda:99" if torch.cuda.is_available() else "cuda", 3.5])
def test_bad_load_device(tmp_path, layers, device):
    save_pack(tmp_path / "p", layers)
    with pytest.raises(ValueError, match="device: "):
        load_pack(tmp_path / "p", device=device)


def test_apply_and_load_model_refuse_a_pack_whose_weights_were_edited(tmp_path, stamps):
    transformers = pytest.importorskip("transformers")
    from crisp_runtime import apply, load_model

    root = Path(__file__).resolve().parents[1]
    if not (root / "models" / "tiny-mixtral" / "config.json").is_file():
        pytest.skip("committed tiny model absent")
    shutil.copytree(root / "models" / "tiny-mixtral-crisp", tmp_path / "pack")
    path = tmp_path / "pack" / "experts.safetensors"
    offset = _data_offset(path, "layers.0.qweight")
    _poke(path, offset, bytes(b ^ 0xFF for b in path.read_bytes()[offset:offset + 64]))
    model = transformers.AutoModelForCausalLM.from_pretrained(root / "models" / "tiny-mixtral")
    match = "tensor layers.0.qweight: sha256 differs"
    with pytest.raises(PackIntegrityError, match=match):
        apply(model, tmp_path / "pack", gpu_budget="25%")
    with pytest.raises(PackIntegrityError, match=match):
        load_model(root / "models" / "tiny-mixtral", tmp_path / "pack", gpu_budget="25%")


def test_a_pack_json_stripped_of_its_files_record_is_refused(tmp_path, layers):
    save_pack(tmp_path / "p", layers, plan=_plan(layers))
    info_path = tmp_path / "p" / "pack.json"
    info = json.loads(info_path.read_text())
    info.pop("files")
    info_path.write_text(json.dumps(info, indent=1, sort_keys=True))
    # the experts file records tensor digests, so its writer also recorded the files: pack.json was edited
    for read in (load_pack, verify_pack):
        with pytest.raises(PackIntegrityError, match="has no 'files' record.*pack.json was edited"):
            read(tmp_path / "p")
