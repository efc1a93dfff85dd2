"""Table-driven fuzz of every command-line option: a bad value exits 2 with one line naming the option.

Every case calls the tool's ``main(argv)`` (or its parser) in-process; no model is loaded, because
every value here is refused at parse time or by the output checks that run before any work.
The tables list, per tool, each option with the values that must be refused; the case count is
printed by ``test_case_count`` (``pytest -s``) and asserted to stay at least the recorded size.
"""

from __future__ import annotations

import pytest
import torch
from crisp_bench import cli as bench_cli
from crisp_tools import (
    evaluate,
    evidence,
    key_study,
    make_corpus,
    plan_throughput,
    tail_emulation,
    tail_pack,
    train_tiny_moe,
)
from crisp_tools import profiler as prof

POS_INT = ["0", "-1", "-3", "1.5", "abc", "", "nan", "1e3", "0x10"]
NONNEG_INT = ["-1", "-100", "1.5", "abc", "", "nan"]
SEED = ["-1", "4294967296", "1.5", "abc", ""]
THREADS = ["0", "-2", "1025", "abc", "", "2.0"]
UNIT = ["-0.1", "1.5", "nan", "inf", "abc", "", "-inf"]  # closed [0, 1]
OPEN_UNIT = [*UNIT, "0", "1"]  # open (0, 1)
HALF_OPEN_UNIT = ["0", "-0.5", "1.5", "nan", "inf", "abc", ""]  # (0, 1]
SEQ_LEN = ["1", "0", "-5", "abc", "", "2.5"]
DEVICES = ["foo", "meta", "cuda:x", "gpu", "", "CPU"] + ([] if torch.cuda.is_available() else ["cuda", "cuda:0"])
BENCH_FRACTION = ["0", "-0.1", "1.5", "nan", "abc", "", "200%"]
FRACTION_LIST = ["0", "1.5", "abc", "", "0.5,nan", "0.5,-1", ","]
INT_LIST = ["0", "-1", "abc", "", "1,x", "1,0", ","]
TAIL_LAYOUTS_BAD = ["", "m999", "5g64@0.1", "2g32@0.5", "2g64@1.0", "2g64@0.5,3g64@0.25", "2g64@", "2g128@-0.1",
                    "3g64@0.25,"]


TIER_WIDTHS_BAD = ["", "256,40", "256,40,-1", "a,b,c", "256,40,16,0", "1.5,2,3"]
GPU_BUDGETS_BAD = {"--gpu-budget": ["lots", "0%", "150%", "1.5", "-2GiB", ""], "--heldout-data": [""],
                   "--heldout-windows": POS_INT, "--budget-search": ["fast", ""]}


def _cases(tool, options: dict[str, list[str]]):
    return [(tool, opt, bad) for opt, values in options.items() for bad in values]


