"""The models of ``crisp-bench peer``: a large random Mixtral-shaped checkpoint, its CRISP pack, and GGUF files.

Everything this module writes goes into a work folder the command owns (:func:`work_dir`:
``$CRISP_CACHE_DIR/peer`` or ``~/.cache/crisp/peer``), one sub-folder per artifact named by a digest of
what it is made from (shape, seed, source file sizes and times, quantization). An artifact is built in a
temporary folder beside it and renamed into place only when complete, with a ``complete.json`` marker
holding that digest; a folder of that name without a matching marker is refused (never deleted: the user
may remove it). So a second run reuses the large model (2.3 GB, about a minute to write here) and the GGUF
files, and a changed spec builds anew.

GGUF: written with the ``gguf`` package's writer (the ``peers`` extra) as llama.cpp's ``llama``
architecture with experts (``blk.N.ffn_{gate,up,down}_exps``), the tensor layout of llama.cpp's own
converter (``convert_hf_to_gguf.py``, LlamaModel): the query and key rows permuted from the Hugging Face
rotate-half order to llama.cpp's interleaved rope pairs, the experts of a layer stacked as (E, I, H) /
(E, H, I). The byte-level tokenizer of our models becomes the GGUF ``none`` vocabulary with
``vocab_size`` dummy tokens: token ids are fed directly. llama.cpp's quantizer (``llama_model_quantize``,
through llama-cpp-python) then makes Q4_0 and Q4_K_M. The conversion is checked against the Hugging Face
model (``peer_engines.check_conversion``: F32 GGUF logits against fp32 logits) before any timing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from crisp_runtime.storage.outputs import write_json

from .common import REPO_ROOT, CliError

MARKER = "complete.json"
TINY_MODEL = REPO_ROOT / "models" / "tiny-mixtral"
TINY_PACK = REPO_ROOT / "models" / "tiny-mixtral-crisp"
# GGUF file types of llama.cpp (llama.h, enum llama_ftype)
FTYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_K_M": 15}
PEER_QUANTS = ("Q4_0", "Q4_K_M")
# The large model's plan: the tiers and Warm width crisp-profile's search chose for the committed tiny model
# (<= 54% of full-width bytes per token there: hot mass 0, cold mass 0.5, Warm 40 of 256 neurons), given
# directly: the search's forward passes over a 1.1 B-parameter model took > 20 min on the 2-core VM.
# The bytes a decode actually reads at these widths are measured (peer_engines: stats()["bytes_read_per_token"]).
PLAN_WARM_WIDTH = 40 / 256


class PeerError(CliError):
    """A peer benchmark input or artifact that cannot be used (the message says which and why)."""


class PeerUnavailable(PeerError):
    """llama-cpp-python or gguf is missing: ``pip install 'crisp-moe[peers]'``."""


def require_peers():
    """(llama_cpp, gguf), or PeerUnavailable naming the extra."""
    try:
        import gguf
        import llama_cpp
    except ImportError as err:
        raise PeerUnavailable(f"crisp-bench peer needs llama-cpp-python and gguf ({err.name} is missing): "
                              "pip install 'crisp-moe[peers]' (llama-cpp-python compiles llama.cpp)") from err
    return llama_cpp, gguf


@dataclass(frozen=True)
class LargeShape:
    """A Mixtral-shaped model whose 4-bit experts dominate a token's bytes. Default: H 2048, I 5632,
    8 experts top-2, 4 layers: 18.9 MB per 4-bit expert (g 64, zero points), 605 MB of experts, 151 MB of
    them read per token at full width; attention 50 MB per layer in fp32."""

    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_hidden_layers: int = 4
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    vocab_size: int = 256
    max_position_embeddings: int = 4096
    init_std: float = 0.02  # transformers' initializer_range for Mixtral
    seed: int = 0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if name == "init_std":
                if not value > 0:
                    raise ValueError(f"LargeShape.init_std: expected > 0, got {value!r}")
            elif not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "seed" else 1):
                raise ValueError(f"LargeShape.{name}: expected a positive int, got {value!r}")
        if self.hidden_size % self.num_attention_heads or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("LargeShape: heads must divide hidden_size and kv heads the heads")
        if self.num_experts_per_tok > self.num_local_experts:
            raise ValueError("LargeShape: num_experts_per_tok > num_local_experts")

    def config(self) -> dict:
        return {
            "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_act": "silu",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "num_local_experts": self.num_local_experts,
            "num_experts_per_tok": self.num_experts_per_tok, "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings, "rms_norm_eps": 1e-5,
            "rope_theta": 1e6, "tie_word_embeddings": False, "initializer_range": self.init_std,
            "attention_dropout": 0.0, "router_aux_loss_coef": 0.01, "output_router_logits": False,
            "sliding_window": None, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
            "dtype": "bfloat16", "use_cache": True,
        }

    def expert_params(self) -> int:
        return self.num_hidden_layers * self.num_local_experts * 3 * self.hidden_size * self.intermediate_size


# ---------------------------------------------------------------------------- the work folder


def work_dir() -> Path:
    """The command's own folder for models and GGUF files (created on first use)."""
    base = os.environ.get("CRISP_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "crisp")
    return Path(base) / "peer"


def digest(spec: dict) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:16]


