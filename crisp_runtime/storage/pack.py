"""A CRISP pack: a folder with the packed experts of one model, its description and optionally a plan.

    directory/experts.safetensors   every MoE layer, neuron-major 4-bit (crisp_kernels.save_packed),
                                    with a sha256 of every tensor in its metadata
    directory/pack.json             format, version, model_type, num_hidden_layers, hidden_size,
                                    intermediate_size, num_experts, top_k, layer_ids, quantization,
                                    ``files`` (what belongs together, below), plus whatever the caller
                                    adds (calibration data, the weights fingerprint, tool versions...)
    directory/plan.json             optional CrispPlan

``files`` in pack.json binds the three: the sha256 of experts.safetensors' header (which holds the
per-tensor digests, so it identifies the contents) and its size, and the sha256 of plan.json (or
null: the pack has no plan). ``load_pack`` checks them (a few KB read): experts from one save with
the plan or pack.json of another are refused. Packs written before ``files`` existed (same
version) still load; their binding and digest checks report ``unavailable``.

Saving (``save_pack``) writes all files into a temporary sibling folder, then swaps it in:
- a new folder, or one holding nothing but a pack's own files: the two folders are exchanged in
  one ``renameat2(RENAME_EXCHANGE)`` (Linux), or by two renames where that call is missing; a
  reader sees the old pack or the new one;
- a folder that also holds other files (a pack kept inside a model folder): only the pack's own
  files are replaced, each by a rename, pack.json last; an interruption between the renames leaves
  a pack that ``load_pack`` refuses (its pack.json does not match), never a silent mix. No other
  file is ever touched.
A folder whose pack.json / experts.safetensors / plan.json are not those of a CRISP pack is refused.

``load_pack`` compares every tensor with the digests recorded at save the first time this machine reads the file,
then trusts a stamp of the unchanged file (``PackCheck.ONCE``, ``crisp_kernels.io``). ``verify_pack(directory)``, or
``crisp-pack verify DIR`` (also ``python -m crisp_runtime verify DIR``), hashes every tensor every time.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import errno
import hashlib
import json
import numbers
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from crisp_kernels import PackedLayer, PackFormatError, QuantFormat, pack_layer
from crisp_kernels.io import (
    DIGESTS_KEY,
    DigestStatus,
    PackCheck,
    PackIntegrityError,
    atomic_write,
    check_uniform_layers,
    read_packed,
    save_packed,
)
from crisp_runtime.hf.moe_layers import MoeLayerRef, find_moe_layers, model_top_k
from crisp_runtime.planning.plan import CrispPlan, PlanError
from crisp_runtime.storage.serving_record import serving_choices

PACK_FORMAT = "crisp-pack"
PACK_VERSION = 1
EXPERTS_FILE = "experts.safetensors"
INFO_FILE = "pack.json"
PLAN_FILE = "plan.json"
PACK_FILES = (EXPERTS_FILE, INFO_FILE, PLAN_FILE)
FILES_KEY = "files"
# New pack files and folders: readable by all, as `cp` would make them (mkstemp/mkdtemp give 0600/0700).
_FILE_MODE, _DIR_MODE = 0o644, 0o755



class PackMismatchError(ValueError):
    """A pack (or packed layers) made for another model: shapes, layer ids, expert count or weights differ."""


class FingerprintStatus(enum.Enum):
    MATCH = "the pack was made from these weights"
    NOT_RECORDED = "the pack records no weights fingerprint (made without crisp-profile); not checked"
    UNAVAILABLE = "the model's expert weights are not loaded (meta tensors); not checked"
    MISMATCH_ALLOWED = "the pack was made from OTHER weights; allowed by allow_mismatch=True"


@dataclass(frozen=True)
class CrispPack:
    layers: Mapping[int, PackedLayer]
    plan: CrispPlan | None
    info: Mapping = field(default_factory=dict)
    digests: DigestStatus = DigestStatus.NOT_CHECKED  # the per-tensor sha256 check at load
    directory: Path | None = field(default=None, compare=False)  # the folder it was loaded from (for messages)

    def check_model(self, model, *, refs: Sequence[MoeLayerRef] | None = None) -> None:
        """Raise PackMismatchError unless this pack was made for ``model``'s architecture (``refs``: its MoE
        layers when the caller has found them already)."""
        try:
            check_layers_fit_model(self.layers, model, info=self.info, refs=refs)
        except PackMismatchError as exc:
            if self.directory is None:
                raise
            raise PackMismatchError(f"{self.directory}: {exc}") from None


def fingerprint_mismatch(recorded: str, found: str, *, directory=None,
                         argument: str | None = "allow_mismatch") -> PackMismatchError:
    """The error for a pack made from other weights than the model's: both fingerprints, the pack's folder when
    known, and ``argument``, the caller's way to use the pack anyway (None: it has none, e.g. a command line)."""
    where = "" if directory is None else f"{directory}: "
    remedy = ("make a pack of this model with crisp-profile" if argument is None
              else f"pass {argument}=True to use it anyway")
    return PackMismatchError(
        f"{where}this CRISP pack was made from other weights than this model (weights fingerprint {recorded[:12]}... "
        f"in pack.json, {found[:12]}... in the model; the same checkpoint loaded in another dtype than the pack was "
        f"made from also differs); {remedy}")