PROFILE = _cases("profile", {
    "--samples": POS_INT, "--seq-len": SEQ_LEN, "--batch-size": POS_INT, "--seed": SEED, "--device": DEVICES,
    "--dtype": ["float64", "int8", "", "fp16"], "--threads": THREADS, "--group-size": ["48", "0", "abc", "-64"],
    "--importance": ["mean", ""], "--hot-mass": UNIT, "--cold-mass": UNIT, "--warm-width": UNIT,
    "--holdout-fraction": OPEN_UNIT, "--dominance-samples": POS_INT, "--dominance-min-tokens": POS_INT,
    "--dominance-max-windows": POS_INT, "--dominance": ["best", ""], "--search-target-bytes": HALF_OPEN_UNIT,
    "--combination-key": ["pair", "", "leading-pair-by-routing-weight", "Leading-Expert"],
    "--search-samples": POS_INT, "--search-cold-widths": ["", "1", "-0.1", "0,1.5", "0,0", "abc", "nan", ","],
    "--model": [""], "--data": [""], "--out": [""], "--work-dir": [""],
    "--num-dominant": POS_INT, "--plan-for-throughput": HALF_OPEN_UNIT, "--max-accuracy-loss": UNIT,
    "--hardware-profile": ["abacus", "", "missing.json"], "--throughput-windows": POS_INT,
    "--throughput-seq-len": SEQ_LEN, "--throughput-accuracy-windows": POS_INT,
    "--accuracy-confidence": ["0.4", "1", "1.5", "nan", "abc", ""],
    "--simulation-workers": ["0", "-1", "257", "abc", ""], "--search-tier-widths": TIER_WIDTHS_BAD,
    "--placement": ["everywhere", "", "device-map"], "--device-map": ["everywhere", "", '{"m": "gpu7"}', "[1]", "{}"],
    "--max-memory": ['{"cpu": "lots"}', "[1]", ""], "--offload-folder": [""], **GPU_BUDGETS_BAD,
})
EVAL = _cases("eval", {
    "--samples": POS_INT, "--seq-len": SEQ_LEN, "--batch-size": POS_INT, "--device": DEVICES,
    "--dtype": ["float64", ""], "--threads": THREADS, "--engine": ["fast", ""], "--json": ["", "DIR", "MISSING"],
    "--mode": ["serve", ""], "--budgets": HALF_OPEN_UNIT, "--prefetch-window": ["", "gtx480", ".json", "missing.json"],
    "--target": ["gpt4", ""], "--reference-crisp": [""],
    "--model": [""], "--crisp": [""], "--data": [""],
})
EVIDENCE = _cases("evidence", {
    "--model": [""], "--crisp": [""], "--data": [""],
    "--samples": POS_INT, "--seq-len": SEQ_LEN, "--batch-size": POS_INT, "--top-pairs": POS_INT,
    "--threads": THREADS, "--json": ["", "DIR", "MISSING"], "--markdown": ["", "DIR", "MISSING"],
})
KEY_STUDY = _cases("key-study", {
    "--model": [""], "--crisp": [""], "--data": [""], "--fit-samples": POS_INT, "--test-samples": POS_INT,
    "--holdout-fraction": OPEN_UNIT, "--num-dominant": POS_INT, "--seq-len": SEQ_LEN, "--batch-size": POS_INT,
    "--seed": SEED, "--threads": THREADS, "--json": ["", "DIR", "MISSING"],
})
OUTPUT_OPTIONS = {"--json": ["", "DIR", "MISSING"], "--plot": ["", "DIR", "MISSING", "x.txt"], "--threads": THREADS}
MODEL_OPTIONS = {"--model": [""], "--pack": [""], "--text": [""]}
SHAPES = ["huge", "", "tiny,x", "0x5", ","]
BENCH = (
    _cases("bench", {"--threads": THREADS, "--model": [""]})
    + _cases("bench kernels", {**OUTPUT_OPTIONS, "--widths": FRACTION_LIST, "--tokens": INT_LIST, "--shapes": SHAPES,
                               "--tail-start": ["1", "1.5", "-0.1", "nan", "abc", ""],
                               "--device": DEVICES, "--dtype": ["fp64", ""], "--group-size": ["48", "abc"],
                               "--backend": ["magic"], "--warmup": NONNEG_INT, "--iters": POS_INT})
    + _cases("bench transfer", {**OUTPUT_OPTIONS, "--repeats": POS_INT, "--profile-out": ["", "DIR", "MISSING"],
                                "--shapes": SHAPES, "--widths": FRACTION_LIST, "--model": [""]})
    + _cases("bench cpu", {"--json": ["", "DIR", "MISSING"], "--threads": THREADS, "--repeats": POS_INT,
                           "--shapes": SHAPES, "--widths": FRACTION_LIST, "--tokens": INT_LIST, "--model": [""],
                           "--precision": ["fp16", ""], "--impl": ["fast", "", "native-fp32,x", "NATIVE-FP32"]})
    + _cases("bench dense", {"--json": ["", "DIR", "MISSING"], "--threads": THREADS,
                             "--shapes": ["huge", "", "olmoe,x"], "--layers": POS_INT, "--tokens": POS_INT,
                             "--prompt": POS_INT, "--rounds": POS_INT})
    + _cases("bench peer", {"--json": ["", "DIR", "MISSING"], "--threads": [*THREADS, ",", "1,0"],
                            "--models": ["huge", "", "tiny,x", "TINY"], "--tokens": POS_INT, "--prompt": POS_INT,
                            "--rounds": POS_INT, "--quants": ["Q8_0", "", "q4_0", "Q4_0,x"],
                            "--crisp-precisions": ["bf16", "", "Q8", "fp32,x"],
                            "--accuracy-windows": POS_INT, "--window": SEQ_LEN, "--text": [""],
                            "--kernel-repeats": POS_INT, "--work-dir": [""]})
    + _cases("bench layer", {**OUTPUT_OPTIONS, **MODEL_OPTIONS, "--budget": BENCH_FRACTION, "--steps": POS_INT,
                             "--policies": ["fastest", "", "full,x"]})
    + _cases("bench e2e", {**OUTPUT_OPTIONS, **MODEL_OPTIONS, "--budget": BENCH_FRACTION, "--tokens": POS_INT,
                           "--policies": ["fastest", ""], "--record-trace": ["", "DIR", "MISSING"],
                           "--placements": ["magic", "", "gpu,x"], "--cpu-precision": ["fp16", "", "BF16"],
                           "--cpu-kernel": ["fast", "", "Native"]})
    + _cases("bench simulate", {
        **OUTPUT_OPTIONS, **MODEL_OPTIONS, "--sequences": POS_INT, "--seq-len": POS_INT, "--tokens": POS_INT,
        "--budget": BENCH_FRACTION, "--policies": ["fastest", ""], "--orders": ["random", ""],
        "--target": ["gpt4", ""], "--uniform-width": BENCH_FRACTION, "--cache-scope": ["node", ""],
        "--eviction": ["fifo", ""], "--warmup": NONNEG_INT, "--record-trace": ["", "DIR", "MISSING"],
        "--trace": [""], "--compare": [""], "--profile-file": [""], "--profile": ["", "gtx480"], "--plan": [""],
        "--matrix": ["bogus", ""],
        "--serving": ["magic", "", "plan,x", "resident-floor0", "resident-floor150", "resident-floorx",
                      "resident-floor-5", "resident-floor50-revive-narrow-aux"],
        "--prefetch": ["always", ""],
        "--prefetch-width": ["full", "", "plan,x"], "--accuracy": [""], "--from-json": [""],
        "--tail-layout": TAIL_LAYOUTS_BAD})
    + _cases("bench report", {"--results": ["", "MISSING"], "--table": ["", "nope"], "--markdown": ["", "DIR"],
                              "--install": ["", "MISSING", "DIR"]})
)
AUX_WEIGHT_BAD = ["", "-0.1", "1.5", "nan", "inf", "abc"]
TAIL_EMULATION = _cases("tail-emulation", {
    "--model": [""], "--crisp": [""], "--out": [""], "--layout": TAIL_LAYOUTS_BAD,
    "--tier-widths": TIER_WIDTHS_BAD,
    "--aux-full-weight": AUX_WEIGHT_BAD, "--aux-skip-weight": AUX_WEIGHT_BAD})
