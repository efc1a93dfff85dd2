"""Peak host memory of packing and loading a checkpoint larger than the memory they use.

    python -m crisp_tools.stream_rss --out /tmp/rss --size-gb 2 --json rss.json

1. writes a synthetic from_config Mixtral checkpoint of about ``--size-gb`` (float32, one
   safetensors shard per decoder layer, random weights; not measured);
2. in a fresh subprocess each, reports the peak resident set (``VmHWM`` from /proc/self/status)
   and the resident set after importing torch + transformers (the floor every step pays) of:
   - ``pack``: crisp_runtime.checkpoint.load_skeleton + pack_checkpoint + save_pack (what a
     full-width pack of the checkpoint costs: one layer of float32 experts at a time);
   - ``load``: crisp_runtime.load_model(checkpoint, pack) and one forward of 32 tokens;
   - ``from_pretrained`` (``--compare``): transformers' own load of the same checkpoint and the same
     forward, for scale.

Linux only (/proc). The measurement code is this file's; everything measured is the runtime's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from crisp_runtime.outputs import OutputPathError, check_output, write_bytes

GIB = 2**30


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def mixtral_config(size_bytes: int, layers: int = 12, hidden: int = 1024):
    """A Mixtral config whose float32 weights are about ``size_bytes`` (experts ~95% of them)."""
    from transformers import MixtralConfig

    experts = 8
    per_layer = size_bytes / layers
    inter = max(64, int(per_layer / (experts * 3 * hidden * 4)) // 64 * 64)
    return MixtralConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=2, num_local_experts=experts,
                         num_experts_per_tok=2, max_position_embeddings=256, tie_word_embeddings=False)


def write_checkpoint(out: Path, config, seed: int = 0) -> int:
    """A checkpoint of ``config`` in ``out`` (one shard per layer, v5 fused expert names); returns its bytes."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    groups: dict[str, list[str]] = {}
    for name in shapes:
        parts = name.split(".")
        key = f"layer{int(parts[2]):03d}" if name.startswith("model.layers.") else "rest"
        groups.setdefault(key, []).append(name)
    gen = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    for key, names in sorted(groups.items()):
        tensors = {}
        for name in names:
            if name.endswith("norm.weight"):
                tensors[name] = torch.ones(shapes[name])
            else:
                tensors[name] = torch.randn(shapes[name], generator=gen) * 0.02
        file = f"model-{key}.safetensors"
        save_file(tensors, out / file, metadata={"format": "pt"})
        total += sum(t.numel() * 4 for t in tensors.values())
        weight_map.update({name: file for name in names})
        del tensors
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}, indent=1))
    return total


def _step(kind: str, checkpoint: Path, pack: Path) -> dict:
    """One measured step, run in this (fresh) process."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import crisp_runtime
    import crisp_runtime.checkpoint  # noqa: F401 - part of the floor

    # The floor: torch, transformers, CRISP and the model's modeling code imported (a meta model built), ~415 MiB
    # here, paid whatever the checkpoint's size; what the step adds above it is what the checkpoint costs.
    with torch.device("meta"):
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(checkpoint, local_files_only=True))
    floor = _status_kib("VmRSS")
    out = {"step": kind, "rss_after_imports_mib": floor / 1024}
    if kind == "pack":
        from crisp_runtime.checkpoint import checkpoint_weights_sha256, load_skeleton, pack_checkpoint
        from crisp_runtime.pack import model_info, save_pack

        model, cmap = load_skeleton(checkpoint)
        layers = pack_checkpoint(model, cmap)
        info = {**model_info(model), "model": {"weights_sha256": checkpoint_weights_sha256(model, cmap)}}
        save_pack(pack, layers, info=info)
        out["pack_bytes"] = sum(p.stat().st_size for p in pack.iterdir())
    elif kind == "load":
        model, handle = crisp_runtime.load_model(checkpoint, pack)
        with torch.no_grad():
            model(torch.arange(32).unsqueeze(0))
        out["tokens"] = handle.stats()["tokens"]
    elif kind == "from_pretrained":
        # transformers maps the safetensors file and its tensors may alias the mapping: pages count (VmHWM includes
        # file-backed pages) once touched, so the same forward as ``load`` is run.
        model = AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True)
        with torch.no_grad():
            model(torch.arange(32).unsqueeze(0))
    else:
        raise ValueError(kind)
    # At the end (not peaks): anonymous memory (copies) vs file-backed pages (mapped safetensors, which the kernel
    # can drop and re-read under memory pressure).
    out["end_rss_anon_mib"] = _status_kib("RssAnon") / 1024
    out["end_rss_file_mib"] = _status_kib("RssFile") / 1024
    out["peak_rss_mib"] = _status_kib("VmHWM") / 1024
    out["peak_above_imports_mib"] = out["peak_rss_mib"] - out["rss_after_imports_mib"]
    return out


def measure(kind: str, checkpoint: Path, pack: Path) -> dict:
    """Run one step in a subprocess (its own peak) and return what it reports."""
    cmd = [sys.executable, "-m", "crisp_tools.stream_rss", "--step", kind, "--checkpoint", str(checkpoint),
           "--pack", str(pack)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{kind} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m crisp_tools.stream_rss", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="work folder (checkpoint/ and pack/ are written in it)")
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--compare", action="store_true", help="also measure transformers' from_pretrained")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--step", choices=["pack", "load", "from_pretrained"], help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--pack", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.step:
        print(json.dumps(_step(args.step, args.checkpoint, args.pack)))
        return 0
    if args.out is None:
        print("error: --out: a work folder is needed", file=sys.stderr)
        return 2
    if not 0 < args.size_gb <= 64:
        print(f"error: --size-gb: expected a size in (0, 64], got {args.size_gb}", file=sys.stderr)
        return 2
    try:
        if args.json is not None:
            check_output("--json", args.json)
    except OutputPathError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    checkpoint, pack = args.out / "checkpoint", args.out / "pack"
    for path in (checkpoint, pack):
        if path.exists():
            print(f"error: --out: {path} exists; give a new folder (nothing is overwritten)", file=sys.stderr)
            return 2
    size = write_checkpoint(checkpoint, mixtral_config(int(args.size_gb * GIB)))
    result = {"checkpoint_bytes": size, "steps": [measure(k, checkpoint, pack) for k in ("pack", "load")]}
    if args.compare:
        result["steps"].append(measure("from_pretrained", checkpoint, pack))
    text = json.dumps(result, indent=1)
    print(text)
    if args.json is not None:
        write_bytes(args.json, (text + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
