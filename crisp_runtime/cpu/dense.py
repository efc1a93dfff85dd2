"""The model's dense layers in 8-bit blocks, bf16 or 4-bit rows on the CPU (``RuntimeConfig.dense``): CPU-only
serving's other half.

Under ``cpu_only`` every routed expert is computed by the CPU kernel from 4-bit rows; the rest of a token's weights
are the model's own ``nn.Linear`` layers: attention's projections, the shared experts and dense MLP layers (Qwen-MoE,
DeepSeek-MoE) and the lm head. On a Mixtral-shaped model with 605 MB of 4-bit experts attention alone read 201 MB
a token in fp32 against the experts' 151 MB, 11.7 of a token's 33 ms on one core of a 2-core AMD EPYC VM, where
llama.cpp's Q4_0 stores it at 4.5 bits (docs/cpu-kernel.md). In real checkpoints the others weigh as much (in fp32,
arithmetic from the configs: Qwen1.5-MoE-A2.7B's shared experts 138 MB a layer and its lm head 1.2 GB, against
~20 MB of routed 4-bit experts a layer and token; OLMoE's lm head 412 MB against ~450 MB of 4-bit experts a token;
Mixtral-8x7B's 524 MB against 6.3 GB).

:func:`dense_linears` finds them (:class:`DenseRole`): every ``nn.Linear`` directly inside a module named
``*self_attn``; a hybrid's Mamba, linear-attention and convolution layers' input and output projections; every
``nn.Linear`` named ``gate_proj`` / ``up_proj`` / ``down_proj`` outside an ``experts`` container (a shared expert or a
dense MLP layer; the routed experts are the CPU kernel's); the model's output embeddings. Not the router, the
shared-expert gate, the norms or the input embeddings. ``DenseWeights.Q4`` replaces them by :class:`Q4Linear`: the
weight packed once into the experts' 4-bit row format (``crisp_kernels.dense_q8.pack_dense``) and computed by the native
kernel with 8-bit activations, except the lm head, which takes Q8 (llama.cpp's Q4_0 files store their output matrix at
6.6 bits, Q6_K); ``DenseWeights.Q8`` by :class:`Int8Linear`: llama.cpp's Q8_0 layout (int8 codes, an fp16 scale per 32
weights; ``crisp_kernels.dense_int8``), 53% of bf16's bytes, ~0.5% relative rounding where Q4 rounds ~10x more.
``DenseWeights.BF16`` replaces those whose weights are all bf16 values (a bf16 checkpoint loaded in fp32) by
:class:`Bf16Linear`: the same values in half the bytes, fp32 arithmetic (``crisp_kernels.dense_bf16``), so the layer
computes what it did up to the order of the sums; a weight bf16 does not hold is kept. An lm head tied to the input
embeddings is replaced too (its original stays: the embeddings read it). ``restore()`` puts the original modules (the
same objects) back. The native kernel is needed (a C compiler at first use); the weights must be on the CPU.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from crisp_kernels import QuantFormat, cpu_native
from crisp_kernels.dense_bf16 import DenseBf16, bf16_exact, dense_bf16, pack_dense_bf16
from crisp_kernels.dense_int8 import BLOCK as INT8_BLOCK
from crisp_kernels.dense_int8 import DenseInt8, dense_int8, pack_dense_int8
from crisp_kernels.dense_q8 import DenseQ4, dense_q8, pack_dense
from crisp_kernels.experts_module import without_backward

ATTENTION_SUFFIX = "self_attn"  # transformers' attention modules (Mixtral, Qwen-MoE, DeepSeek, OLMoE, ...)
# an MLP's projections in transformers' MoE families: Qwen-MoE's ``shared_expert``, DeepSeek's ``shared_experts`` and
# its dense first layers' ``mlp``; inside an ``experts`` container they are routed experts (the CPU kernel's)
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# Granite's shared MLP (granitemoeshared, granitemoehybrid): its fused gate and up (2 I, H), then down
GRANITE_SHARED_MLP = {("shared_mlp", "input_linear"), ("shared_mlp", "output_linear")}
EXPERTS_CONTAINER = "experts"
# a hybrid's other token mixers, by the module's name: Mamba (Jamba, Granite 4.0-H), linear attention (Qwen3-Next's
# gated delta rule), short convolutions (LFM2); their input and output projections (``in_proj*``, ``out_proj``),
# nearly all of those layers' weights (from the configs: Qwen3-Next-80B-A3B's linear-attention layer 33.7 M in them,
# against 33 K of convolution; Jamba-v0.1's Mamba layer 101 M, its x_proj and dt_proj 4.5 M, which stay as loaded)
MIXER_SUFFIXES = ("mamba", "linear_attn", "conv")


class DenseRole(enum.Enum):
    """Which of a model's dense layers an ``nn.Linear`` is (:func:`dense_linears`)."""

    ATTENTION = "attention"  # q, k, v and o projections
    MIXER = "mixer"  # a hybrid's Mamba, linear-attention or convolution layer's input and output projections
    MLP = "mlp"  # a shared expert's or a dense MLP layer's projections
    HEAD = "head"  # the output embeddings (lm head)


