"""The run context: what every training phase does around its loop, in one object.

It owns the run directory (config, manifest, status), the metric sinks (metrics.jsonl), the
progress bar, evaluation and the checkpoint cadence, so a loop says only what happened:

    ctx = RunContext(cfg, "rl", phase, run_dir, data_files, tokenizer, eval_set)
    ctx.start(steps, first_step)
    ...
    if ctx.logs(step):
        ctx.write(step, {"loss": ..., ...})
    ctx.step_done(step, {"policy": policy, "critic": critic}, position, postfix)
    ctx.finish({"final": policy, "final-critic": critic})

Under several processes only the main one writes; the others share the directory's path.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from exactrl.audit.manifest import record_check, write_manifest
from exactrl.config.faults import banner, faults_record, injected
from exactrl.distributed.checkpoint import complete_checkpoints, save_checkpoint
from exactrl.distributed.launch import broadcast_str, is_main, world_size
from exactrl.metrics import MetricsLog
from exactrl.progress import progress
from exactrl.run.evaluation import Accuracy, EvalSet, greedy_accuracy, no_eval_note
from exactrl.run_dir import create_run_dir
from exactrl.tracking import open_metrics, require_trackers


class EvaluationError(RuntimeError):
    """The final evaluation failed after the trained model was saved."""


def _earlier_attempts(run_dir: Path) -> dict:
    """A continued run's manifest keeps each earlier launch's (its versions or hardware may differ)."""
    try:
        old = json.loads((run_dir / "manifest.json").read_text())
    except (OSError, ValueError):
        return {}
    return {"previous_attempts": [*old.pop("previous_attempts", []), old]}


def open_run(cfg, command: str, run_dir: Path | None, data_files: dict, continues: bool = False) -> tuple[
    Path, MetricsLog]:
    """Create (or reuse, for a demo phase) the run directory; write config and manifest; open the
    metric sinks (metrics.jsonl and the trackers log.* asks for, exactrl/tracking.py).
    ``continues``: this launch continues the run in output_dir (train.resume_from=latest)."""
    require_trackers(cfg.log, reach_servers=is_main())
    if not is_main():
        path = run_dir or Path(broadcast_str(""))
        return path, MetricsLog(None)
    if run_dir is None:
        run_dir = create_run_dir(cfg.output_dir, command, cfg, continues)
        extra = {**(_earlier_attempts(run_dir) if continues else {}), **faults_record(cfg.fault)}
        write_manifest(run_dir, cfg.train.seed, data_files, extra)
    if world_size() > 1:
        broadcast_str(str(run_dir))
    return run_dir, open_metrics(cfg, run_dir, f"{run_dir.name}-{command}")


def should(every: int, step: int, last: int) -> bool:
    """True on every ``every``-th completed step (1-based ``step``), never on the last (handled once after the loop)."""
    return every > 0 and step % every == 0 and step != last


class RunContext:
    def __init__(self, cfg, command: str, phase: str, run_dir: Path | None, data_files: dict, tokenizer,
                 eval_set: EvalSet | None, continues: bool = False):
        self.cfg, self.command, self.phase, self.tokenizer, self.eval_set = cfg, command, phase, tokenizer, eval_set
        self.run_dir, self.log = open_run(cfg, command, run_dir, data_files, continues)
        if (note := no_eval_note(cfg)) and is_main():
            print(note)
        self.steps, self.bar = 0, None
        self.faults = injected(cfg.fault)  # known bugs reproduced on purpose: labelled in every output

    def _banner(self, when: str) -> None:
        if self.faults and is_main():
            print(banner(self.faults, f"{self.phase} {when}"), file=sys.stderr, flush=True)

    def start(self, steps: int, first_step: int = 0) -> None:
        """The loop runs completed steps first_step + 1 .. steps (a resumed run starts later)."""
        self.steps = steps
        self._banner("starts")
        self.bar = progress(steps, self.phase, first_step, enabled=is_main())

    def logs(self, step: int) -> bool:
        """Whether completed step ``step`` writes a metrics record (every train.log_every, and the last)."""
        return step % self.cfg.train.log_every == 0 or step == self.steps

    def write(self, step: int, record: dict) -> None:
        label = {"faults_injected": list(self.faults)} if self.faults else {}
        self.log.write({"phase": self.phase, "step": step, **label, **record})

    def step_done(self, step: int, workers: dict, position: dict, postfix: dict[str, str]) -> None:
        """After completed step ``step``: the bar, then the periodic evaluation and checkpoint.
        ``workers``: name -> worker saved in a checkpoint, the policy first under "policy" (None: absent);
        ``position``: what a resumed run needs to continue exactly (step, RNG states...)."""
        # The figures first: update() is what prints a line (off a terminal, or past tqdm's mininterval), and a
        # line printed before set_postfix would carry the previous step's loss/reward.
        self.bar.set_postfix(**postfix, refresh=False)
        self.bar.update(1)
        if self.eval_set and should(self.cfg.train.eval_every, step, self.steps):
            self.evaluate(step, workers["policy"], say=self.bar.write)
        if should(self.cfg.train.save_every, step, self.steps):
            present = {name: w for name, w in workers.items() if w is not None}
            save_checkpoint(self.run_dir / f"checkpoint-{step}", self.tokenizer, present, position, self.command)
            if self.cfg.train.save_total_limit and is_main():  # only now is the new one complete
                for old in complete_checkpoints(self.run_dir)[: -self.cfg.train.save_total_limit]:
                    shutil.rmtree(old)

    def evaluate(self, step: int, policy, say=print) -> Accuracy:
        # Every rank generates for the same prompts (a sharded model needs all ranks in each
        # forward); greedy decoding keeps them in lockstep.
        acc = greedy_accuracy(self.cfg, policy, self.tokenizer, self.eval_set)
        self.write(step, {"eval_accuracy": acc.value, "eval_ci95": list(acc.ci95),
                          "eval_reward_failures": acc.reward_failures, **acc.extra})
        if is_main():
            failed = (f" ({acc.reward_failures} scored reward.fallback: the reward failed on them)"
                      if acc.reward_failures else "")
            rate = acc.extra.get("eval_env/tool_call_rate")
            tools = "" if rate is None else f", tool-call rate {100 * rate:.1f}%"
            say(f"[{self.phase}] step {step}: greedy accuracy on {acc.n} eval prompts {acc}{tools}{failed}")
        return acc

    def finish(self, saved: dict) -> Path:
        """Each trained worker in Hugging Face format (``saved``: directory name -> worker, the
        policy first; None: absent), then the final evaluation: saved first, so a failing
        evaluation never costs the training. Returns the policy's directory."""
        self.bar.close()
        names = [name for name, w in saved.items() if w is not None]
        final = saved[names[0]].save(self.run_dir / names[0], self.tokenizer)
        canary = saved[names[0]].canary_summary() if self.faults else None
        if canary is not None and is_main():  # what the canary made of the injected faults
            record_check(self.run_dir, f"canary_{self.phase}", {"policy": canary["policy"], "steps": self.steps,
                                                                "steps_flagged": canary["steps_flagged"]})
        for name in names[1:]:
            saved[name].save(self.run_dir / name, self.tokenizer)
        try:
            if self.eval_set:
                self.evaluate(self.steps, saved[names[0]])
        except Exception as e:
            raise EvaluationError(f"the final evaluation failed: {e} (the trained model is saved in {final})") from e
        finally:
            self._banner("ends")
            self.log.close()
            if self.eval_set:
                self.eval_set.close()
        return final