TAIL_PACK = _cases("tail-pack", {
    "--model": [""], "--crisp": [""], "--out": [""], "--layout": TAIL_LAYOUTS_BAD,
    "--tier-widths": TIER_WIDTHS_BAD,
    "--aux-full-weight": AUX_WEIGHT_BAD, "--aux-skip-weight": AUX_WEIGHT_BAD})
PLAN_THROUGHPUT = _cases("plan-throughput", {
    "--model": [""], "--crisp": [""], "--data": [""], "--out": [""], "--budget": HALF_OPEN_UNIT,
    "--reference-crisp": [""], "--tail-layouts": TAIL_LAYOUTS_BAD, "--max-accuracy-loss": UNIT,
    "--hardware-profile": ["abacus", "", "missing.json"],
    "--throughput-windows": POS_INT,
    "--throughput-seq-len": SEQ_LEN, "--throughput-accuracy-windows": POS_INT,
    "--accuracy-confidence": ["0.4", "1", "1.5", "nan", "abc", ""], "--holdout-fraction": OPEN_UNIT, "--seed": SEED,
    "--threads": THREADS, "--simulation-workers": ["0", "-1", "257", "abc", ""],
    "--search-tier-widths": TIER_WIDTHS_BAD, **GPU_BUDGETS_BAD})