# a rounded layer's result has no autograd graph: where its input or its original weight needs a gradient, backward
# raises this (the layers before it, or its own weight, would silently get none)
NO_GRADIENT_WHAT = "CRISP's dense layers (RuntimeConfig.dense)"
NO_GRADIENT_WHY = ("their rounded copies have no backward, so their own weights and the layers before them would get "
                   "no gradient")
NO_GRADIENT_HINT = ("Run inference under torch.no_grad() or torch.inference_mode(); to train, restore() the model "
                    "(or apply with RuntimeConfig(dense='keep'))")


def _refusing_backward(layer: nn.Module, fn, x: torch.Tensor) -> torch.Tensor:
    """``fn(x)``, whose backward raises where x or the replaced layer's own weight asks for a gradient (a weight
    being trained through the rounded copy would silently get none)."""
    source = layer.__dict__.get("_source_weight")  # the original nn.Linear's weight (swap_dense), not a parameter
    return without_backward(NO_GRADIENT_WHAT, lambda x, _: fn(x), x, source, why=NO_GRADIENT_WHY,
                            hint=NO_GRADIENT_HINT)


class DenseWeights(enum.Enum):
    """What ``apply`` does with the model's dense layers (:func:`dense_linears`)."""

    # default: where their weights are on the CPU and the native kernel builds, Q8 when every expert is computed by
    # the CPU kernel with 8-bit activations (CPU-only serving at the default precision: the dense layers in the same
    # Q8_0 arithmetic, half of bf16's bytes), else BF16 (exact; also where an in_features is off Q8's blocks); KEEP
    # where it cannot
    AUTO = "auto"
    KEEP = "keep"  # the model's own layers
    # 4-bit rows, 8-bit activations, on the CPU (for cpu_only serving without a GPU); the lm head in Q8
    Q4 = "q4"
    Q8 = "q8"  # 8-bit blocks of 32 (Q8_0), 8-bit activations, on the CPU: half of bf16's bytes, ~0.5% rounding
    # bf16 weights, fp32 activations, on the CPU: only layers whose weights are all bf16 values (a bf16 checkpoint
    # loaded in fp32), so nothing is rounded; the others are kept
    BF16 = "bf16"