def file_stamp(path: Path) -> dict:
    """What identifies an input file or folder for a digest: names, sizes and modification times."""
    path = Path(path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return {str(p.relative_to(path) if path.is_dir() else p.name): [p.stat().st_size, int(p.stat().st_mtime)]
            for p in files}


def _sizes(folder: Path) -> dict[str, int]:
    """{path relative to ``folder``: bytes} of every file in it but the marker."""
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != MARKER}


def cached(root: Path, name: str, spec: dict, build: Callable[[Path], None], log=print) -> Path:
    """``root/<name>-<digest(spec)>``: reused when its marker holds the same spec and every file it lists still has
    its built size (a truncated or replaced GGUF or checkpoint is named, not read), else built by
    ``build(tmp_folder)`` into a temporary folder and renamed into place with the marker."""
    key = digest(spec)
    final = Path(root) / f"{name}-{key}"
    marker = final / MARKER
    if final.exists():
        try:
            record = json.loads(marker.read_text())
            ok = isinstance(record, dict) and record.get("spec_digest") == key
        except (OSError, ValueError):
            ok = False
        if not ok:
            raise PeerError(f"{final} exists without a complete marker ({MARKER}) for this spec: an interrupted "
                            "build? Remove that folder to build it again")
        built, now = record.get("files"), _sizes(final)
        if isinstance(built, dict):  # a marker written before sizes were recorded has none to compare
            for file, size in built.items():
                if now.get(file) != size:
                    got = "missing" if file not in now else f"{now[file]:,} bytes"
                    raise PeerError(f"{final}: {file} is {got}, built as {size:,} bytes (damaged or edited); "
                                    "remove that folder to build it again")
        return final
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    except OSError as exc:  # a folder that cannot hold files (a read-only or special file system, no permission)
        raise PeerError(f"{root}: cannot make the work folder or a file in it ({exc.strerror or exc}); give "
                        "--work-dir a writable folder") from None
    try:
        t0 = time.perf_counter()
        build(tmp)
        write_json(tmp / MARKER, {"spec_digest": key, "spec": spec, "build_s": round(time.perf_counter() - t0, 1),
                                  "files": _sizes(tmp)})
        os.replace(tmp, final)
        log(f"built {final} in {time.perf_counter() - t0:.0f} s")
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)  # our own temporary folder, never a user's
    return final


# ---------------------------------------------------------------------------- the large model