CORPUS = _cases("corpus", {"--cap-bytes": POS_INT})
TRAIN = _cases("train", {
    "--steps": POS_INT, "--seed": SEED, "--batch-size": POS_INT, "--seq-len": SEQ_LEN,
    "--lr": ["0", "-1e-3", "nan", "inf", "abc"], "--min-lr-ratio": UNIT, "--warmup": NONNEG_INT,
    "--weight-decay": ["-0.1", "nan", "abc"], "--grad-clip": ["0", "-1", "nan"], "--hidden-size": POS_INT,
    "--intermediate-size": POS_INT, "--layers": POS_INT, "--experts": ["1", "0", "abc"], "--top-k": POS_INT,
    "--heads": POS_INT, "--kv-heads": POS_INT, "--max-positions": SEQ_LEN, "--aux-coef": ["-1", "nan"],
    "--eval-samples": POS_INT, "--eval-seed": SEED, "--threads": THREADS, "--log-every": POS_INT,
    "--family": ["gpt2", "", "Mixtral"], "--moe-intermediate-size": POS_INT, "--shared-experts": POS_INT,
    "--dense-layers": POS_INT,
})
ALL = PROFILE + EVAL + EVIDENCE + KEY_STUDY + BENCH + CORPUS + TRAIN + TAIL_EMULATION + TAIL_PACK + PLAN_THROUGHPUT
# The size of the campaign when it was written; shrinking a table must be a decision, not an accident.
# 660: the 22 cases of `python -m crisp_bench.kernels`'s own --shapes/--widths/--tokens/--json went with
# that second command line (its other options moved to `crisp-bench kernels`, their cases with them).
# 860: the tables had grown past 660 without a bump; tail-pack's 18 cases included;
# 866: kernels --tail-start. 991: plan-throughput's 76, --simulation-workers, earlier growth.
# 1013: --search-tier-widths of crisp-profile and plan-throughput, plan-throughput --reference-crisp and
# --tail-layouts. 1019: bench report's --results, --table, --markdown. 1055: --gpu-budget, --heldout-data,
# --heldout-windows and --budget-search of crisp-profile and plan-throughput. 1203: crisp-profile --combination-key,
# key_study's 68, earlier growth.
RECORDED_CASES = 1203


def _prog_argv(tool: str, tmp_path):
    """(callable taking argv, base argv with valid required options) of ``tool``."""
    model, data, pack = str(tmp_path / "model"), str(tmp_path / "text.txt"), str(tmp_path / "pack")
    # none of these exists but the text: every case must be refused before they are opened
    if tool == "profile":
        return prof.main, ["--model", model, "--data", data, "--out", str(tmp_path / "out"), "--quiet"]
    if tool == "eval":
        return evaluate.main, ["--model", model, "--crisp", pack, "--data", data, "--quiet"]
    if tool == "evidence":
        return evidence.main, ["--model", model, "--crisp", pack, "--data", data, "--quiet"]
    if tool == "key-study":
        return key_study.main, ["--model", model, "--crisp", pack, "--data", data, "--quiet"]
    if tool == "bench":
        return bench_cli.main, []
    if tool.startswith("bench "):
        return bench_cli.main, [tool.split()[1]]
    if tool == "corpus":
        return make_corpus.main, ["--out", str(tmp_path / "corpus")]
    if tool == "train":
        return train_tiny_moe.parse_args, ["--no-save"]
    if tool == "tail-emulation":
        return tail_emulation.main, ["--model", model, "--crisp", pack, "--layout", "m432", "--out",
                                     str(tmp_path / "emulated"), "--tier-widths", "256,40,16", "--quiet"]
    if tool == "tail-pack":
        return tail_pack.main, ["--model", model, "--crisp", pack, "--layout", "2g128@0.25", "--out",
                                str(tmp_path / "tailed"), "--tier-widths", "256,64,32", "--quiet"]
    if tool == "plan-throughput":
        return plan_throughput.main, ["--model", model, "--crisp", pack, "--data", data, "--out",
                                      str(tmp_path / "planned"), "--budget", "0.25", "--quiet"]
    raise AssertionError(tool)


def _value(bad: str, root) -> str:
    if bad == "DIR":  # an existing folder as an output file (named like a plot, so that only its kind is wrong)
        return str(root / "folder.png")
    if bad == "MISSING":
        return str(root / "no" / "such" / "folder" / "out.png")
    return bad


