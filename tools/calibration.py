"""Shared pieces of ``crisp-profile``, ``crisp-eval`` and the evidence report.

- input checking that fails early with a clear message (:class:`CliError`, exit code 2);
- loading a local checkpoint and its MoE layers, and a fingerprint that identifies the model;
- calibration / evaluation windows from local text;
- :class:`MaskedExperts`, a reference experts forward installed per model instance (and removed
  again) that runs every routed expert over its first ``width`` neurons, per token, with the
  expert weights it is given (unquantized, reordered, or dequantized from a pack). It is the
  measuring instrument of profiling (it reports each expert's hidden activations to an
  observer) and of the evidence report (masking one member of a combination is width 0).
- per-position loss and next-token accuracy of a model over windows.

Widths always count neurons in the order of the weights handed to :class:`MaskedExperts`: with
a pack's dequantized weights in stored (importance) order, width k is the pack's width-k prefix.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from crisp_runtime.cli_args import CliError  # re-exported: the one error base of every CLI
from crisp_runtime.hf.moe_layers import MoeLayerRef, UnsupportedModelError, find_moe_layers, max_positions, model_top_k

# Windows may overlap (they are drawn at random), but asking for more than this many times the
# text's bytes means the "samples" are mostly repeats: refuse rather than pretend.
MAX_OVERSAMPLING = 8

# Tokens per window of every accuracy figure: crisp-eval's windows, and so the throughput search's, which bounds the
# loss that crisp-eval then reports. The loss depends on the window length: the 2g128@0.25 tail pack's full width
# loses 0.96% +- 0.08% of the 4-bit full width's next-token hits at positions 0-126 of the held-out text's 256-token
# windows and 0.63% +- 0.07% at positions 127-254 (all 1,303 windows; docs/serving-and-residency.md).
EVAL_SEQ_LEN = 256




def log(msg: str, *, quiet: bool = False) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the model


def resolve_device(name: str) -> torch.device:
    """cpu, cuda, cuda:N or auto (cuda when there is one); anything else (meta, foo, a missing GPU) is a CliError."""
    import argparse

    from crisp_runtime.cli_args import device_name

    try:
        name = device_name(name)
    except argparse.ArgumentTypeError as exc:
        raise CliError(f"--device {exc}") from exc
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(path: str | os.PathLike, device: torch.device | str = "cpu", dtype: str = "float32"):
    """A local transformers causal LM in ``dtype`` ("auto": the checkpoint's), eval mode, with its
    supported MoE layers. The CRISP statistics and masked experts compute in float32 whatever the
    model's dtype; a bf16 checkpoint kept in bf16 needs half the memory of float32.

    Returns (model, layers: list[MoeLayerRef]). Nothing is downloaded.
    """
    if dtype not in DTYPES:
        raise CliError(f"--dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    path = Path(path)
    if not path.is_dir():
        raise CliError(f"--model {path}: not a directory (expected a local transformers checkpoint)")
    if not (path / "config.json").is_file():
        raise CliError(f"--model {path}: no config.json in it (expected a local transformers checkpoint)")
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as exc:  # pragma: no cover - transformers is a dev/hf extra
        raise CliError("transformers is needed to load a model: pip install 'crisp-moe[hf]'") from exc
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[dtype], local_files_only=True)
    except Exception as exc:  # transformers raises OSError / ValueError / KeyError for broken checkpoints
        raise CliError(f"--model {path}: cannot load the checkpoint ({type(exc).__name__}: {exc})") from exc
    model.to(device).eval()
    try:
        layers = find_moe_layers(model)
        model_top_k(model)
    except UnsupportedModelError as exc:
        raise CliError(f"--model {path}: {exc}") from exc
    return model, layers


def check_seq_len(model, seq_len: int, option: str = "--seq-len") -> None:
    """CliError naming ``option`` (the window length's option) unless ``seq_len`` tokens fit the model."""
    if seq_len < 2:
        raise CliError(f"{option} must be at least 2 (one input and one next token), got {seq_len}")
    limit = max_positions(model)
    if limit is not None and seq_len > limit:
        raise CliError(f"{option} {seq_len} is beyond the model's max_position_embeddings ({limit})")


def check_pack_of_model(layers, info, model, where: str) -> None:
    """CliError (prefixed ``where``: the option and its pack folder, e.g. ``--crisp PATH``) unless a pack's ``layers``
    and pack.json ``info`` describe ``model``'s MoE layers and were made from its weights (when the pack records
    their fingerprint): another model's pack, or a pack of other weights of the same architecture, is refused."""
    from crisp_runtime.storage.pack import PackMismatchError, check_layers_fit_model, check_weights_fingerprint

    try:
        check_layers_fit_model(layers, model, info=info)
        check_weights_fingerprint(info, model, argument=None)  # no option lets a command use another's pack
    except PackMismatchError as exc:
        raise CliError(f"{where}: {exc}") from None


def model_fingerprint(model, layers: Sequence[MoeLayerRef], digest: str | None = None) -> dict:
    """What identifies a model for a pack: its shape and a digest of (a sample of) its expert weights
    (``crisp_runtime.storage.pack.weights_sha256``: the first rows of every MoE layer, cheap even for
    Mixtral-8x7B; ``check_weights_fingerprint`` compares it). ``digest``: that digest computed elsewhere
    (``placement.ExpertSource.weights_sha256``: from the checkpoint when the experts are not resident).
    """
    from crisp_runtime.storage.pack import weights_sha256

    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return {
        "model_type": getattr(config, "model_type", type(model).__name__),
        "hidden_size": layers[0].hidden_size,
        "intermediate_size": layers[0].intermediate_size,
        "num_experts": layers[0].num_experts,
        "top_k": model_top_k(model),
        "layer_ids": [r.layer_id for r in layers],
        "weights_sha256": weights_sha256(layers) if digest is None else digest,
    }


# ----------------------------------------------------------------------------- text


def load_texts(paths: Sequence[str]) -> list[str]:
    """Local documents from .txt / .jsonl / .jsonl.gz / .json.gz files or a saved `datasets` dataset."""
    from .text import read_texts

    if not paths:
        raise CliError("--data: give at least one text file")
    texts: list[str] = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            texts.extend(_load_saved_dataset(path))
            continue
        if not path.is_file():
            raise CliError(f"--data {path}: no such file")
        try:
            texts.extend(read_texts([path]))
        except ValueError as exc:
            raise CliError(f"--data {exc}") from exc
    if not any(t.strip() for t in texts):
        raise CliError(f"--data {' '.join(map(str, paths))}: the text is empty")
    return texts


def _load_saved_dataset(path: Path) -> list[str]:
    if not ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()):
        raise CliError(f"--data {path}: a directory, but not a `datasets` dataset saved with save_to_disk")
    try:
        import datasets
    except ImportError as exc:
        raise CliError(f"--data {path}: reading a saved dataset needs the `datasets` package") from exc
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        ds = ds[sorted(ds)[0]]
    if "text" not in ds.column_names:
        raise CliError(f"--data {path}: the dataset has no 'text' column (columns: {ds.column_names})")
    return [t for t in ds["text"] if isinstance(t, str)]


def text_bytes(texts: Sequence[str]) -> bytes:
    from .text import DOC_SEPARATOR

    return bytes([DOC_SEPARATOR]).join(t.encode("utf-8") for t in texts)


def split_texts(texts: Sequence[str], holdout_fraction: float) -> tuple[list[str], list[str]]:
    """Split the concatenated text by bytes: (first part, last ``holdout_fraction``)."""
    data = text_bytes(texts)
    cut = int(len(data) * (1.0 - holdout_fraction))
    head, tail = data[:cut], data[cut:]
    return [head.decode("utf-8", errors="replace")], [tail.decode("utf-8", errors="replace")]


def random_windows(
    texts: Sequence[str], num_samples: int, seq_len: int, seed: int, what: str = "--data",
    seq_len_option: str = "--seq-len",
) -> torch.Tensor:
    """(num_samples, seq_len) windows drawn at random (seeded) from the text; checks the text suffices
    (``seq_len_option``: the option that gave ``seq_len``, named in the refusal)."""
    from .text import sample_sequences

    nbytes = len(text_bytes(texts))
    if nbytes < seq_len:
        raise CliError(f"{what}: the text has {nbytes} bytes, fewer than {seq_len_option} {seq_len}")
    if num_samples * seq_len > MAX_OVERSAMPLING * nbytes:
        raise CliError(
            f"{what}: too little text for {num_samples} samples of {seq_len} tokens ({nbytes} bytes; "
            f"at most {MAX_OVERSAMPLING}x oversampling allowed): lower --samples or give more text"
        )
    return sample_sequences(texts, num_samples, seq_len, seed)


def contiguous_windows(
    texts: Sequence[str], num_samples: int | None, seq_len: int, what: str = "--data"
) -> torch.Tensor:
    """Non-overlapping windows spread evenly over the text (all of them when ``num_samples`` is None)."""
    data = text_bytes(texts)
    available = len(data) // seq_len
    if available < 1:
        raise CliError(f"{what}: the text has {len(data)} bytes, fewer than --seq-len {seq_len}")
    if num_samples is None:
        num_samples = available
    if num_samples > available:
        raise CliError(
            f"{what}: too little text for {num_samples} non-overlapping samples of {seq_len} tokens "
            f"({len(data)} bytes hold {available}): lower --samples or --seq-len"
        )
    picks = torch.linspace(0, available - 1, num_samples).round().long()
    stream = torch.frombuffer(bytearray(data[: available * seq_len]), dtype=torch.uint8).long()
    return stream.view(available, seq_len)[picks]


def check_vocab(model, windows: torch.Tensor) -> None:
    vocab = model.get_input_embeddings().num_embeddings
    if int(windows.max()) >= vocab:
        raise CliError(
            f"the model's vocabulary has {vocab} ids but the byte-level text needs 256: "
            "CRISP's tools feed raw UTF-8 bytes (crisp_tools.text)"
        )


# ----------------------------------------------------------------------------- the instrument

WidthsFn = Callable[[int, torch.Tensor, torch.Tensor], "torch.Tensor | None"]
Observer = Callable[[int, int, torch.Tensor, torch.Tensor], None]


def reorder_expert_weights(gate_up: torch.Tensor, down: torch.Tensor, order: torch.Tensor):
    """Reorder the neurons of every expert: rows of gate and up, columns of down (a pure permutation)."""
    num_experts, two_inter, hidden = gate_up.shape
    inter = two_inter // 2
    order = order.to(gate_up.device)
    idx = order.unsqueeze(-1).expand(num_experts, inter, hidden)
    gate = gate_up[:, :inter].gather(1, idx)
    up = gate_up[:, inter:].gather(1, idx)
    down_r = down.gather(2, order.unsqueeze(1).expand(num_experts, hidden, inter))
    return torch.cat((gate, up), dim=1), down_r


@dataclass
class RunRecord:
    """Per-layer routing and widths of one forward pass (flattened tokens, in call order)."""

    index: dict
    weights: dict
    widths: dict


class MaskedExperts:
    """Replace the forward of each experts module (per instance, reversibly) by a width-aware reference.

    weights: {layer_id: (gate_up (E, 2I, H), down (E, H, I))}; None = the module's own weights.
    widths_fn(layer_id, top_k_index (T, k), top_k_weights (T, k)) -> (T, k) widths or None (full).
    observer(layer_id, expert, hidden (n, I) = silu(gate x) * up x, routing_weight (n,)) sees every
    expert's activations before masking. ``record=True`` keeps routing and widths of each call.
    """

    def __init__(self, model, layers: Sequence[MoeLayerRef], weights=None, widths_fn: WidthsFn | None = None,
                 observer: Observer | None = None, record: bool = False):
        self.model = model
        self.layers = list(layers)
        self.weights = weights
        self.widths_fn = widths_fn
        self.observer = observer
        self.record = record
        self.trace = RunRecord({}, {}, {})

    def reset_trace(self) -> None:
        self.trace = RunRecord({}, {}, {})

    # accelerate's hooks (device_map placement) replace a module's forward on the instance by a wrapper that
    # loads the module's weights (offloaded to CPU / disk), calls ``module._old_forward`` and frees them
    # again: under a hook the reference goes in as ``_old_forward``, so it runs between load and free.
    @staticmethod
    def _slot(ref: MoeLayerRef) -> str:
        hooked = "_hf_hook" in ref.module.__dict__ and "_old_forward" in ref.module.__dict__
        return "_old_forward" if hooked else "forward"

    def __enter__(self) -> MaskedExperts:
        self._saved = {}
        for ref in self.layers:
            slot = self._slot(ref)
            if slot == "forward" and "forward" in ref.module.__dict__:
                self.__exit__()
                raise RuntimeError(f"{ref.name}: its forward is already overridden on this instance")
            self._saved[ref.name] = (slot, ref.module.__dict__.get("_old_forward"))
            setattr(ref.module, slot, types.MethodType(self._make_forward(ref), ref.module))
        return self

    def __exit__(self, *exc) -> None:
        for ref in self.layers:
            slot, old = self._saved.pop(ref.name, ("forward", None))
            if slot == "forward":
                ref.module.__dict__.pop("forward", None)
            else:
                ref.module._old_forward = old

    def _make_forward(self, ref: MoeLayerRef):
        layer_id = ref.layer_id
        owner = self

        def forward(module, hidden_states, top_k_index, top_k_weights):
            if owner.weights is None:
                gate_up, down = module.gate_up_proj, module.down_proj
            else:
                gate_up, down = owner.weights[layer_id]
            return owner._experts(layer_id, hidden_states, top_k_index, top_k_weights, gate_up, down)

        return forward

    def _experts(self, layer_id, hidden_states, top_k_index, top_k_weights, gate_up, down):
        num_experts, two_inter, _ = gate_up.shape
        inter = two_inter // 2
        widths = None if self.widths_fn is None else self.widths_fn(layer_id, top_k_index, top_k_weights)
        if widths is not None:
            widths = widths.to(hidden_states.device)
        if self.record:
            self.trace.index.setdefault(layer_id, []).append(top_k_index.detach().cpu())
            self.trace.weights.setdefault(layer_id, []).append(top_k_weights.detach().float().cpu())
            w = widths if widths is not None else torch.full_like(top_k_index, inter)
            self.trace.widths.setdefault(layer_id, []).append(w.detach().cpu())
        out = torch.zeros_like(hidden_states, dtype=torch.float32)
        neuron = torch.arange(inter, device=hidden_states.device)
        for e in torch.unique(top_k_index).tolist():
            if not 0 <= e < num_experts:
                continue
            tok, pos = torch.where(top_k_index == e)
            routing = top_k_weights[tok, pos].float()
            if widths is not None:
                keep_w = widths[tok, pos]
                live = keep_w > 0
                if not bool(live.any()) and self.observer is None:
                    continue
            x = hidden_states[tok].float()
            # weights handed in (a pack, a checkpoint's layer) live on the CPU: one expert moved at a time
            gate, up = F.linear(x, gate_up[e].to(x.device, torch.float32)).chunk(2, dim=-1)
            h = F.silu(gate) * up  # (n, I)
            if self.observer is not None:
                self.observer(layer_id, e, h, routing)
            if widths is not None:
                h = h * (neuron.unsqueeze(0) < keep_w.unsqueeze(1))
            y = F.linear(h, down[e].to(x.device, torch.float32)) * routing.unsqueeze(1)
            out.index_add_(0, tok, y)
        return out.to(hidden_states.dtype)


# ----------------------------------------------------------------------------- loss and accuracy


@dataclass
class TokenScores:
    """Per-position results: nll and correct are (N, L-1) for windows (N, L) (position t predicts t+1)."""

    nll: torch.Tensor
    correct: torch.Tensor

    @property
    def loss(self) -> float:
        return float(self.nll.double().mean())

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)

    @property
    def accuracy(self) -> float:
        return float(self.correct.double().mean())