class _RoundedLinear(nn.Module):
    """An ``nn.Linear`` computed from a rounded copy of its weight. ``state_dict()`` holds the original layer's
    ``weight`` and ``bias`` (``original``, kept by the swap), so ``save_pretrained`` while applied writes the
    model's own attention weights, not nothing or the rounded ones. ``exact_copy``: the weight's values in bf16
    (all bf16 values), kept where the swap released the original's storage (``keep_original=False``)."""

    kind = ""  # what the copy is, for messages
    shared: SharedProjections | None = None  # the attention's q, k and v computed by one call, or None
    shared_name = ""  # this layer's name in it

    def __init__(self, packed: DenseQ4 | DenseInt8, threads: int | None = None,
                 original: nn.Linear | None = None, exact_copy: torch.Tensor | None = None) -> None:
        super().__init__()
        self.packed = packed
        self.threads = threads
        self.in_features, self.out_features = packed.in_features, packed.out_features
        self.__dict__["_original"] = original  # not a submodule: its parameters stay out of parameters()
        self.exact_copy = exact_copy  # (O, H) bf16 or None

    def exact_weight(self) -> torch.Tensor | None:
        """The original weight's values in bf16, where the swap released its storage."""
        return self.exact_copy

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        original = self.__dict__["_original"]
        if original is None:
            raise RuntimeError(f"state_dict(): {prefix}weight is held only in {self.kind}; restore() the model "
                               "before saving it")
        weight = original.weight
        if self.exact_copy is not None and weight.numel() == 0:  # released while applied: the exact bf16 copy
            weight = self.exact_copy.to(weight.dtype)
        for name, value in (("weight", weight), ("bias", original.bias)):
            if value is not None:
                destination[prefix + name] = value if keep_vars else value.detach()


class Q4Linear(_RoundedLinear):
    """An ``nn.Linear`` computed from its weight in 4-bit rows (``crisp_kernels.dense_q8``)."""

    kind = "4-bit rows (RuntimeConfig(dense='q4'))"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # the op, opaque to dynamo (which cannot trace the native library)
            p = self.packed
            return torch.ops.crisp.dense_q8(x, p.qweight, p.scales, p.zeros, p.fmt.group_size, p.bias, self.threads)
        return _refusing_backward(self, self._compute, x)

    def _compute(self, x: torch.Tensor) -> torch.Tensor:
        if self.shared is not None:
            return self.shared.output(self.shared_name, x, self)
        return dense_q8(x, self.packed, self.threads)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, 4-bit rows "
                f"g{self.packed.fmt.group_size}, {self.packed.nbytes:,} B")


class Int8Linear(_RoundedLinear):
    """An ``nn.Linear`` computed from its weight in 8-bit blocks of 32 (``crisp_kernels.dense_int8``)."""

    kind = "8-bit blocks (RuntimeConfig(dense='q8'))"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # the op, opaque to dynamo (which cannot trace the native library)
            p = self.packed
            return torch.ops.crisp.dense_int8(x, p.qweight, p.scales, p.bias, self.threads)
        return _refusing_backward(self, self._compute, x)

    def _compute(self, x: torch.Tensor) -> torch.Tensor:
        if self.shared is not None:
            return self.shared.output(self.shared_name, x, self)
        return dense_int8(x, self.packed, self.threads)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, 8-bit blocks of {INT8_BLOCK}, "
                f"{self.packed.nbytes:,} B")


