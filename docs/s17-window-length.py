"""Session 17 (issue 10): what a 2-bit tail costs depends on the text and on the window length.

Session 16 found the 2g128@0.25 tail pack's full width 1.74% below the 4-bit full width on the throughput search's
windows (128 random windows x 128 tokens of the last 10% of data/stdlib-calib.txt) and 0.56% below it on the
evaluation windows (128 evenly spread windows x 256 tokens of data/stdlib-heldout.txt), and left open which text
was right. This script scores both tail packs' full width against the 4-bit one (one batch forward per window set:
the full width is exact serving, so batch = decode) on:

- the search's own draw and three other seeds of it (how much one draw of 128 windows moves);
- every non-overlapping 256-token window of each text (the whole text, no draw; the hold-out at 128 too);
- positions 0-126 and 127-254 of the 256-token windows separately (the window-length effect);
- each source file of the calibration hold-out (which files the search's text is made of).

    python -m crisp_tools.tail_pack --model models/tiny-mixtral --crisp models/tiny-mixtral-crisp \\
        --layout 2g128@0.25 --tier-widths 256,64,32 --out /tmp/tail25 --quiet
    python -m crisp_tools.tail_pack --model models/tiny-mixtral --crisp models/tiny-mixtral-crisp \\
        --layout 2g128@0.5 --tier-widths 256,64,32 --out /tmp/tail50 --quiet
    PYTHONPATH=. python docs/s17-window-length.py /tmp/tail25 /tmp/tail50 --json docs/s17-window-length.json

Every loss is relative to the 4-bit full width, with the window-clustered standard error of
crisp_tools.loss_estimate (windows of one text drawn at random may overlap: their standard error is a floor).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch
from crisp_tools.calibration import (
    EVAL_SEQ_LEN,
    contiguous_windows,
    dump_json,
    load_model,
    load_pack_dir,
    load_texts,
    random_windows,
    split_texts,
    text_bytes,
)
from crisp_tools.loss_estimate import relative_loss
from crisp_tools.profiler.throughput import accuracy_windows_of
from crisp_tools.serving_eval import score_plan

from crisp_runtime.planning.baselines import full_plan
from crisp_runtime.storage.pack import CrispPack

ROOT = Path(__file__).resolve().parents[1]
HOLDOUT_FRACTION = 0.1  # crisp-profile's and plan_throughput's default split
SEARCH_SEED = 0  # their default --seed (accuracy_windows_of adds the profiler's offset)
FILE_HEADER = re.compile(rb"# ==== (.*?) ====")  # tools/make_corpus.py's header line before each source file


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tail25", help="the 2g128@0.25 tail pack folder (crisp_tools.tail_pack)")
    p.add_argument("tail50", help="the 2g128@0.5 tail pack folder")
    p.add_argument("--json", help="write the records here (atomically; never onto an input)")
    args = p.parse_args(argv)

    model = load_model(ROOT / "models/tiny-mixtral")[0]
    packs = {}
    for name, folder in (("4-bit", ROOT / "models/tiny-mixtral-crisp"), ("2g128@0.25", args.tail25),
                         ("2g128@0.5", args.tail50)):
        layers, plan, _ = load_pack_dir(folder)
        packs[name] = (CrispPack(layers, full_plan(plan)), full_plan(plan))
    records = []

    def measure(label: str, windows: torch.Tensor, spans=((0, None),)) -> None:
        scores = {name: score_plan(model, pack, plan, windows) for name, (pack, plan) in packs.items()}
        for lo, hi in spans:
            ref = scores["4-bit"].correct[:, lo:hi]
            rec = {"windows": label, "shape": list(windows.shape), "positions": [lo, ref.shape[1] + lo - 1],
                   "accuracy_4bit": float(ref.double().mean())}
            for name in ("2g128@0.25", "2g128@0.5"):
                est = relative_loss(ref, scores[name].correct[:, lo:hi])
                rec[name] = {"accuracy_loss": est.loss, "accuracy_loss_se": est.standard_error}
            records.append(rec)
            print(f"{label:58s} {windows.shape[0]:5d} x {windows.shape[1]:3d} positions {lo:3d}-"
                  f"{rec['positions'][1]:3d}: " + "  ".join(
                      f"{n} {rec[n]['accuracy_loss']:6.2%} +- {rec[n]['accuracy_loss_se']:.2%}"
                      for n in ("2g128@0.25", "2g128@0.5")), flush=True)

    calib = load_texts([str(ROOT / "data/stdlib-calib.txt")])
    head, holdout = split_texts(calib, HOLDOUT_FRACTION)
    heldout = load_texts([str(ROOT / "data/stdlib-heldout.txt")])
    halves = ((0, 127), (127, None))
    for seq_len in (128, EVAL_SEQ_LEN):
        measure(f"search draw (seed {SEARCH_SEED}), calibration hold-out", accuracy_windows_of(
            holdout, 128, seq_len, SEARCH_SEED, HOLDOUT_FRACTION))
    for seed in (10, 11, 12):
        measure(f"random draw seed {seed}, calibration hold-out", random_windows(holdout, 128, 128, seed))
    measure("all windows, calibration hold-out (last 10%)", contiguous_windows(holdout, None, 128))
    for what, text in (("calibration hold-out (last 10%)", holdout), ("calibration head (profiled, first 90%)", head),
                       ("evaluation text", heldout)):
        measure(f"all windows, {what}", contiguous_windows(text, None, EVAL_SEQ_LEN), ((0, None),) + halves)
    measure("crisp-eval's windows, evaluation text", contiguous_windows(heldout, 128, EVAL_SEQ_LEN))

    data = text_bytes(calib)
    cut = int(len(data) * (1.0 - HOLDOUT_FRACTION))
    marks = list(FILE_HEADER.finditer(data))
    for m, nxt in zip(marks, marks[1:] + [None], strict=True):
        lo, hi = max(m.start(), cut), len(data) if nxt is None else nxt.start()
        if hi - lo < 4 * 128:  # outside the hold-out, or too short for a standard error
            continue
        rows = (hi - lo) // 128
        windows = torch.frombuffer(bytearray(data[lo:lo + rows * 128]), dtype=torch.uint8).long().view(rows, 128)
        measure(f"hold-out file {m.group(1).decode()}", windows)
    if args.json:
        dump_json(args.json, {"what": __doc__.split("\n\n")[0], "records": records})
    return 0


if __name__ == "__main__":
    sys.exit(main())
