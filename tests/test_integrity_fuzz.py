"""Table-driven fuzz of the pack and plan loaders.

Every case corrupts one thing in a valid pack (truncations and flipped bytes of
experts.safetensors, each header field of it, each field of pack.json and plan.json, broken
JSON) and checks the one acceptable outcome:

- a refusal: PlanError or a PackFormatError subclass (never a raw KeyError / TypeError /
  struct or JSON error), whose message names the file and, for a field mutation, the field; or
- for a byte flip that leaves every structural and value check intact (a weight nibble): a
  load, then ``verify_pack`` refusing it by digest; or
- for the few documented lenient cases (an optional field null or absent, the digests of an
  old pack absent): a load whose contents are exactly what the file says (no coercion:
  ``true`` is never 1, ``40.9`` never 40).

Each test loops over its cases and reports every failing one at once; ``CASE_COUNTS`` is
checked at the end so that the campaign cannot shrink silently.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from runtime_helpers import random_layers

from crisp_kernels import PackFormatError
from crisp_kernels.io import read_packed
from crisp_runtime import CrispPlan, PlanError, load_pack, save_pack, verify_pack
from crisp_runtime.planning.plan import LayerPlan, Tier, TierWidths

REFUSALS = (PackFormatError, PlanError)
# Wrong values tried at every JSON field.
WRONG_VALUES = [None, True, False, 40.9, "40", "x", -1, 0, 10**6, [], {}, [1, 2], {"a": 1}]
REMOVED = object()
SKIP = "skip"  # a mutation that changes nothing (the original value), not counted
CASE_COUNTS: dict[str, int] = {}


def _layers():
    return random_layers(layer_ids=(0, 1), num_experts=4, inter=8, hidden=64)


def _crisp_plan() -> CrispPlan:
    layers = {0: LayerPlan({(0, 1): Tier.HOT, (1, 2): Tier.COLD, (2, 3): Tier.WARM}, {(0, 1): 1}),
              1: LayerPlan({(0, 3): Tier.WARM}, {})}
    return CrispPlan.crisp(4, 2, 8, layers, TierWidths(8, 4, 0), description="fuzz")


@pytest.fixture(scope="module")
def good_pack(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fuzz")
    save_pack(root / "good", _layers(), plan=_crisp_plan(), info={"model_type": "mixtral", "num_hidden_layers": 2})
    return root / "good"


_ORIGINALS: dict[Path, dict[str, bytes]] = {}


def _fresh(good: Path, name: str, mutated: str) -> Path:
    """``good`` copied to a sibling ``name`` once; on later calls only the file a case mutates is
    restored (file writes dominate the campaign's time on a slow disk)."""
    target = good.parent / name
    originals = _ORIGINALS.setdefault(good, {p.name: p.read_bytes() for p in good.iterdir()})
    if not target.is_dir():
        target.mkdir()
        for fname, data in originals.items():
            (target / fname).write_bytes(data)
        return target
    path = target / mutated
    if path.is_symlink():
        path.unlink()
    elif path.is_dir():
        path.rmdir()
    path.write_bytes(originals[mutated])
    return target


def _refused(exc: BaseException, path: Path, field: str | None) -> str | None:
    """None if ``exc`` is an acceptable refusal, else what is wrong with it."""
    if not isinstance(exc, REFUSALS):
        return f"raised {type(exc).__name__}: {exc}"
    msg = str(exc)
    if path.name not in msg:
        return f"message does not name {path.name}: {msg}"
    if field is not None and field not in msg:
        return f"message does not name the field {field!r}: {msg}"
    return None


def _check_all(category: str, cases, run) -> None:
    """Run ``run(case) -> problem or None`` on every case; fail with every problem found."""
    problems = []
    tried = 0
    for case in cases:
        try:
            problem = run(case)
        except Exception as exc:  # noqa: BLE001 - anything unexpected is a finding of the campaign
            problem = f"harness crashed: {type(exc).__name__}: {exc}"
        if problem == SKIP:
            continue
        tried += 1
        if problem:
            problems.append(f"{case!r:.120}: {problem}")
    CASE_COUNTS[category] = tried
    assert not problems, f"{len(problems)} of {tried} {category} cases failed:\n" + "\n".join(problems[:20])


# ----------------------------------------------------------------------------- experts.safetensors bytes


def _header_len(raw: bytes) -> int:
    return int.from_bytes(raw[:8], "little")


def test_truncated_and_flipped_experts_file(good_pack):
    raw = (good_pack / "experts.safetensors").read_bytes()
    n = _header_len(raw)
    size = len(raw)
    cuts = sorted({0, 1, 7, 8, 9, 8 + n // 2, 8 + n - 1, 8 + n, 8 + n + 1, (8 + n + size) // 2, size - 1})
    rng = random.Random(8)
    flips = sorted({*rng.sample(range(8 + n), 40), *rng.sample(range(8 + n, size), 40), 0, 3, 7})
    cases = [("cut", c) for c in cuts] + [("flip", p, m) for p in flips for m in (0x01, 0xFF)]
    cases += [("length", v) for v in (0, 1, n - 1, n + 1, size, 2**63)]

    def run(case):
        target = _fresh(good_pack, "bytes", "experts.safetensors")
        path = target / "experts.safetensors"
        data = bytearray(raw)
        if case[0] == "cut":
            data = data[: case[1]]
        elif case[0] == "flip":
            data[case[1]] ^= case[2]
        else:
            data[:8] = case[1].to_bytes(8, "little")
        path.write_bytes(bytes(data))
        try:
            load_pack(target)
        except Exception as exc:  # noqa: BLE001
            return _refused(exc, path, None)
        # Loaded: only a flip inside the tensor data may pass the structural checks, and the
        # digest check must then refuse it.
        if case[0] != "flip" or case[1] < 8 + n:
            return "loaded silently"
        try:
            verify_pack(target)
        except Exception as exc:  # noqa: BLE001
            return _refused(exc, path, "sha256")
        return "verify_pack passed a flipped byte"

    _check_all("experts-bytes", cases, run)


# ----------------------------------------------------------------------------- experts.safetensors header fields


def _rewrite_header(path: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)


def test_experts_header_fields(good_pack):
    raw = (good_pack / "experts.safetensors").read_bytes()
    header = json.loads(raw[8 : 8 + _header_len(raw)])
    meta = header["__metadata__"]
    cases = []
    for tensor in ("layers.0.qweight", "layers.1.scales", "layers.0.zeros", "layers.1.neuron_order"):
        for key in ("dtype", "shape", "data_offsets"):
            for value in [*WRONG_VALUES, REMOVED, "F32", "U16", [3], [-1, 2], [1.5, 2]]:
                cases.append(("tensor", tensor, key, value))
        cases.append(("tensor-drop", tensor, None, None))
    for key in sorted(meta):
        for value in ["", "abc", "-1", "1.5", "true", "[1", "9" * 30, "0", "[]", "[0, 0]", "{}", 5, REMOVED]:
            cases.append(("meta", None, key, value))
    cases.append(("meta-all", None, None, REMOVED))
    cases.append(("header", None, None, [1, 2]))

    def run(case):
        kind, tensor, key, value = case
        target = good_pack.parent / "header"
        if not target.is_dir():
            _fresh(good_pack, "header", "experts.safetensors")
        path = target / "experts.safetensors"
        h = json.loads(json.dumps(header))
        if kind == "tensor":
            if value is REMOVED:
                del h[tensor][key]
            else:
                h[tensor][key] = value
        elif kind == "tensor-drop":
            del h[tensor]
        elif kind == "meta":
            if value is REMOVED:
                del h["__metadata__"][key]
            else:
                h["__metadata__"][key] = value
        elif kind == "meta-all":
            del h["__metadata__"]
        else:
            h = value
        if h == header:
            return SKIP  # the mutation is the original value: nothing to test
        _rewrite_header(path, h, raw[8 + _header_len(raw):])
        try:
            read_packed(path)
        except Exception as exc:  # noqa: BLE001
            field = {"meta": key, "tensor": tensor, "tensor-drop": "data_offsets"}.get(kind)
            if kind == "meta" and isinstance(exc, PackFormatError) and "metadata says" in str(exc):
                field = None  # a consistent but wrong size: named through the tensor it contradicts
            return _refused(exc, path, field)
        if kind == "meta" and key == "tensor_sha256" and value is REMOVED:
            pass  # an old file: loads, digests reported unavailable (test_integrity_pack)
        else:
            return "read_packed loaded a mutated header"
        try:
            load_pack(target)  # the pack binding still refuses it: pack.json recorded the old header
        except Exception as exc:  # noqa: BLE001
            return _refused(exc, target, "experts.safetensors")
        return "load_pack accepted an experts file pack.json does not record"

    _check_all("experts-header", cases, run)


# ----------------------------------------------------------------------------- pack.json


def test_pack_json_fields(good_pack):
    info = json.loads((good_pack / "pack.json").read_text())
    optional = {"model_type", "num_hidden_layers", "top_k"}
    cases = [(key, value) for key in sorted(info) for value in [*WRONG_VALUES, REMOVED]]
    cases += [("files", {**info["files"], "experts.safetensors": {"header_sha256": "0" * 64, "bytes": 1}}),
              ("files", {**info["files"], "plan.json": None}), ("files", {**info["files"], "plan.json": {}})]
    cases += [("quant", {**info["quant"], "symmetric": True}), ("quant", {**info["quant"], "group_size": 32}),
              ("layer_ids", [1, 0]), ("layer_ids", [0]), ("num_experts", 2), ("top_k", 1), ("top_k", 3)]

    def run(case):
        key, value = case
        target = _fresh(good_pack, "info", "pack.json")
        path = target / "pack.json"
        changed = dict(info)
        if value is REMOVED:
            del changed[key]
        else:
            changed[key] = value
        if changed == info and json.dumps(changed) == json.dumps(info):
            return SKIP
        path.write_text(json.dumps(changed))
        try:
            pack = load_pack(target)
        except Exception as exc:  # noqa: BLE001
            if isinstance(exc, PlanError) and key == "top_k":  # the plan's top_k contradicts it
                return _refused(exc, target / "plan.json", "top_k")
            return _refused(exc, path, key)
        valid_optional = (value in (None, REMOVED) or (key == "model_type" and isinstance(value, str))
                          or (key != "model_type" and type(value) is int and value >= 1))
        lenient = (key in optional and valid_optional) or (key == "files" and value is REMOVED)
        if not lenient:
            return "loaded silently"
        if value is not REMOVED and (type(pack.info.get(key)) is not type(value) or pack.info.get(key) != value):
            return f"info[{key!r}] is {pack.info.get(key)!r}, the file says {value!r}"
        return None

    _check_all("pack-json-fields", cases, run)


@pytest.mark.parametrize("name", ["pack.json", "plan.json"])
def test_broken_json_files(good_pack, name):
    text = (good_pack / name).read_text()
    bodies = [b"", b"null", b"[]", b"0", b'"crisp-pack"', b"\xff\xfe not utf-8", text.encode()[: len(text) // 2],
              text.encode()[:-2], b"[" * 100_000 + b"]" * 100_000, b"{" * 50_000, text.encode() + b"\x00"]
    cases = [("bytes", b) for b in bodies] + [("directory", None), ("dangling-symlink", None)]

    def run(case):
        kind, body = case
        target = _fresh(good_pack, f"broken-{name}", name)
        path = target / name
        path.unlink()
        if kind == "bytes":
            path.write_bytes(body)
        elif kind == "directory":
            path.mkdir()
        else:
            path.symlink_to(target / "nowhere")
        try:
            load_pack(target)
        except FileNotFoundError as exc:
            if name == "pack.json" and kind == "dangling-symlink" and "pack.json is missing" in str(exc):
                return None  # a dangling pack.json: the folder is not a pack, said so
            return f"raised FileNotFoundError: {exc}"
        except Exception as exc:  # noqa: BLE001
            return _refused(exc, path, None)
        return "loaded silently"

    _check_all(f"broken-{name}", cases, run)


# ----------------------------------------------------------------------------- plan.json


def _plan_mutations(plan: dict) -> list[tuple[tuple, object]]:
    """(path of keys/indices into the plan dict, new value) for every field of a plan."""
    out = []
    for key in plan:
        out += [((key,), v) for v in [*WRONG_VALUES, REMOVED]]
    if "tier_widths" in plan:
        for key in ("hot", "warm", "cold"):
            out += [(("tier_widths", key), v) for v in [*WRONG_VALUES, REMOVED, 9]]
    if "layers" in plan:
        out += [(("layers", "0", 0, key), v) for key in ("experts", "tier", "dominant")
                for v in [*WRONG_VALUES, REMOVED, [1, 0], [0, 0, 1], [0, 9], ["0", 1], [True, 1], 5, "lukewarm"]]
        out += [(("layers", "0", 9), {"experts": [0, 1], "tier": "cold", "dominant": None}),  # duplicate pair
                (("layers", "0", 9), {"experts": [0, 2], "tier": "hot", "dominant": None, "extra": 1}),
                (("layers", "07"), []), (("layers", "x"), []), (("layers", "-1"), []), (("layers", "1"), REMOVED),
                (("layers", "5"), []), (("unseen_tier",), "lukewarm"), (("combination_key",), "full-set"),
                (("extra_field",), 1), (("layer_ids",), [0, 0]), (("layer_ids",), [0, "1"]),
                (("layer_ids",), [0, 1.0]), (("layer_ids",), "01"), (("num_dominant",), 3), (("top_k",), 5)]
    return out


def _apply(data: dict, where: tuple, value) -> dict:
    data = json.loads(json.dumps(data))
    node = data
    for step in where[:-1]:
        node = node[step]
    last = where[-1]
    if value is REMOVED:
        del node[last]
    elif isinstance(node, list) and last >= len(node):
        node.append(value)
    else:
        node[last] = value
    return data


def _floats(value):
    """Integers as floats (a threshold 0 read back as 0.0 is the same number); booleans stay
    booleans, so ``true`` accepted as 1 still shows."""
    if isinstance(value, dict):
        return {k: _floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_floats(v) for v in value]
    return float(value) if type(value) is int else value


def _field_name(where: tuple) -> str:
    named = [str(s) for s in where if isinstance(s, str)]
    return named[-1]


@pytest.mark.parametrize("policy", ["crisp", "uniform", "skip_aux", "full"])
def test_plan_json_fields(good_pack, policy):
    if policy == "crisp":
        plan = _crisp_plan().to_dict()
    elif policy == "uniform":
        plan = CrispPlan.uniform(4, 2, 8, [0, 1], 4).to_dict()
    elif policy == "skip_aux":
        plan = CrispPlan.skip_aux(4, 2, 8, [0, 1], threshold=0.25).to_dict()
    else:
        plan = CrispPlan.full(4, 2, 8, [0, 1]).to_dict()
    cases = _plan_mutations(plan)
    target = good_pack.parent / f"plan-{policy}"
    target.mkdir(exist_ok=True)
    path = target / "plan.json"

    def run(case):
        where, value = case
        try:
            changed = _apply(plan, where, value)
        except (KeyError, IndexError):
            return SKIP  # the field does not exist in this policy's plan
        if changed == plan and json.dumps(changed) == json.dumps(plan):
            return SKIP
        path.write_text(json.dumps(changed))
        try:
            loaded = CrispPlan.load(path)
        except Exception as exc:  # noqa: BLE001
            return _refused(exc, path, _field_name(where) if not isinstance(exc, PlanError)
                            or "plan:" not in str(exc) else None)
        # Accepted: it must say exactly what the file says (no coercion, no default filled in for
        # a wrong value).
        again = loaded.to_dict()
        expected = dict(changed)
        if value is REMOVED and where in (("num_dominant",), ("description",), ("combination_key",)):
            # documented defaults for these optional fields (a plan without combination_key: the leading pair)
            expected[where[0]] = again[where[0]]
        if json.dumps(_floats(again), sort_keys=True) != json.dumps(_floats(expected), sort_keys=True):
            return f"accepted but changed: {json.dumps(again, sort_keys=True)[:200]}"
        return None

    _check_all(f"plan-json-{policy}", cases, run)


def test_campaign_size():
    """The campaign above (run first in this module) tried at least this many cases."""
    assert sum(CASE_COUNTS.values()) >= 900, CASE_COUNTS