def write_large_model(folder: Path, shape: LargeShape, tokenizer_from: Path = TINY_MODEL) -> None:
    """A random-weight Mixtral checkpoint (bf16 safetensors, per-expert w1/w2/w3 tensors as the committed
    tiny model's) with the byte-level tokenizer of ``tokenizer_from``. Weights: normal(0, init_std), norms 1,
    drawn layer by layer from one seeded generator."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(shape.seed)
    h, i, kv = shape.hidden_size, shape.intermediate_size, shape.hidden_size // shape.num_attention_heads

    def rnd(*dims):
        return (torch.randn(*dims, generator=gen) * shape.init_std).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": rnd(shape.vocab_size, h), "lm_head.weight": rnd(shape.vocab_size, h),
               "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    for layer in range(shape.num_hidden_layers):
        p = f"model.layers.{layer}."
        tensors[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        tensors[p + "self_attn.q_proj.weight"] = rnd(h, h)
        tensors[p + "self_attn.k_proj.weight"] = rnd(kv * shape.num_key_value_heads, h)
        tensors[p + "self_attn.v_proj.weight"] = rnd(kv * shape.num_key_value_heads, h)
        tensors[p + "self_attn.o_proj.weight"] = rnd(h, h)
        tensors[p + "block_sparse_moe.gate.weight"] = rnd(shape.num_local_experts, h)
        for e in range(shape.num_local_experts):
            q = f"{p}block_sparse_moe.experts.{e}."
            tensors[q + "w1.weight"] = rnd(i, h)
            tensors[q + "w2.weight"] = rnd(h, i)
            tensors[q + "w3.weight"] = rnd(i, h)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    (folder / "config.json").write_text(json.dumps(shape.config(), indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_from / name, folder / name)
    (folder / "README.txt").write_text(f"Random weights (not trained), made by crisp-bench peer: {shape}\n")


def large_model(shape: LargeShape, root: Path | None = None, log=print) -> Path:
    root = work_dir() if root is None else root
    return cached(root, "large-mixtral", {"shape": asdict(shape), "kind": "random-mixtral-v1"},
                  lambda tmp: write_large_model(tmp, shape), log=log)


def profile_pack(model_dir: Path, calib_text: Path, root: Path | None = None, *, samples: int = 8,
                 seq_len: int = 128, threads: int | None = None, log=print) -> Path:
    """The CRISP pack of ``model_dir`` made by ``crisp-profile`` on a little calibration text (``samples``
    windows of ``seq_len`` tokens), routing-weight dominance and the tiers of ``PLAN_WARM_WIDTH``'s comment."""
    from crisp_tools.profiler.cli import main as profile_main

    root = work_dir() if root is None else root
    spec = {"model": file_stamp(model_dir), "text": file_stamp(calib_text), "samples": samples, "seq_len": seq_len,
            "warm_width": PLAN_WARM_WIDTH, "kind": "crisp-profile-v3"}

    def build(tmp: Path) -> None:
        out = tmp / "pack"
        argv = ["--model", str(model_dir), "--data", str(calib_text), "--out", str(out), "--samples", str(samples),
                "--seq-len", str(seq_len), "--batch-size", "4", "--dtype", "bfloat16", "--quiet",
                "--dominance", "routing-weight", "--hot-mass", "0", "--cold-mass", "0.5", "--warm-width",
                str(PLAN_WARM_WIDTH),
                # routing-weight dominance needs no masking: measure none (the masked forward passes of its
                # per-pair labels, 64 windows by default, took > 20 min here)
                "--dominance-samples", "1", "--dominance-min-tokens", str(10**9)]
        if threads:
            argv += ["--threads", str(threads)]
        rc = profile_main(argv)
        if rc != 0:
            raise PeerError(f"crisp-profile {' '.join(argv)} failed (exit {rc})")
        for p in out.iterdir():
            os.replace(p, tmp / p.name)
        out.rmdir()

    return cached(root, f"{model_dir.name}-crisp", spec, build, log=log)


# ---------------------------------------------------------------------------- GGUF


