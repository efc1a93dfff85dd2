"""CRISP kernels: the neuron-major 4-bit prefix format and the expert kernels over its first k neurons.

Importing this package touches no GPU and works without Triton (the pure-torch reference runs).
It registers the ``torch.ops.crisp`` custom ops (``ops.py``), which records Python functions with
the dispatcher and nothing more.
"""

from . import ops  # noqa: F401  (registers torch.ops.crisp.*)
from .expert_mlp import (
    Backend,
    expert_mlp,
    expert_mlp_accumulate_,
    expert_mlp_accumulate_ref_,
    expert_mlp_ref,
    select_backend,
)
from .experts_module import CrispExperts
from .format import (
    GPT_OSS_SWIGLU,
    SILU_GLU,
    Activation,
    ActivationKind,
    PackedExpert,
    PackedLayer,
    Proj,
    QuantFormat,
    dequantize_expert,
    dequantize_layer,
    gpt_oss_to_v5,
    layer_biases,
    layer_sqnr_db,
    pack_expert,
    pack_layer,
)
from .io import PackFormatError, load_packed, read_packed_metadata, save_packed

__all__ = [
    "GPT_OSS_SWIGLU",
    "SILU_GLU",
    "Activation",
    "ActivationKind",
    "Backend",
    "CrispExperts",
    "PackFormatError",
    "PackedExpert",
    "PackedLayer",
    "Proj",
    "QuantFormat",
    "dequantize_expert",
    "dequantize_layer",
    "expert_mlp",
    "expert_mlp_accumulate_",
    "expert_mlp_accumulate_ref_",
    "expert_mlp_ref",
    "gpt_oss_to_v5",
    "layer_biases",
    "layer_sqnr_db",
    "load_packed",
    "pack_expert",
    "pack_layer",
    "read_packed_metadata",
    "save_packed",
    "select_backend",
]