def input_device(model) -> torch.device:
    """Where a model takes its token ids: the CPU under accelerate's device_map (its hooks move inputs to each
    module's device; a first parameter may be offloaded, ``meta``), else the device of its parameters."""
    if getattr(model, "hf_device_map", None):
        return torch.device("cpu")
    return next(model.parameters()).device


@torch.no_grad()
def score_windows(model, windows: torch.Tensor, batch_size: int = 16, progress: Callable | None = None) -> TokenScores:
    device = input_device(model)
    nll, correct = [], []
    for start in range(0, windows.shape[0], batch_size):
        batch = windows[start : start + batch_size].to(device)
        logits = model(input_ids=batch, use_cache=False).logits[:, :-1].float()
        target = batch[:, 1:]
        nll.append(F.cross_entropy(logits.transpose(1, 2), target, reduction="none").cpu())
        correct.append((logits.argmax(-1) == target).cpu())
        if progress is not None:
            progress(min(start + batch_size, windows.shape[0]), windows.shape[0])
    return TokenScores(torch.cat(nll), torch.cat(correct))


@contextlib.contextmanager
def threads(n: int | None) -> Iterator[None]:
    if not n:
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def dump_json(path: str | os.PathLike, data) -> None:
    """JSON written atomically into an existing folder (checked up front with ``check_outputs``).
    NaN / inf stay as JavaScript literals: a diverged perplexity is a result, not an error."""
    from crisp_runtime.storage.outputs import write_json

    write_json(path, data, allow_nan=True)