class Bf16Linear(nn.Module):
    """An ``nn.Linear`` whose weight's values are bf16, computed from it in bf16 with fp32 arithmetic
    (``crisp_kernels.dense_bf16``): the original layer's result up to the order of the sums. ``state_dict()``
    holds ``weight`` (and ``bias``) in the original's dtypes, the same values (bf16 holds them exactly), so
    ``save_pretrained`` while applied writes the model's own attention weights."""

    def __init__(self, packed: DenseBf16, threads: int | None = None, weight_dtype: torch.dtype = torch.float32,
                 bias_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.packed = packed
        self.threads = threads
        self.in_features, self.out_features = packed.in_features, packed.out_features
        self.weight_dtype, self.bias_dtype = weight_dtype, bias_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # the op, opaque to dynamo (which cannot trace the native library)
            return torch.ops.crisp.dense_bf16(x, self.packed.weight, self.packed.bias, self.threads)
        return _refusing_backward(self, self._compute, x)

    def _compute(self, x: torch.Tensor) -> torch.Tensor:
        return dense_bf16(x, self.packed, self.threads)

    def exact_weight(self) -> torch.Tensor:
        """The original weight's values in bf16 (the packed weight itself)."""
        return self.packed.weight

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        destination[prefix + "weight"] = self.packed.weight.to(self.weight_dtype)
        if self.packed.bias is not None:
            destination[prefix + "bias"] = self.packed.bias.to(self.bias_dtype or torch.float32)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bf16, {self.packed.nbytes:,} B"


# an attention's projections of the same input, computed by one call (SharedProjections)
SHARED_INPUT_NAMES = ("q_proj", "k_proj", "v_proj")
ROW_FIELDS = ("qweight", "scales", "zeros", "bias")  # a packed weight's tensors with one row per output


class SharedProjections:
    """An attention module's q, k and v projections (:class:`Int8Linear` or :class:`Q4Linear`, the same input)
    computed by one native call over their rows stacked, for each new input: the first of them called with an input
    computes all three and holds the other two outputs until they are asked for with that same input.

    Why: transformers' attention calls ``q_proj(x)``, ``k_proj(x)``, ``v_proj(x)`` in turn; three calls quantize x
    three times, enter the kernel's thread team three times and restart its row prefetch at each matrix. With the
    peer benchmark's large model's shapes (H 2048, 8 KV heads: 2048 + 1024 + 1024 rows) one call took 980 against
    1,142 us a layer on one core and 569 against 678 on two (2-core AMD EPYC VM, 8 layers' weights in turn). In that
    model's decode (40 interleaved rounds each, a noisy hour) attention took 8% less time on one core and 5% less on
    two (medians of the per-round ratio; quartiles 0.87-0.97 and 0.89-1.00), the whole token 4% and 1% less, which
    is within that machine's noise.

    Each output row is the dot of one weight row (the kernel's sums do not depend on which rows share a pass), so
    the results are the three calls' bits. An output is handed out only for the very input tensor it was computed
    from, unmodified since (its version counter); an inference-mode tensor has no version counter, so such an input
    is computed by the layer alone. The layers' own ``packed`` weights are views of the stacked rows (no second
    copy)."""

    def __init__(self, stacked: DenseInt8 | DenseQ4, sizes: tuple[int, ...], threads: int | None) -> None:
        self.stacked = stacked  # (sum of O, H)
        self.launch = dense_int8 if isinstance(stacked, DenseInt8) else dense_q8  # the layers' own launcher
        self.sizes, self.threads = sizes, threads  # rows of q, k and v (SHARED_INPUT_NAMES' order)
        self._pending: tuple | None = None  # (x, its version, {name: output}) of the last input

    def output(self, name: str, x: torch.Tensor, layer: _RoundedLinear) -> torch.Tensor:
        """Layer ``name``'s output for ``x``: held from an earlier call with this input, else all computed now."""
        try:
            version = x._version
        except RuntimeError:  # an inference tensor: no version counter to tell an in-place change by
            return self.launch(x, layer.packed, self.threads)
        pending = self._pending
        if pending is not None and pending[0] is x and pending[1] == version:
            held = pending[2].pop(name, None)
            if held is not None:
                if not pending[2]:
                    self._pending = None  # all handed out: x is not held any longer
                return held
        out = self.launch(x, self.stacked, self.threads)  # (..., sum of O)
        parts = dict(zip(SHARED_INPUT_NAMES, (part.contiguous() for part in out.split(self.sizes, -1)), strict=True))
        mine = parts.pop(name)
        self._pending = (x, version, parts)
        return mine


def _share_projections(attention: nn.Module, threads: int | None) -> bool:
    """Stack ``attention``'s q, k and v rows into one :class:`SharedProjections` where all three are
    :class:`Int8Linear` layers, or all :class:`Q4Linear` layers of one format, of the same input width with a bias
    each or none; their ``packed`` become views of the stacked rows. Returns whether it did."""
    layers = [getattr(attention, name, None) for name in SHARED_INPUT_NAMES]
    kind = type(layers[0])
    if kind not in (Int8Linear, Q4Linear) or not all(type(layer) is kind for layer in layers):
        return False
    parts = [layer.packed for layer in layers]
    if len({p.in_features for p in parts}) != 1 or len({p.bias is None for p in parts}) != 1:
        return False
    if kind is Q4Linear and len({(p.fmt, p.zeros is None) for p in parts}) != 1:
        return False

    # the per-row tensors (DenseQ4's zeros too; a None field stays None), stacked, and each layer's rows of them
    fields = [f for f in ROW_FIELDS if hasattr(parts[0], f) and getattr(parts[0], f) is not None]
    stacked = replace(parts[0], **{f: torch.cat([getattr(p, f) for p in parts]) for f in fields})
    shared = SharedProjections(stacked, tuple(p.out_features for p in parts), threads)
    start = 0
    for name, layer, part in zip(SHARED_INPUT_NAMES, layers, parts, strict=True):
        stop = start + part.out_features
        layer.packed = replace(stacked, **{f: getattr(stacked, f)[start:stop] for f in fields})
        layer.shared, layer.shared_name = shared, name
        start = stop
    return True


@dataclass
class DenseSwap:
    """The layers :func:`swap_dense` replaced: ``(parent, attribute, original module)``; :meth:`restore` undoes it."""

    swapped: list = field(default_factory=list)
    nbytes: int = 0  # of the packed rows
    original_nbytes: int = 0  # of the weights they replace
    # layers left as they were (BF16: a weight bf16 does not hold exactly; Q8: a block scale fp16 cannot hold)
    kept: int = 0
    chosen: str = ""  # what was done: "bf16", "q4", "q8" or, for AUTO, "keep"
    reason: str = ""  # why AUTO chose it
    # originals whose weight storage was released while applied (keep_original=False, weights all bf16 values):
    # refilled on restore from the replacement's bf16 copy (``exact_weight()``), which holds their values exactly
    released: dict = field(default_factory=dict)
    shared: int = 0  # attention modules whose q, k and v run as one call (SharedProjections)
    roles: dict = field(default_factory=dict)  # layers replaced, by DenseRole value
    role_bytes: dict = field(default_factory=dict)  # their packed bytes, by DenseRole value

    def restore(self, to_dtype: torch.dtype | None = None) -> None:
        """Put the original modules back (idempotent); ``to_dtype``: the dtype the model was converted to while
        applied (None: unchanged), which the originals, held outside the model, are then converted to as
        ``Module.to(dtype)`` would have (floating parameters and buffers only)."""
        self.roles.clear()
        self.role_bytes.clear()
        while self.swapped:
            parent, name, original = self.swapped.pop()
            dtype = self.released.pop(id(original), None)
            if dtype is not None:
                original.weight.data = getattr(parent, name).exact_weight().to(dtype)
            if to_dtype is not None:
                original.to(to_dtype)
            setattr(parent, name, original)

    def info(self) -> dict:
        out = {"layers": len(self.swapped), "bytes": self.nbytes, "original_bytes": self.original_nbytes,
               "kept": self.kept, "chosen": self.chosen, "shared_qkv": self.shared, "roles": dict(self.roles),
               "role_bytes": dict(self.role_bytes)}
        return out | ({"reason": self.reason} if self.reason else {})


def attention_linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """Every ``nn.Linear`` directly inside a module whose name ends with ``self_attn``, as (parent, name, linear)."""
    return [(parent, name, linear) for parent, name, linear, role in dense_linears(model)
            if role is DenseRole.ATTENTION]


def dense_linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear, DenseRole]]:
    """The model's dense layers as (parent, name, linear, role), each once: every ``nn.Linear`` directly inside a
    ``*self_attn`` module; a hybrid's mixer projections (``in_proj*``, ``out_proj`` directly inside a module named
    in ``MIXER_SUFFIXES``); every ``nn.Linear`` named as an MLP projection (``MLP_PROJECTIONS``, or Granite's
    ``GRANITE_SHARED_MLP``) with no ``experts`` container on its path; the output embeddings where they are an
    ``nn.Linear``."""
    out, seen = [], set()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for path, parent in model.named_modules():
        parts = path.split(".") if path else []
        for name, child in parent.named_children():
            if type(child) is not nn.Linear or id(child) in seen:
                continue
            if child is head:
                role = DenseRole.HEAD
            elif parts and parts[-1] == ATTENTION_SUFFIX:
                role = DenseRole.ATTENTION
            elif parts and parts[-1] in MIXER_SUFFIXES and (name.startswith("in_proj") or name == "out_proj"):
                role = DenseRole.MIXER
            elif EXPERTS_CONTAINER not in parts and (
                    name in MLP_PROJECTIONS or parts and (parts[-1], name) in GRANITE_SHARED_MLP):
                role = DenseRole.MLP
            else:
                continue
            seen.add(id(child))
            out.append((parent, name, child, role))
    return out


