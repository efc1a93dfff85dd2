"""``Profiler``: one ``crisp-profile`` run, its inputs checked at construction and its steps in ``run``."""

from __future__ import annotations

from ..calibration import threads
from .config import ProfileConfig
from .dominance import measure_dominance
from .inputs import ProfileInputs, ProgressLog, prepare
from .output import pack_layers, profile_info, write_pack
from .search import choose_plan, rekeyed_plans
from .statistics import calibration_pass, neuron_order, resume_or_start
from .throughput import SERVING_KEY, check_gpu_budget_config, goal_from_config, plan_budgets, plan_serving


class Profiler:
    """``Profiler(cfg)`` checks every input (CliError before anything is written); ``run()`` profiles and
    writes the pack. The checkpoint of the statistics lives in a run-keyed work folder
    (``crisp_tools.workdir``) and is removed on success unless ``keep_work``."""

    def __init__(self, cfg: ProfileConfig):
        self.cfg = cfg
        self.log = ProgressLog(cfg.quiet)
        self.goal = goal_from_config(cfg)  # --plan-for-throughput's settings checked before any work
        check_gpu_budget_config(cfg)
        self.inputs: ProfileInputs = prepare(cfg)

    def run(self, interrupt_after: int | None = None) -> dict:
        """Profile and write the pack; returns pack.json's record. ``interrupt_after``: test hook, raise
        ProfileInterrupted after that many statistics batches."""
        work = self.inputs.work
        work.open()
        try:
            info = self._steps(interrupt_after)
        except BaseException:
            work.release()  # the checkpoint stays: rerunning resumes from it
            raise
        finally:
            left = self.inputs.placed.close()  # the offload folder (device_map) is removed with the run
            if left:
                self.log(f"left alone in the offload folder {self.inputs.placed.offload.path}: {', '.join(left)}")
        if self.cfg.keep_work:
            work.release()
        else:
            work.remove()
        self._report_other_checkpoints()
        self.log(f"wrote {self.inputs.out} in {self.log.elapsed():.1f} s")
        return info

    def _steps(self, interrupt_after: int | None) -> dict:
        inputs, log = self.inputs, self.log
        stats = resume_or_start(inputs, log)
        with threads(self.cfg.threads):
            calibration_pass(inputs, stats, log, interrupt_after)
            order = neuron_order(inputs, stats)
            measure_dominance(inputs, stats, log)
            packed = pack_layers(inputs, order)
            plan, plan_info, search = choose_plan(inputs, stats, packed, log)
            serving = None
            if self.goal is not None:  # the chosen serving, and the plan with its auxiliary weight if it took one
                serving, plan = plan_serving(inputs, self.goal, packed, plan, log,
                                             rekeyed_plans(inputs, stats, plan, search))
            choices = None
            if self.cfg.gpu_budget is not None:  # one stored choice per budget, the plan kept
                choices = plan_budgets(inputs, packed, plan, log)
            elif self.goal is None:
                log("no serving choice stored: apply(model, pack, gpu_budget=B) runs the default rule "
                    "(crisp_runtime.planning.defaults); --gpu-budget B (or 'standard') stores the fastest simulated "
                    "configuration within --max-accuracy-loss for B, and python -m crisp_tools.plan_throughput "
                    "does it for this pack later")
        info = profile_info(inputs, stats, plan_info, search, log.elapsed())
        if serving is not None:
            info[SERVING_KEY] = serving.to_dict()
        if choices is not None:
            info[SERVING_KEY] = choices.to_dict()
        write_pack(inputs, packed, plan, info)
        return info

    def _report_other_checkpoints(self) -> None:
        work = self.inputs.work
        others = work.others()
        if others:
            self.log(f"left alone: {len(others)} checkpoint folder(s) of runs with other settings in {work.root} "
                     f"({', '.join(p.name for p in others[:3])}); rerun those commands to finish them, or delete "
                     f"them")