def model_info(model, *, refs: Sequence[MoeLayerRef] | None = None) -> dict:
    """What pack.json records about the model a pack is made from (``refs``: its MoE layers, if found already)."""
    refs = find_moe_layers(model) if refs is None else refs
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    return {
        "model_type": getattr(text, "model_type", None) or getattr(config, "model_type", None),
        "num_hidden_layers": getattr(text, "num_hidden_layers", None),
        "hidden_size": refs[0].hidden_size,
        "intermediate_size": refs[0].intermediate_size,
        "num_experts": refs[0].num_experts,
        "top_k": model_top_k(model),
        "layer_ids": [r.layer_id for r in refs],
    }


def pack_model(model, fmt: QuantFormat | None = None, neuron_orders: Mapping[int, object] | None = None, *,
               refs: Sequence[MoeLayerRef] | None = None) -> dict[int, PackedLayer]:
    """Quantize the model's current expert weights, ``{layer_id: PackedLayer}`` (CPU tensors).

    neuron_orders: optional ``{layer_id: (E, I) permutation}`` (most important neuron first); the
    present order otherwise.
    """
    fmt = QuantFormat() if fmt is None else fmt
    out = {}
    for ref in find_moe_layers(model) if refs is None else refs:
        if ref.module.gate_up_proj.is_meta or ref.module.down_proj.is_meta:
            raise ValueError(f"{ref.name}: the expert weights are not loaded (meta tensors); nothing to pack")
        w = ref.weights()  # the v5 layout (gpt-oss's de-interleaved, with its biases and activation)
        order = None if neuron_orders is None else neuron_orders.get(ref.layer_id)
        try:
            layer = pack_layer(w.gate_up_proj, w.down_proj, fmt, order, gate_up_bias=w.gate_up_bias,
                               down_bias=w.down_bias, activation=w.activation)
        except ValueError as exc:
            raise ValueError(f"{ref.name}: {exc}") from exc
        if layer.qweight.device.type != "cpu":
            layer = layer.to("cpu")
        out[ref.layer_id] = layer
    return out


# ----------------------------------------------------------------------------- weights fingerprint


def weights_sha256(layers: Sequence) -> str:
    """A digest identifying a model's expert weights: the first 4 rows of every MoE layer's
    ``gate_up_proj`` and ``down_proj`` (as float32), so it is cheap even for Mixtral-8x7B
    (4 x (2I + H) x E values per layer). crisp-profile records it in pack.json under
    ``model.weights_sha256``. ``layers``: the model's :class:`MoeLayerRef` s (``find_moe_layers``)."""
    h = hashlib.sha256()
    for ref in layers:
        gu = ref.module.gate_up_proj.detach()
        down = ref.module.down_proj.detach()
        for t in (gu[:, :4].float().cpu(), down[:, :, :4].float().cpu()):
            h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def recorded_weights_sha256(info: Mapping) -> str | None:
    """The weights fingerprint a pack's pack.json records (``model.weights_sha256``), or None."""
    model = info.get("model") if isinstance(info, Mapping) else None
    value = model.get("weights_sha256") if isinstance(model, Mapping) else None
    return value if isinstance(value, str) and value else None