def _tied(model: nn.Module, linear: nn.Linear) -> bool:
    """Whether ``linear``'s weight is the input embeddings' too (tied embeddings)."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return getattr(embeddings, "weight", None) is linear.weight


def _auto_refusal(found) -> str:
    """Why ``DenseWeights.AUTO`` keeps the dense layers ("" when it replaces them)."""
    if not found:
        return f"no nn.Linear inside a '*{ATTENTION_SUFFIX}' module, no mixer or MLP projection, no lm head"
    if any(linear.weight.device.type != "cpu" or linear.weight.is_meta for _, _, linear, _ in found):
        return "the dense layers' weights are not on the CPU"
    if not cpu_native.available():
        return "the native CPU kernel does not build here"
    return ""


def _auto_choice(found, exact_reason: str) -> tuple[DenseWeights, str, set[int]]:
    """What ``DenseWeights.AUTO`` replaces the dense layers with, and why (after :func:`_auto_refusal`), and the
    ids of the layers that take bf16 instead of Q8 (an in_features off Q8's blocks: the others still take Q8)."""
    if exact_reason:
        return DenseWeights.BF16, f"{exact_reason}: bf16, exact", set()
    reason = "8-bit activations, as the CPU experts compute: llama.cpp's Q8_0 layout"
    off = [linear for _, _, linear, _ in found if linear.in_features % INT8_BLOCK]
    if off:
        widths = sorted({linear.in_features for linear in off})
        reason += (f"; {len(off)} with in_features {widths}, not a multiple of the 8-bit block {INT8_BLOCK}, in bf16 "
                   "(kept as loaded where their values are not bf16)")
    return DenseWeights.Q8, reason, {id(linear) for linear in off}


def _layer_format(dense: DenseWeights, role: DenseRole) -> DenseWeights:
    """The format one layer takes under ``dense``: the lm head in Q8 where the rest take Q4 (a vocabulary's
    logits at 4 bits would round the one output a token is chosen from; llama.cpp's Q4_0 keeps it at 6.6 bits)."""
    return DenseWeights.Q8 if dense is DenseWeights.Q4 and role is DenseRole.HEAD else dense


def swap_dense(model: nn.Module, dense: DenseWeights, *, fmt: QuantFormat | None = None,
               threads: int | None = None, keep_original: bool = True, exact_reason: str = "") -> DenseSwap | None:
    """Replace the model's dense layers (:func:`dense_linears`) per ``dense`` (None for KEEP); refuses layers not on
    the CPU or (Q4, Q8) whose in_features the format's group does not divide, before replacing any. AUTO never
    refuses: where it can (``_auto_refusal``) it takes Q8 (BF16 for a layer whose in_features is off Q8's blocks), or
    BF16 when ``exact_reason`` says why the dense layers should stay exact (the caller's experts are not computed by
    the CPU's 8-bit kernel), and otherwise replaces nothing; the swap's ``reason`` says why.
    keep_original=False: a BF16 layer's original weight storage is released while applied (its values are the
    bf16 copy's, put back by ``restore``); a Q4 or Q8 layer's likewise where its values are all bf16, a bf16 copy
    kept beside the rounded rows; other originals stay (``state_dict`` and ``restore`` need them: the rounded copy
    cannot give them back), and so does a tied lm head's (the input embeddings read it)."""
    dense = DenseWeights(dense)
    if dense is DenseWeights.KEEP:
        return None
    fmt = QuantFormat() if fmt is None else fmt
    found = dense_linears(model)
    reason, exact_layers = "", set()
    if dense is DenseWeights.AUTO:
        reason = _auto_refusal(found)
        if reason:
            return DenseSwap(chosen="keep", reason=reason)
        dense, reason, exact_layers = _auto_choice(found, exact_reason)

    def kind_of(linear: nn.Linear, role: DenseRole) -> DenseWeights:
        return DenseWeights.BF16 if id(linear) in exact_layers else _layer_format(dense, role)

    if not found:
        raise ValueError(f"dense={dense.value!r}: the model has no nn.Linear inside a '*{ATTENTION_SUFFIX}' module, "
                         "no mixer or MLP projection and no lm head")
    for _, name, linear, role in found:
        where = f"the {role.value} layer {name}"
        if linear.weight.device.type != "cpu" or linear.weight.is_meta:
            raise ValueError(f"dense={dense.value!r}: {where} is on {linear.weight.device}; the replaced "
                             "dense layers run on the CPU (CPU-only serving)")
        layer_kind = kind_of(linear, role)
        if layer_kind is DenseWeights.Q4 and linear.in_features % fmt.group_size:
            raise ValueError(f"dense={dense.value!r}: {where} has in_features {linear.in_features}, not a "
                             f"multiple of the group size {fmt.group_size}")
        if layer_kind is DenseWeights.Q8 and linear.in_features % INT8_BLOCK:
            raise ValueError(f"dense={dense.value!r}: {where} has in_features {linear.in_features}, not a "
                             f"multiple of the 8-bit block {INT8_BLOCK}")
    swap = DenseSwap(chosen=dense.value, reason=reason)
    for parent, name, linear, role in found:
        layer_kind = kind_of(linear, role)
        # keep_original=False: an original whose values are all bf16 (and not held in bf16 already) is released
        # while applied and refilled exactly from a bf16 copy (BF16: the packed weight itself; Q4 / Q8: kept beside
        # the rounded rows, 2 bytes a weight where an fp32 original costs 4); never a tied head's
        release = (not keep_original and linear.weight.dtype != torch.bfloat16 and not _tied(model, linear)
                   and (layer_kind is DenseWeights.BF16 or bf16_exact(linear.weight)))
        copy = linear.weight.detach().to(torch.bfloat16).contiguous() \
            if release and layer_kind is not DenseWeights.BF16 else None
        if layer_kind is DenseWeights.BF16:
            if not bf16_exact(linear.weight):
                swap.kept += 1
                continue
            packed = pack_dense_bf16(linear.weight, linear.bias)
            setattr(parent, name, Bf16Linear(packed, threads, linear.weight.dtype,
                                             None if linear.bias is None else linear.bias.dtype))
        elif layer_kind is DenseWeights.Q8:
            try:
                packed = pack_dense_int8(linear.weight, linear.bias)
            except ValueError:  # a block scale fp16 cannot hold, or a non-finite weight: kept, counted
                swap.kept += 1
                continue
            setattr(parent, name, Int8Linear(packed, threads, original=linear, exact_copy=copy))
        else:
            packed = pack_dense(linear.weight, fmt, linear.bias)
            setattr(parent, name, Q4Linear(packed, threads, original=linear, exact_copy=copy))
        # the original weight, for the gradient refusal (in __dict__: not a parameter of the replacement)
        getattr(parent, name).__dict__["_source_weight"] = linear.weight
        swap.swapped.append((parent, name, linear))
        swap.roles[role.value] = swap.roles.get(role.value, 0) + 1
        swap.role_bytes[role.value] = swap.role_bytes.get(role.value, 0) + packed.nbytes
        swap.nbytes += packed.nbytes
        swap.original_nbytes += linear.weight.nbytes + (0 if linear.bias is None else linear.bias.nbytes)
        if release:
            swap.released[id(linear)] = linear.weight.dtype  # (a bf16 weight is the copy itself: nothing to free)
            linear.weight.data = torch.empty(0, dtype=linear.weight.dtype)
    if dense in (DenseWeights.Q8, DenseWeights.Q4):
        attentions = {id(p): p for p, _, _, role in found if role is DenseRole.ATTENTION}
        swap.shared = sum(_share_projections(parent, threads) for parent in attentions.values())
    return swap
