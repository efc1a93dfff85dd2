"""Peak host memory of profiling, packing and loading a checkpoint larger than the memory they use.

    python -m crisp_tools.stream_rss --out /tmp/rss --size-gb 2 --json rss.json

1. writes a synthetic from_config Mixtral checkpoint of about ``--size-gb`` (float32, one
   safetensors shard per decoder layer, random weights; not measured). Default shape: 32 layers of
   hidden size 512, Mixtral-8x7B's proportions (32 layers; attention ~4% of a layer's weights), so
   one layer of experts is the same 1/32 share of the checkpoint as there;
2. in a fresh subprocess each, reports the peak resident set (``VmHWM`` from /proc/self/status)
   and the resident set after importing torch + transformers (the floor every step pays) of:
   - ``pack``: crisp_runtime.hf.checkpoint.load_skeleton + pack_checkpoint + save_pack (what a
     full-width pack of the checkpoint costs: one expert of float32 weights at a time);
   - ``profile``: ``crisp-profile --placement stream`` on a few windows of text (statistics,
     dominance base pass, neuron order, pack, held-out choice of the dominance rule, write): the
     non-expert weights resident, one layer of experts read per forward;
   - ``profile-offload`` (``--offload-cpu-mib N``): ``crisp-profile --device-map auto --max-memory
     '{"cpu": N MiB}'``: accelerate's placement with what does not fit offloaded to disk;
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

from crisp_runtime import cli_args as ca
from crisp_runtime.storage.outputs import OutputPathError, check_output, write_bytes

GIB = 2**30
STREAM_RSS_FORMAT = "crisp-stream-rss"  # the --json record's format


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def mixtral_config(size_bytes: int, layers: int = 32, hidden: int = 512):
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


# crisp-profile's settings for the profile steps: few windows (the cost measured is the model's, not the
# text's), and no pair frequent enough to be masked (each masking run is a forward over the whole model).
PROFILE_ARGS = ["--samples", "8", "--seq-len", "64", "--batch-size", "4", "--dominance-samples", "4",
                "--dominance-min-tokens", "1000000", "--search-samples", "4", "--threads", "2", "--quiet"]


def write_text(path: Path, nbytes: int = 64 * 1024) -> None:
    """Calibration text for the profile steps: seeded random lowercase words (bytes < 128, any vocabulary)."""
    import random

    rng = random.Random(0)
    words = []
    while sum(len(w) + 1 for w in words) < nbytes:
        words.append("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 9))))
    path.write_text(" ".join(words)[:nbytes])


def _step(kind: str, checkpoint: Path, pack: Path, offload_cpu_mib: int | None = None) -> dict:
    """One measured step, run in this (fresh) process."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import crisp_runtime
    import crisp_runtime.hf.checkpoint  # noqa: F401 - part of the floor

    # The floor: torch, transformers, CRISP and the model's modeling code imported (a meta model built), ~415 MiB
    # here, paid whatever the checkpoint's size; what the step adds above it is what the checkpoint costs.
    with torch.device("meta"):
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(checkpoint, local_files_only=True))
    floor = _status_kib("VmRSS")
    out = {"step": kind, "rss_after_imports_mib": floor / 1024}
    if kind == "pack":
        from crisp_runtime.hf.checkpoint import checkpoint_weights_sha256, load_skeleton, pack_checkpoint
        from crisp_runtime.storage.pack import model_info, save_pack

        model, cmap = load_skeleton(checkpoint)
        layers = pack_checkpoint(model, cmap)
        info = {**model_info(model), "model": {"weights_sha256": checkpoint_weights_sha256(model, cmap)}}
        save_pack(pack, layers, info=info)
        out["pack_bytes"] = sum(p.stat().st_size for p in pack.iterdir())
    elif kind in ("profile", "profile-offload"):
        from crisp_tools.profiler.cli import main as profile

        out_dir = pack.parent / f"{pack.name}-{kind}"
        placement = (["--placement", "stream"] if kind == "profile" else
                     ["--device-map", "auto", "--max-memory", json.dumps({"cpu": f"{offload_cpu_mib}MiB"})])
        rc = profile(["--model", str(checkpoint), "--data", str(pack.parent / "calib.txt"), "--out", str(out_dir),
                      *placement, *PROFILE_ARGS])
        if rc != 0:
            raise RuntimeError(f"crisp-profile exited {rc}")
        out["pack_bytes"] = sum(p.stat().st_size for p in out_dir.iterdir())
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