def _permute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Query / key rows from Hugging Face's rotate-half order to llama.cpp's interleaved pairs
    (what llama.cpp's converter does for the llama architecture)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model_dir: Path, path: Path, *, dtype: str = "F32") -> None:
    """``model_dir`` (a Mixtral checkpoint with per-expert w1/w2/w3 tensors) as a GGUF file of llama.cpp's
    ``llama`` architecture with experts; tensors in ``dtype`` (F32 or F16; norms and the router in F32)."""
    import numpy as np
    from safetensors import safe_open

    _, gguf = require_peers()
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    if cfg.get("model_type") != "mixtral":
        raise PeerError(f"{model_dir}: model_type {cfg.get('model_type')!r}; the GGUF writer takes mixtral")
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    n_layer, n_exp = cfg["num_hidden_layers"], cfg["num_local_experts"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head
    rope = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 1e6)
    np_dtype = {"F32": np.float32, "F16": np.float16}[dtype]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(Path(model_dir).name)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(n_layer)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(rope))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_expert_count(n_exp)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(FTYPES[dtype])
    w.add_tokenizer_model("none")  # token ids are fed directly: llama.cpp adds vocab_size dummy tokens

    with safe_open(str(Path(model_dir) / "model.safetensors"), "pt") as f:
        def get(name):
            return f.get_tensor(name).float()

        def add(name, t, keep_f32=False):
            w.add_tensor(name, t.numpy().astype(np.float32 if keep_f32 else np_dtype))

        add("token_embd.weight", get("model.embed_tokens.weight"))
        add("output_norm.weight", get("model.norm.weight"), keep_f32=True)
        add("output.weight", get("lm_head.weight"))
        for i in range(n_layer):
            p, b = f"model.layers.{i}.", f"blk.{i}."
            add(b + "attn_norm.weight", get(p + "input_layernorm.weight"), keep_f32=True)
            add(b + "ffn_norm.weight", get(p + "post_attention_layernorm.weight"), keep_f32=True)
            add(b + "attn_q.weight", _permute_rope(get(p + "self_attn.q_proj.weight"), n_head))
            add(b + "attn_k.weight", _permute_rope(get(p + "self_attn.k_proj.weight"), n_kv))
            add(b + "attn_v.weight", get(p + "self_attn.v_proj.weight"))
            add(b + "attn_output.weight", get(p + "self_attn.o_proj.weight"))
            add(b + "ffn_gate_inp.weight", get(p + "block_sparse_moe.gate.weight"), keep_f32=True)
            for src, dst in (("w1", "ffn_gate_exps"), ("w3", "ffn_up_exps"), ("w2", "ffn_down_exps")):
                add(b + dst + ".weight", torch.stack(
                    [get(f"{p}block_sparse_moe.experts.{e}.{src}.weight") for e in range(n_exp)]))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()


def quantize_gguf(src: Path, dst: Path, quant: str, threads: int) -> None:
    """llama.cpp's own quantizer (``llama_model_quantize``) from ``src`` to ``dst`` as ``quant``."""
    llama_cpp, _ = require_peers()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[quant]
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0 or not dst.is_file():
        raise PeerError(f"llama.cpp's quantizer failed for {src} -> {quant} (code {rc})")


def gguf_files(model_dir: Path, quants, root: Path | None = None, *, threads: int = 1, log=print) -> dict[str, Path]:
    """``{quant: path}`` for F32 (the conversion's check) and each of ``quants``, one cached folder per model."""
    root = work_dir() if root is None else root
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    # the large model's unquantized GGUF in F16 (2.3 GB against 4.6 in F32); the tiny model's in F32 (exact)
    base = "F32" if 3 * cfg["hidden_size"] * cfg["intermediate_size"] < 2**22 else "F16"
    out = {}
    for quant in (base, *quants):
        spec = {"model": file_stamp(model_dir), "quant": quant, "base": base, "kind": "gguf-llama-v1"}
        if quant == base:
            folder = cached(root, f"{Path(model_dir).name}-gguf-{quant}", spec,
                            lambda tmp: write_gguf(model_dir, tmp / "model.gguf", dtype=base), log=log)
        else:
            src = out[base]
            folder = cached(root, f"{Path(model_dir).name}-gguf-{quant}", spec,
                            lambda tmp, src=src, quant=quant: quantize_gguf(src, tmp / "model.gguf", quant, threads),
                            log=log)
        out[quant] = folder / "model.gguf"
    return out