def run_cli(fn, argv, capsys) -> tuple[int, str]:
    try:
        rc = fn(argv)
    except SystemExit as exc:
        rc = exc.code
    else:
        rc = rc if isinstance(rc, int) else 0  # parse_args returns a namespace: accepted
    return rc, capsys.readouterr().err


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    (root / "text.txt").write_text("def f(x):\n    return x\n" * 50)
    (root / "folder.png").mkdir()
    return root


# One test per (tool, option), looping over its bad values: ~600 cases in a few seconds.
OPTIONS: dict[tuple[str, str], list[str]] = {}
for _tool, _opt, _bad in ALL:
    OPTIONS.setdefault((_tool, _opt), []).append(_bad)


@pytest.mark.parametrize("tool, option", list(OPTIONS), ids=[f"{t}:{o}" for t, o in OPTIONS])
def test_bad_option_value_is_one_line_error(tool, option, root, capsys):
    fn, base = _prog_argv(tool, root)
    before = sorted(p.name for p in root.iterdir())
    failures = []
    for bad in OPTIONS[(tool, option)]:
        value = _value(bad, root)
        if option in base:  # replace a required option's valid value by the bad one
            i = base.index(option)
            argv = [*base[:i], option, value, *base[i + 2:]]
        else:
            argv = [*base, option, value]
        rc, err = run_cli(fn, argv, capsys)
        lines = [line for line in err.splitlines() if line.strip()]
        ok = (rc == 2 and "Traceback" not in err and len(lines) == 1 and "error:" in lines[0]
              and option in lines[0])
        if not ok:
            failures.append((bad, rc, err[-300:]))
    assert not failures, failures
    assert sorted(p.name for p in root.iterdir()) == before  # nothing written


def test_unknown_choice_lists_the_choices(capsys):
    rc, err = run_cli(prof.main, ["--model", "m", "--data", "d", "--out", "o", "--dominance", "best"], capsys)
    assert rc == 2 and "auto" in err and "routing-weight" in err and "measured" in err
    rc, err = run_cli(bench_cli.main, ["simulate", "--eviction", "fifo"], capsys)
    assert rc == 2 and "lru" in err and "frequency" in err
    rc, err = run_cli(prof.main, ["--model", "m", "--data", "d", "--out", "o", "--device", "foo"], capsys)
    assert rc == 2 and "cpu" in err and "cuda:N" in err


def test_case_count():
    counts = {name: len(t) for name, t in (("crisp-profile", PROFILE), ("crisp-eval", EVAL), ("evidence", EVIDENCE),
                                            ("key_study", KEY_STUDY),
                                            ("crisp-bench", BENCH), ("make_corpus", CORPUS),
                                            ("train_tiny_moe", TRAIN), ("tail_emulation", TAIL_EMULATION),
                                            ("tail_pack", TAIL_PACK), ("plan_throughput", PLAN_THROUGHPUT))}
    print(f"\nCLI fuzz: {len(ALL)} cases over {len({(t, o) for t, o, _ in ALL})} options: {counts}")
    assert len(ALL) >= RECORDED_CASES


def _options(parser) -> set[str]:
    """Long options taking a value (flags and --help have no bad value)."""
    import argparse

    return {s for a in parser._actions if a.nargs != 0 and not isinstance(a, argparse._SubParsersAction)
            for s in a.option_strings if s.startswith("--")}


def test_every_option_of_the_main_tools_is_in_the_tables():
    """A new option must come with bad values here (or the table shrinks and this test names it)."""
    import argparse

    covered = {(t, o) for t, o, _ in ALL}
    parsers = {"profile": prof.build_parser(), "eval": evaluate.build_parser(), "evidence": evidence.build_parser(),
               "key-study": key_study.build_parser(),
               "bench": bench_cli.build_parser(), "tail-emulation": tail_emulation.build_parser(),
               "tail-pack": tail_pack.build_parser(), "plan-throughput": plan_throughput.build_parser()}
    sub = next(a for a in parsers["bench"]._actions if isinstance(a, argparse._SubParsersAction))
    parsers.update({f"bench {name}": p for name, p in sub.choices.items()})
    missing = sorted((tool, opt) for tool, p in parsers.items() for opt in _options(p) if (tool, opt) not in covered)
    assert not missing, missing