def measure(kind: str, checkpoint: Path, pack: Path, offload_cpu_mib: int | None = None) -> dict:
    """Run one step in a subprocess (its own peak) and return what it reports. The profile steps write their
    pack beside ``pack`` (``<pack>-<kind>/``) from ``calib.txt`` there (:func:`write_text`)."""
    cmd = [sys.executable, "-m", "crisp_tools.stream_rss", "--step", kind, "--checkpoint", str(checkpoint),
           "--pack", str(pack)]
    if offload_cpu_mib is not None:
        cmd += ["--offload-cpu-mib", str(offload_cpu_mib)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{kind} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m crisp_tools.stream_rss", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="work folder (checkpoint/ and pack/ are written in it)")
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--layers", type=int, default=32, help="decoder layers of the synthetic Mixtral")
    parser.add_argument("--hidden", type=int, default=512, help="hidden size of the synthetic Mixtral")
    parser.add_argument("--compare", action="store_true", help="also measure transformers' from_pretrained")
    parser.add_argument("--offload-cpu-mib", type=int, default=None,
                        help="also measure crisp-profile --device-map auto with this much CPU memory (the rest on "
                             "disk)")
    parser.add_argument("--json", type=Path, help="also write the measurements as JSON (atomically)")
    ca.add_force(parser)
    parser.add_argument("--step", choices=["pack", "profile", "profile-offload", "load", "from_pretrained"],
                        help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--pack", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.step:
        print(json.dumps(_step(args.step, args.checkpoint, args.pack, args.offload_cpu_mib)))
        return 0
    if args.out is None:
        print("error: --out: a work folder is needed", file=sys.stderr)
        return 2
    if not 0 < args.size_gb <= 64:
        print(f"error: --size-gb: expected a size in (0, 64], got {args.size_gb}", file=sys.stderr)
        return 2
    try:
        if args.json is not None:
            check_output("--json", args.json, force=args.force, kinds={STREAM_RSS_FORMAT})
    except OutputPathError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not 1 <= args.layers <= 256 or args.hidden < 64 or args.hidden % 64:
        print(f"error: --layers {args.layers} / --hidden {args.hidden}: expected 1..256 layers and a hidden size "
              "that is a multiple of 64", file=sys.stderr)
        return 2
    if args.offload_cpu_mib is not None and args.offload_cpu_mib < 1:
        print(f"error: --offload-cpu-mib: expected a positive size, got {args.offload_cpu_mib}", file=sys.stderr)
        return 2
    checkpoint, pack = args.out / "checkpoint", args.out / "pack"
    outputs = (checkpoint, pack, args.out / "calib.txt", args.out / "pack-profile", args.out / "pack-profile-offload")
    for path in outputs:
        if path.exists():
            print(f"error: --out: {path} exists; give a new folder (nothing is overwritten)", file=sys.stderr)
            return 2
    config = mixtral_config(int(args.size_gb * GIB), layers=args.layers, hidden=args.hidden)
    size = write_checkpoint(checkpoint, config)
    write_text(args.out / "calib.txt")
    result = {"format": STREAM_RSS_FORMAT, "version": 1,
              "checkpoint_bytes": size, "layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
              "intermediate_size": config.intermediate_size,
              "steps": [measure(k, checkpoint, pack) for k in ("pack", "profile", "load")]}
    if args.offload_cpu_mib is not None:
        result["steps"].append(measure("profile-offload", checkpoint, pack, args.offload_cpu_mib))
    if args.compare:
        result["steps"].append(measure("from_pretrained", checkpoint, pack))
    text = json.dumps(result, indent=1)
    print(text)
    if args.json is not None:
        write_bytes(args.json, (text + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
