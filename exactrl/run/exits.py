"""How a run ends, declared once: each exit code of the commands that run (exactrl sft, rl, pipeline, demo, eval,
study), the state its run directory's status.json records, the label its one line starts with, what it means and
the errors that end a run so. exactrl/cli.py `_run` ends every run through ``ending``; `exactrl config docs`
writes docs/exit-codes.md from ``render``.

Errors are named by import path, not imported: this table sits below the modules that raise them (torch,
the engines), and the CLI imports them only when a run has ended."""

from __future__ import annotations

import errno
import importlib
from typing import NamedTuple


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so the run records how it ended (as SIGINT does)."""


class End(NamedTuple):
    code: int | None  # None: the code the failed phase ended with (a pipeline's phase run as a command of its own)
    status: str  # status.json's "state"
    label: str  # the one line on the console starts with "<label>: "
    meaning: str
    errors: tuple[str, ...] = ()  # "module:Class"; a run ends by the first row whose errors it raised


SUCCESS = End(0, "success", "", "The run finished: the final model (the report, the study's cells) is written.")
# Matched in this order (a subclass listed in an earlier row wins: EngineStartError is a GeneratorError).
ENDS = (
    End(2, "error", "error", "A problem in the config, data, model, checkpoint, output_dir, device, vLLM environment "
        "or reward server, an environment that cannot start (env.on_error=stop: one that failed an episode), a chat "
        "template that cannot render an observation, or a dynamic-sampling rollout that cannot be filled: the line "
        "names the file, row or key "
        "and how to fix it; nothing was trained past it.",
        ("exactrl.config.loader:ConfigError", "exactrl.data.jsonl:DataError", "exactrl.models.loading:ModelLoadError",
         "exactrl.rewards:RewardError", "exactrl.rewards.remote:RemoteRewardError",
         "exactrl.serving:ServerUnreachable", "exactrl.distributed.checkpoint:CheckpointError",
         "exactrl.rollout.collect:RolloutError",
         "exactrl.device:DeviceError", "exactrl.rollout.vllm_generator:EngineStartError",
         "exactrl.envs.base:EnvError", "exactrl.envs.render:RenderError")),
    End(3, "check", "stopped by a self-check", "A verification check stopped the run: the packing, generation or "
        "determinism self-check, the on-policy ratio, a weight sync, a rollout of other weights than its "
        "schedule's, or a multi-turn row that is not the episode sampled (checks/trajectory.py). Checkpoints "
        "written so far are intact.",
        ("exactrl.checks.packing:PackingCheckError", "exactrl.rollout.generation_check:GenerationCheckError",
         "exactrl.checks.determinism:DeterminismError", "exactrl.checks.on_policy:OnPolicyCheckError",
         "exactrl.rollout.generator:WeightSyncError", "exactrl.rollout.schedule:StaleRolloutError",
         "exactrl.checks.trajectory:TrajectoryError")),
    End(None, "error", "error", "A phase of a pipeline (demo), run as a command of its own, failed: the pipeline "
        "ends with that phase's code and says why once.", ("exactrl.pipelines.pipeline:PhaseError",)),
    End(1, "error", "error", "The final evaluation failed (the model is saved), or a study's cell failed (the other "
        "cells are done).", ("exactrl.run.context:EvaluationError", "exactrl.pipelines.study:StudyIncomplete")),
    End(1, "error", "error", "A Ray actor of the run (a trainer rank, a rollout engine) or a vLLM engine died or "
        "stopped answering: named, with its log.",
        ("exactrl.distributed.ray_cluster:RoleDied", "exactrl.rollout.generator:GeneratorError")),
    End(3, "canary", "stopped by the canary", "The canary found a gradient that does not carry every micro-batch "
        "exactly once: the step was not applied; checkpoints written so far are intact.",
        ("exactrl.checks.canary:CanaryError",)),
    End(4, "nonfinite", "stopped", "A non-finite loss, gradient or weight (train.nonfinite=error): the step was not "
        "applied; metrics.jsonl records it.", ("exactrl.distributed.engine:NonFiniteError",)),
    End(2, "error", "error", "The operating system refused a file: a full disk, a path that cannot be written or "
        "does not exist (the line gives the OS's reason and the file).", ("builtins:OSError",)),
    End(130, "interrupted", "interrupted", "SIGINT (Ctrl-C): checkpoints written so far are intact.",
        ("builtins:KeyboardInterrupt",)),
    End(143, "interrupted", "terminated", "SIGTERM: checkpoints written so far are intact.",
        ("exactrl.run.exits:Terminated",)),
)
SIGINT, SIGTERM = ENDS[-2], ENDS[-1]
# Anything else is a bug in exactrl or below it: recorded, its traceback kept.
BUG = End(1, "error", "error", "Any other exception: a bug. status.json records it and the traceback is printed "
          "(the line ends '(a bug; the traceback is above)').")


def _resolve(path: str) -> type[BaseException]:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def ending(error: BaseException) -> End | None:
    """The row of ENDS a run that raised ``error`` ends by; None: a bug."""
    for end in ENDS:
        if isinstance(error, tuple(_resolve(p) for p in end.errors)):
            return end
    return None


def message(error: BaseException) -> str:
    """The one line's text: the error's own, or for the OS's refusal its reason, the file and what to do."""
    if isinstance(error, OSError):
        where = f" '{error.filename}'" if error.filename else ""
        fix = "check that path" if error.errno == errno.ENOENT else "free space or fix the permissions"
        return f"{error.strerror or error}{where}; {fix}, then run again"
    return str(error)


def render() -> str:
    """docs/exit-codes.md."""
    rows = sorted([SUCCESS, *ENDS, BUG], key=lambda e: (e.code is None, e.code or 0))
    lines = ["# Exit codes", "",
             "<!-- Generated from exactrl/run/exits.py by `exactrl config docs`; do not edit by hand. -->", "",
             "*Generated from `exactrl/run/exits.py` by `exactrl config docs`.*", "",
             "How `exactrl sft`, `rl`, `pipeline`, `demo`, `eval` and `study` end. Each failure prints one line, "
             "`<label>: <what, where, how to fix>`, and the run directory's `status.json` records the same end "
             "(`state`, `message`).", "",
             "| code | status.json state | line starts with | meaning | raised as |", "|---|---|---|---|---|"]
    for e in rows:
        code = "the phase's" if e.code is None else str(e.code)
        label = f"`{e.label}:`" if e.label else ""
        errors = ", ".join(f"`{p.split(':')[1]}` ({p.split(':')[0]})" for p in e.errors)
        lines.append(f"| {code} | `{e.status}` | {label} | {e.meaning} | {errors} |")
    lines += ["", "A run of several processes (`distributed.nproc_per_node` > 1) ends as its first failing rank "
              "did (the others, stopped by torchrun, end `interrupted`); if torchrun ends before any rank said "
              "why, with torchrun's own code and state `error`.", ""]
    return "\n".join(lines)
