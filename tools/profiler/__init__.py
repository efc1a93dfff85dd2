"""``crisp-profile``: turn a model and calibration text into a CRISP pack and plan.

Steps (all measured on the calibration text; nothing is downloaded), in the order
``pipeline.Profiler.run`` takes them:

0. ``inputs.prepare``: every check on the settings, paths, model and text, before anything is written.
1. ``statistics.calibration_pass``: one pass over ``--samples`` windows, resumable batch by batch:
   routing-weighted neuron importance, leading-pair counts and the routing weight each pair member
   gets (the dominance proxy).
2. ``statistics.neuron_order``: neurons of each expert sorted by decreasing importance; the pack
   stores them in that order, so a width-k execution reads the k most important ones.
3. ``dominance.measure_dominance``: the dominant member of every frequent pair, measured by masking
   each member on separate calibration windows; rare pairs fall back to the routing-weight proxy.
4. ``output.pack_layers``: 4-bit, group-wise, neuron-major, reordered.
5. ``search.choose_plan``: tiers per layer (``planning``: Hot / Warm / Cold by share of activations)
   and, with ``--search-target-bytes F`` or ``--dominance auto``, the cut-offs, Warm width, dominance
   rule and dominant count with the lowest loss on held-out calibration windows within the target.
6. ``output.write_pack``: the pack with the plan and pack.json, swapped into ``--out``.

``cli`` is the command line (``crisp-profile``, ``python -m crisp_tools.profiler``);
``config.ProfileConfig`` holds the settings.

Output is written atomically: built in a temporary folder next to ``--out`` and swapped in. An
``--out`` that holds another model's pack, anything besides a pack's own files (pack.json,
plan.json, experts.safetensors), or that is, contains or lies inside ``--model`` / ``--data`` is
refused before any work. Statistics are checkpointed after every batch in a run-keyed folder of
the work folder (``crisp_tools.workdir``: only files the run wrote are ever deleted); rerunning the
same command (also after Ctrl-C, exit code 130) resumes from there, and the result equals that of
an uninterrupted run.
"""

from .cli import build_parser, config_from_args, main
from .config import STATS_FILE, ProfileConfig
from .pipeline import Profiler
from .statistics import ProfileInterrupted, Stats

__all__ = ["STATS_FILE", "ProfileConfig", "ProfileInterrupted", "Profiler", "Stats", "build_parser",
           "config_from_args", "main"]