def recorded_model(directory: str | os.PathLike) -> dict | None:
    """The model record (crisp-profile's fingerprint: model_type, shapes, layer_ids, weights_sha256) in a
    pack folder's pack.json, or None where there is no readable pack.json or it records no model
    (older packs kept it under ``info.model``)."""
    try:
        data = json.loads((Path(directory) / INFO_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    for holder in (data.get("info"), data):
        if isinstance(holder, dict) and isinstance(holder.get("model"), dict):
            return holder["model"]
    return None


def check_weights_fingerprint(pack: CrispPack | Mapping, model, *, allow_mismatch: bool = False,
                              refs: Sequence[MoeLayerRef] | None = None,
                              argument: str | None = "allow_mismatch") -> FingerprintStatus:
    """Check that ``pack`` (a CrispPack or its pack.json ``info``) was made from ``model``'s weights.

    A pack made from other weights of the same architecture has the right shapes and would run,
    silently giving another model's outputs: that raises PackMismatchError unless
    ``allow_mismatch`` (then the status says so, for the caller to report). A pack without a
    recorded fingerprint, or a model whose experts are not loaded, cannot be checked: the status
    says which. ``argument``: what the error tells the user to pass to use the pack anyway (None: nothing can be
    passed, as on a command line without such an option).
    """
    info = pack.info if isinstance(pack, CrispPack) else pack
    recorded = recorded_weights_sha256(info)
    if recorded is None:
        return FingerprintStatus.NOT_RECORDED
    refs = find_moe_layers(model) if refs is None else refs
    if any(r.module.gate_up_proj.is_meta or r.module.down_proj.is_meta for r in refs):
        return FingerprintStatus.UNAVAILABLE
    found = weights_sha256(refs)
    if found == recorded:
        return FingerprintStatus.MATCH
    if allow_mismatch:
        return FingerprintStatus.MISMATCH_ALLOWED
    raise fingerprint_mismatch(recorded, found, directory=pack.directory if isinstance(pack, CrispPack) else None,
                               argument=argument)


# ----------------------------------------------------------------------------- saving


def _layers_summary(layers: Mapping[int, PackedLayer]) -> dict:
    if not isinstance(layers, Mapping) or not layers:
        raise ValueError("layers: expected a non-empty mapping {layer_id: PackedLayer}")
    try:
        first = check_uniform_layers(layers)
    except ValueError as exc:
        raise PackMismatchError(str(exc)) from exc
    summary = {
        "hidden_size": first.hidden_size,
        "intermediate_size": first.intermediate_size,
        "num_experts": first.num_experts,
        "layer_ids": sorted(int(i) for i in layers),
        "quant": {"bits": first.fmt.bits, "group_size": first.fmt.group_size, "symmetric": first.fmt.symmetric},
    }
    if first.tail_start is not None:  # 2-bit tail rows: intermediate_size counts storage rows, plans count neurons
        summary.update(tail_start=first.tail_start, num_neurons=first.num_neurons)
    return summary


def _plan_neurons(summary: Mapping) -> int:
    """The intermediate size a pack's plan is written in: the model's neurons (a 2-bit tail's pack stores
    fewer rows; the runtime converts the plan, ``CrispPlan.in_storage_rows``)."""
    return summary.get("num_neurons", summary["intermediate_size"])


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _read_info(directory: Path) -> dict:
    """pack.json of a folder, checked for format and version; PackFormatError naming the field."""
    info_path = directory / INFO_FILE
    if os.path.lexists(info_path) and not info_path.is_file():
        raise PackFormatError(f"{info_path}: not a regular file (a folder or a dangling link)")
    if not info_path.is_file():
        raise FileNotFoundError(f"{directory} is not a CRISP pack: {INFO_FILE} is missing")
    try:
        info = json.loads(info_path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: bad JSON or not UTF-8
        raise PackFormatError(f"{info_path}: not readable JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(info, dict) or info.get("format") != PACK_FORMAT:
        raise PackFormatError(f"{info_path}: format is {info.get('format') if isinstance(info, dict) else info!r}, "
                              f"expected {PACK_FORMAT!r}")
    if type(info.get("version")) is not int or info["version"] != PACK_VERSION:
        raise PackFormatError(f"{info_path}: version {info.get('version')!r} is not supported (this CRISP reads "
                              f"{PACK_VERSION})")
    return info


def _check_replaceable(directory: Path) -> list[str]:
    """The names in ``directory`` that are not a pack's files; refuses a folder whose pack-named
    files do not belong to a CRISP pack (they are someone else's)."""
    if not directory.exists():
        return []
    if not directory.is_dir():
        raise FileExistsError(f"{directory}: exists and is not a folder; refusing to replace it with a pack")
    names = sorted(p.name for p in directory.iterdir())
    ours = [n for n in names if n in PACK_FILES]
    if ours:
        try:
            _read_info(directory)
        except (FileNotFoundError, PackFormatError) as exc:
            raise FileExistsError(f"{directory}: holds {ours} that are not a CRISP pack's ({exc}); refusing to "
                                  f"overwrite them") from None
        for name in ours:
            if not (directory / name).is_file() or (directory / name).is_symlink():
                raise FileExistsError(f"{directory / name}: not a regular file; refusing to replace it")
    return [n for n in names if n not in PACK_FILES]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def exchange_folders(a: Path, b: Path) -> None:
    """Swap two folders atomically (Linux ``renameat2(RENAME_EXCHANGE)``); where that call is
    missing (other systems, old kernels or filesystems), two renames through a third name, leaving
    a moment where ``b`` does not exist. Both must exist on the same filesystem."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is not None:
        at_fdcwd, rename_exchange = -100, 2
        if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
            raise OSError(err, f"cannot exchange {a} and {b}: {os.strerror(err)}")
    side = Path(tempfile.mkdtemp(prefix=f".{b.name}.swap-", dir=b.parent))
    os.replace(b, side / "x")
    os.replace(a, b)
    os.replace(side / "x", a)
    side.rmdir()


def commit_pack_folder(staging: Path, directory: Path) -> None:
    """Move the pack files written in ``staging`` (a sibling folder) into ``directory`` as one
    change where the file system allows (see the module docstring); ``staging`` is removed.
    Never deletes or overwrites a file that is not one of the pack's own."""
    if directory.is_symlink():
        directory = directory.resolve()  # the folder it names is replaced, never the link itself
    others = _check_replaceable(directory)
    parent = directory.parent
    if not directory.exists():
        try:
            os.rename(staging, directory)  # onto nothing (or an empty folder created meanwhile)
            _fsync_dir(parent)
            return
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            others = _check_replaceable(directory)
    if not others:
        exchange_folders(staging, directory)
        _fsync_dir(parent)
        for name in PACK_FILES:  # staging now holds the old pack: remove its files only
            (staging / name).unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # something appeared in the old folder meanwhile: leave it
            staging.rmdir()
        return
    # Other files beside the pack: replace the pack's own files one by one, pack.json last.
    for name in (EXPERTS_FILE, PLAN_FILE, INFO_FILE):
        if (staging / name).exists():
            os.replace(staging / name, directory / name)
        elif name == PLAN_FILE:
            (directory / name).unlink(missing_ok=True)  # a plan of the old pack; pack.json said it was ours
    _fsync_dir(directory)
    staging.rmdir()


def save_pack(
    directory: str | os.PathLike,
    layers: Mapping[int, PackedLayer],
    *,
    plan: CrispPlan | None = None,
    info: Mapping | None = None,
) -> Path:
    """Write a pack folder (and its parents if needed); returns its path. See the module docstring.

    The same layers, plan and info give byte-identical files. A symbolic link to a folder is
    followed: the folder it names is replaced, the link kept.
    """
    directory = given = Path(directory)
    summary = _layers_summary(layers)
    info = dict(info or {})
    for key in ("hidden_size", "intermediate_size", "num_experts", "layer_ids", "tail_start", "num_neurons"):
        if key in info and info[key] != summary.get(key):
            raise PackMismatchError(f"info[{key!r}] = {info[key]!r} disagrees with the layers ({summary.get(key)!r})")
    for key in ("format", "version", "quant", FILES_KEY):
        if key in info:
            raise ValueError(f"info: key {key!r} is reserved")
    if plan is not None:
        if not isinstance(plan, CrispPlan):
            raise TypeError(f"plan: expected CrispPlan, got {type(plan).__name__}")
        if info.get("top_k") is not None and info["top_k"] != plan.top_k:
            raise PlanError(f"plan top_k {plan.top_k} != info top_k {info['top_k']}")
        plan.check_compatible(num_experts=summary["num_experts"], top_k=plan.top_k,
                              intermediate_size=_plan_neurons(summary), layer_ids=summary["layer_ids"])
        info.setdefault("top_k", plan.top_k)
    try:
        json.dumps(info, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"info: must be JSON-serializable with string keys ({exc})") from None
    if directory.is_symlink():
        if not directory.exists():
            raise FileNotFoundError(f"{directory}: a dangling symbolic link; refusing to write a pack through it")
        directory = directory.resolve()  # swap the real folder (beside it, same file system); the link stays
    _check_replaceable(directory)  # before the work: refuse someone else's files early
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    try:
        header = save_packed(staging / EXPERTS_FILE, layers)
        files = {EXPERTS_FILE: {"header_sha256": header, "bytes": (staging / EXPERTS_FILE).stat().st_size},
                 PLAN_FILE: None}
        if plan is not None:
            plan.save(staging / PLAN_FILE)
            files[PLAN_FILE] = {"sha256": _sha256_file(staging / PLAN_FILE)}
        record = {"format": PACK_FORMAT, "version": PACK_VERSION, "model_type": None, "num_hidden_layers": None,
                  "top_k": None, **info, **summary, FILES_KEY: files}
        text = json.dumps(record, indent=1, sort_keys=True)
        atomic_write(staging / INFO_FILE, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
        for f in staging.iterdir():
            os.chmod(f, _FILE_MODE)
        os.chmod(staging, _DIR_MODE)
        commit_pack_folder(staging, directory)
    except BaseException:
        for name in PACK_FILES:
            (staging / name).unlink(missing_ok=True)
        for leftover in staging.glob(".*.tmp") if staging.is_dir() else ():
            leftover.unlink(missing_ok=True)
        if staging.is_dir():
            with contextlib.suppress(OSError):
                staging.rmdir()
        raise
    return given


# ----------------------------------------------------------------------------- loading


def _check_info_fields(info_path: Path, info: Mapping, summary: Mapping) -> None:
    """pack.json's description against the experts file, type-strict (``true`` is not 1)."""
    for key in ("hidden_size", "intermediate_size", "num_experts", "layer_ids", "quant", "tail_start",
                "num_neurons"):
        if json.dumps(info.get(key), sort_keys=True) != json.dumps(summary.get(key), sort_keys=True):
            raise PackFormatError(f"{info_path}: field {key} is {info.get(key)!r} but {EXPERTS_FILE} holds "
                                  f"{summary.get(key)!r}")
    for key, kinds in (("top_k", (int,)), ("num_hidden_layers", (int,)), ("model_type", (str,))):
        value = info.get(key)
        if value is not None and (type(value) not in kinds or (kinds == (int,) and value < 1)):
            raise PackFormatError(f"{info_path}: field {key} is {value!r}, expected "
                                  f"{'a positive integer' if kinds == (int,) else 'a string'} or null")
    serving_choices(info, where=str(info_path))  # the optional stored serving choices, strictly


def _files_record(info_path: Path, info: Mapping) -> dict | None:
    if FILES_KEY not in info:
        return None  # a pack written before the binding was recorded
    files = info[FILES_KEY]
    experts = files.get(EXPERTS_FILE) if isinstance(files, dict) else None
    plan = files.get(PLAN_FILE, "missing") if isinstance(files, dict) else "missing"
    ok = (isinstance(experts, dict) and isinstance(experts.get("header_sha256"), str)
          and type(experts.get("bytes")) is int
          and (plan is None or (isinstance(plan, dict) and isinstance(plan.get("sha256"), str))))
    if not ok:
        raise PackFormatError(f"{info_path}: field {FILES_KEY} is malformed: expected {{{EXPERTS_FILE!r}: "
                              f"{{'header_sha256': str, 'bytes': int}}, {PLAN_FILE!r}: {{'sha256': str}} or null}}")
    return files


_TORN = "the files are from different saves (an interrupted save?); save the pack again"


def _check_binding(directory: Path, files: Mapping, header_digest: str) -> None:
    experts = files[EXPERTS_FILE]
    size = (directory / EXPERTS_FILE).stat().st_size
    if experts["header_sha256"] != header_digest or experts["bytes"] != size:
        raise PackIntegrityError(f"{directory}: {EXPERTS_FILE} is not the one {INFO_FILE} records; {_TORN}")
    plan_path = directory / PLAN_FILE
    if files[PLAN_FILE] is None:
        if os.path.lexists(plan_path):
            raise PackIntegrityError(f"{directory}: {PLAN_FILE} is present but {INFO_FILE} records a pack without "
                                     f"a plan; {_TORN}")
    elif not plan_path.is_file():
        raise PackIntegrityError(f"{directory}: {INFO_FILE} records a {PLAN_FILE} that is missing; {_TORN}")
    elif _sha256_file(plan_path) != files[PLAN_FILE]["sha256"]:
        raise PackIntegrityError(f"{directory}: {PLAN_FILE} is not the one {INFO_FILE} records; {_TORN}")


def load_pack(directory: str | os.PathLike, *, device: str = "cpu", check: PackCheck = PackCheck.ONCE
              ) -> CrispPack:
    """Read and cross-check a pack folder (see the module docstring).

    check: ``PackCheck.VALUES`` (headers, shapes, value ranges and the ``files`` binding),
    ``PackCheck.DIGESTS`` (also every tensor's sha256; costs about one more read) or ``PackCheck.ONCE``
    (default: the digests the first time this machine reads this file, then a stamp of the unchanged file;
    ``crisp_kernels.io``).
    The tensors are copied into memory: the file may be replaced or rewritten afterwards.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"CRISP pack folder not found: {directory}")
    info = _read_info(directory)
    info_path = directory / INFO_FILE
    files = _files_record(info_path, info)
    experts_path = directory / EXPERTS_FILE
    if os.path.lexists(experts_path) and not experts_path.is_file():
        raise PackFormatError(f"{experts_path}: not a regular file (a folder or a dangling link)")
    if not experts_path.is_file():
        raise FileNotFoundError(f"{directory}: {EXPERTS_FILE} is missing")
    packed = read_packed(experts_path, device=device, check=check)
    summary = _layers_summary(packed.layers)
    _check_info_fields(info_path, info, summary)
    if files is not None:
        _check_binding(directory, files, packed.header_sha256)
    elif DIGESTS_KEY in packed.metadata:
        # every CRISP that records tensor digests in the experts file also records the files in pack.json: without
        # the record nothing would tie plan.json to these experts
        raise PackIntegrityError(f"{info_path}: has no {FILES_KEY!r} record, but {EXPERTS_FILE} was written by a CRISP "
                                 f"that records it (the file holds tensor digests): {INFO_FILE} was edited or "
                                 "replaced; save the pack again")
    plan = None
    plan_path = directory / PLAN_FILE
    if os.path.lexists(plan_path):
        if not plan_path.is_file():
            raise PlanError(f"{plan_path}: not a regular file (a folder or a dangling link); a pack's plan must be "
                            f"a JSON file, or absent for a pack without a plan")
        plan = CrispPlan.load(plan_path)
        top_k = info.get("top_k")
        if top_k is not None and top_k != plan.top_k:
            raise PlanError(f"{info_path}: top_k {top_k!r} differs from the plan's, {plan.top_k} in {plan_path} "
                            "(one of the two files was edited, or they come from different packs)")
        try:
            plan.check_compatible(num_experts=summary["num_experts"], top_k=plan.top_k,
                                  intermediate_size=_plan_neurons(summary), layer_ids=summary["layer_ids"])
        except PlanError as exc:
            raise PlanError(f"{plan_path}: {exc}") from exc
    return CrispPack(layers=packed.layers, plan=plan, info=info, digests=packed.digests, directory=directory)


@dataclass(frozen=True)
class PackVerification:
    """What :func:`verify_pack` checked."""

    directory: Path
    tensors: DigestStatus  # every tensor's sha256 against experts.safetensors' metadata
    binding: DigestStatus  # experts.safetensors and plan.json against pack.json's ``files``
    num_layers: int
    has_plan: bool

    def lines(self) -> list[str]:
        binding = ("experts and plan match pack.json" if self.binding is DigestStatus.VERIFIED
                   else "unavailable (pack.json written before it recorded its files)")
        return [f"{self.directory}: {self.num_layers} layers, {'a' if self.has_plan else 'no'} plan",
                f"tensor digests: {self.tensors.value}", f"files: {binding}"]


def verify_pack(directory: str | os.PathLike) -> PackVerification:
    """Load a pack with every check, the tensor digests included; raise PackFormatError (or
    PackIntegrityError, PlanError) on the first defect. Old packs: the checks they lack data
    for are reported ``unavailable``."""
    pack = load_pack(directory, check=PackCheck.DIGESTS)
    bound = DigestStatus.VERIFIED if pack.info.get(FILES_KEY) is not None else DigestStatus.UNAVAILABLE
    return PackVerification(Path(directory), pack.digests, bound, len(pack.layers), pack.plan is not None)


def check_layers_fit_model(layers: Mapping[int, PackedLayer], model, *, info: Mapping | None = None,
                           refs: Sequence[MoeLayerRef] | None = None) -> None:
    """Raise PackMismatchError unless ``layers`` (and ``info``) describe ``model``'s MoE layers (``refs``, when the
    caller has found them already)."""
    refs = find_moe_layers(model) if refs is None else refs
    problems = []
    model_ids = sorted(r.layer_id for r in refs)
    pack_ids = sorted(int(i) for i in layers)
    if model_ids != pack_ids:
        problems.append(f"MoE layers {pack_ids} in the pack, {model_ids} in the model")
    for ref in refs:
        layer = layers.get(ref.layer_id)
        if layer is None:
            continue
        want = (ref.num_experts, ref.intermediate_size, ref.hidden_size)
        got = (layer.num_experts, layer.num_neurons, layer.hidden_size)  # neurons: a 2-bit tail stores fewer rows
        if want != got:
            problems.append(f"layer {ref.layer_id}: (experts, intermediate, hidden) = {got} in the pack, "
                            f"{want} in the model")
        if (layer.activation, layer.bias is not None) != (ref.activation, ref.has_bias):
            problems.append(f"layer {ref.layer_id}: activation {layer.activation} (biases: {layer.bias is not None}) "
                            f"in the pack, {ref.activation} (biases: {ref.has_bias}) in the model")
    if info:
        mi = model_info(model, refs=refs)
        for key in ("model_type", "num_hidden_layers", "top_k"):
            if info.get(key) is not None and mi.get(key) is not None and info[key] != mi[key]:
                problems.append(f"{key} {info[key]!r} in the pack, {mi[key]!r} in the model")
    if problems:
        raise PackMismatchError("this CRISP pack was made for another model: " + "; ".join(problems[:6]))


# ----------------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    """``crisp-pack verify DIR [DIR ...]`` (or ``python -m crisp_runtime verify ...``): exit 0 when
    every pack passes, 1 when one is corrupt or inconsistent (one ``error:`` line each), 2 on a
    usage error."""
    import argparse

    parser = argparse.ArgumentParser(prog="crisp-pack",
                                     description="Check CRISP pack folders, every tensor digest included.")
    sub = parser.add_subparsers(dest="command", required=True)
    verify = sub.add_parser("verify", help="verify pack folders")
    verify.add_argument("packs", nargs="+", metavar="DIR")
    args = parser.parse_args(argv)
    status = 0
    for d in args.packs:
        try:
            result = verify_pack(d)
        except FileNotFoundError as exc:  # not a pack at all: a usage error
            print(f"error: {exc}", file=sys.stderr)
            status = 2
            continue
        except (ValueError, OSError) as exc:  # PackFormatError, PackIntegrityError, PlanError, unreadable
            print(f"error: {exc}", file=sys.stderr)
            status = max(status, 1)
            continue
        print("ok: " + "; ".join(result.lines()))
    return status



def layers_from_source(source, fmt, *, pack, check_pack, check_layers):
    """``apply``'s ``source`` as ``(layers, the pack's plan or None)``: one reading for every adapter.

    source: None = ``pack(fmt)`` (the model's own weights), a pack folder path, a :class:`CrispPack`
    (``check_pack(pack)`` refuses another model's or other weights' pack) or ``{layer_id: PackedLayer}``
    (``check_layers(layers)`` refuses layers that do not fit the model).
    """
    if source is None:
        return pack(fmt), None
    if fmt is not None:
        raise ValueError("fmt applies only when apply() packs the model (source=None); a pack has its format")
    if isinstance(source, (str, os.PathLike)):
        source = load_pack(Path(source))
    if isinstance(source, CrispPack):
        check_pack(source)
        return dict(source.layers), source.plan
    if isinstance(source, Mapping):
        layers = {}
        for k, v in source.items():
            integral = isinstance(k, numbers.Integral) and not isinstance(k, bool)
            if not (integral or isinstance(k, str) and k.isdigit()):
                raise TypeError(f"source: a {{layer_id: PackedLayer}} mapping takes integer layer ids, got the key "
                                f"{k!r}")
            layers[int(k)] = v
        for k, v in layers.items():
            if not isinstance(v, PackedLayer):
                raise TypeError(f"source[{k}]: expected PackedLayer, got {type(v).__name__}")
        check_layers(layers)
        return layers, None
    raise TypeError(f"source: expected None, a pack folder, a CrispPack or {{layer_id: PackedLayer}}, got "
                    f"{type(source).__name__}")