# ----------------------------------------------------------------------------- packs read by the tools


def load_pack_dir(directory: str | os.PathLike):
    """(layers {layer_id: PackedLayer}, plan or None, info dict) of a pack folder given as ``--crisp``;
    CliError if unreadable.

    Every tensor's sha256 is checked against the digests recorded at save (crisp-eval and evidence run
    a model over text for minutes to hours; hashing even a Mixtral-8x7B pack costs seconds).
    """
    from crisp_kernels.io import PackCheck
    from crisp_runtime.storage.pack import load_pack

    directory = Path(directory)
    if not directory.is_dir():
        raise CliError(f"--crisp {directory}: not a folder")
    try:
        pack = load_pack(directory, check=PackCheck.DIGESTS)
    except (FileNotFoundError, ValueError) as exc:
        raise CliError(f"--crisp {directory}: not a readable CRISP pack ({exc})") from exc
    return pack.layers, pack.plan, dict(pack.info or {})


def stored_weights(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized weights of a packed layer in STORED (importance) order, transformers layout: what
    :class:`MaskedExperts` takes so that width k is the pack's width-k prefix.

    One expert at a time into the result: ``dequantize_layer``'s scratch (unpacked nibbles, rows, the
    gather, the concatenation) is several times the float32 layer; on whole 63 MiB layers it set the
    streamed profile's peak: 1,352 MiB, 964 MiB expert by expert (2.05 GiB checkpoint,
    docs/big-models.md). Dequantization is per element, so the result is the same, bit for bit.
    """
    from crisp_kernels.format import PackedLayer, dequantize_layer
    from crisp_runtime.hf.checkpoint import release_freed_memory

    num_experts, inter, hidden = layer.num_experts, layer.num_neurons, layer.hidden_size  # neurons, not tail rows
    gate_up = torch.empty(num_experts, 2 * inter, hidden, dtype=torch.float32, device=layer.qweight.device)
    down = torch.empty(num_experts, hidden, inter, dtype=torch.float32, device=layer.qweight.device)
    order = torch.arange(inter, device=layer.qweight.device).unsqueeze(0)
    for e in range(num_experts):
        one = PackedLayer(layer.fmt, layer.qweight[e:e + 1], layer.scales[e:e + 1],
                          None if layer.zeros is None else layer.zeros[e:e + 1], order, tail_start=layer.tail_start)
        gate_up[e:e + 1], down[e:e + 1] = dequantize_layer(one)
        del one
        release_freed_memory()
    return gate_up, down
