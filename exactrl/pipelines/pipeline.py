"""`exactrl pipeline`: SFT, then RL from the SFT model, as one run (the seed paper's SFT-then-RL,
arXiv 2604.23747; the demo is this pipeline on the built-in task).

  1. held-out accuracy of the starting model (greedy, and sampled at the RL temperature);
  2. the SFT phase, a run of its own in <run>/sft/ (as `exactrl sft` writes it), then its accuracy;
  3. the RL phase (any algo.name; truncate.* shortens it) from sft/final, in <run>/rl/, then its accuracy;
  4. summary.json, report.md and plot.png: accuracy with 95% intervals, FLOPs (exactrl/compute.py) and
     wall time per phase.
With resume=true a phase that finished (its result.json) is never re-run and an interrupted one continues
from its newest complete checkpoint; accuracies measured before the interruption are kept.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from exactrl.algorithms.registry import ALGORITHMS
from exactrl.algorithms.rl import train_rl
from exactrl.algorithms.sft import resolve, train_sft
from exactrl.audit.manifest import write_manifest
from exactrl.compute import FlopsCounter
from exactrl.config.faults import banner, injected
from exactrl.config.loader import dump_config
from exactrl.config.schema_commands import PipelineConfig
from exactrl.data.encode import load_prompts
from exactrl.device import use_device
from exactrl.distributed.checkpoint import complete_checkpoints
from exactrl.metrics import MetricsLog, read_metrics
from exactrl.models.loading import load_causal_lm, load_tokenizer
from exactrl.report import plot_run
from exactrl.rewards import Rewards
from exactrl.rollout.hf import HFEngine
from exactrl.run.evaluation import Accuracy, eval_data, eval_reward_spec, evaluate_accuracy
from exactrl.run_dir import create_run_dir
from exactrl.tasks.builtin import BuiltinSpec


class PhaseError(RuntimeError):
    """A phase run as a command of its own failed; it has said why. ``code``: its exit code, the pipeline's."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


RESULT = "result.json"  # a finished phase's outcome; its presence is what "finished" means
STAGES = {"before": "starting model", "after_sft": "after SFT", "after_rl": "after RL"}


def rl_data_kind(cfg) -> str:
    """The built-in file 'builtin' names for the RL phase: with demonstrations when its algorithm learns from them."""
    return "mixed_train" if ALGORITHMS.lookup(cfg.algo.name).demonstrations else "rl_train"


def measure(cfg: PipelineConfig, model_path: Path | str, prompts, seed: int) -> tuple[Accuracy, Accuracy]:
    """Greedy accuracy and sampled pass@1 (the RL phase's sampling) of a model on the held-out prompts, on the
    device the SFT phase trains on."""
    trust = cfg.sft.model.trust_remote_code
    tok = load_tokenizer(model_path, trust, cfg.rl.data.chat_template)
    model = load_causal_lm(model_path, trainable=False, device=use_device(cfg.sft.distributed.device),
                           trust_remote_code=trust)
    ev, r = cfg.rl.eval, cfg.rl.rollout
    common = dict(batch_size=ev.batch_size, max_new_tokens=ev.max_new_tokens, stop=tuple(r.stop),
                  timeout=cfg.rl.reward.timeout)
    with Rewards(eval_reward_spec(cfg.rl)) as rewards:
        decode = HFEngine(model, tok, ev.batch_size).generate
        greedy = evaluate_accuracy(decode, prompts, rewards.eval, **common)
        sampled = evaluate_accuracy(decode, prompts, rewards.eval, greedy=False, temperature=r.temperature,
                                    top_p=r.top_p, top_k=r.top_k, seed=seed, **common)
    return greedy, sampled


def run_phase(run_dir: Path, name: str, cfg, train, resume: bool, console: Console) -> dict:
    """One phase in ``run_dir/name``: its result.json when an earlier launch finished it; else train it,
    continuing from its newest complete checkpoint under ``resume``. A phase of several processes
    (distributed.nproc_per_node > 1) runs as its own command, which relaunches itself under torchrun."""
    where = run_dir / name
    if (where / RESULT).exists():
        console.print(f"{name}: finished in an earlier launch, kept ({where})", highlight=False)
        return json.loads((where / RESULT).read_text())
    cfg.output_dir = str(where)
    if cfg.distributed.nproc_per_node > 1:
        result = _launched(name, cfg, run_dir)
    else:
        where.mkdir(exist_ok=True)
        done = complete_checkpoints(where) if resume else []
        if done:
            # its config.yaml stays the one the checkpoint was written under: the resume checks against it
            cfg.train.resume_from = str(done[-1])
            console.print(f"{name}: continuing from {done[-1].name}", highlight=False)
        else:
            dump_config(cfg, where / "config.yaml")
        if (where / "metrics.jsonl").exists():  # the records after this one redo the steps after the checkpoint
            MetricsLog(where / "metrics.jsonl").write({"event": "continued", "resume_from": cfg.train.resume_from})
        out = train(cfg, where)
        result = {"final_model": str(out.final_model), "steps": out.steps, "seconds": out.seconds,
                  "compute": out.compute}
    tmp = where / f".{RESULT}.tmp"
    tmp.write_text(json.dumps(result, indent=2))
    os.replace(tmp, where / RESULT)
    return result


def _launched(name: str, cfg, run_dir: Path) -> dict:
    """The phase as `exactrl <name>` in a child process, continuing its own output_dir (train.resume_from=latest
    starts from step 0 when it holds no checkpoint). Its wall time includes the start-up of its processes."""
    cfg.train.resume_from = "latest"
    path = run_dir / f".{name}-config.yaml"
    dump_config(cfg, path)
    t0 = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "exactrl.cli", name, "--config", str(path)])
    try:
        code = child.wait()
    except BaseException:
        # SIGINT reached the child too (one process group); SIGTERM may have reached only this process: pass it on,
        # and let the child record its end (its checkpoints kept) before this process records its own
        try:
            child.wait(timeout=5)
        except subprocess.TimeoutExpired:
            child.terminate()
            child.wait()
        raise
    if code:
        raise PhaseError(f"the {name} phase ended with exit code {code} (its reason is above; its run is in "
                         f"{cfg.output_dir}); fix it, then continue the pipeline with resume=true", code)
    records = [r for r in read_metrics(Path(cfg.output_dir) / "metrics.jsonl") if "flops" in r]
    last = records[-1]
    return {"final_model": str(Path(cfg.output_dir) / "final"), "steps": last["step"],
            "seconds": time.perf_counter() - t0, "compute": {k: last[k] for k in FlopsCounter(0).record()}}


def run_pipeline(cfg: PipelineConfig, console: Console | None = None, spec: BuiltinSpec = BuiltinSpec(),
                 command: str = "pipeline", seed: int | None = None) -> dict:
    """The whole pipeline; returns summary.json's content. ``seed`` keys the sampled accuracy (default
    rl.train.seed); ``spec``: the built-in task 'builtin' names."""
    console = console or Console()
    t_start = time.perf_counter()
    run_dir = create_run_dir(cfg.output_dir, command, cfg, continues=cfg.resume)
    console.print(f"[bold]exactrl {command}[/bold] -> {run_dir}")
    t0 = time.perf_counter()
    model_path = resolve(cfg.sft.model.path, "model", spec)  # the built-in task is built here when named
    files = {"sft_train": resolve(cfg.sft.data.train, "sft_train", spec),
             "rl_train": resolve(cfg.rl.data.train, rl_data_kind(cfg.rl), spec),
             "eval": resolve(eval_data(cfg.rl), "eval", spec)}
    build_s = time.perf_counter() - t0
    builtin = any(str(x).startswith("builtin") for x in (cfg.sft.model.path, cfg.sft.data.train, cfg.rl.data.train,
                                                          eval_data(cfg.rl)))
    faults = {**injected(cfg.sft.fault), **injected(cfg.rl.fault)}  # known bugs reproduced on purpose
    label = {"faults_injected": faults} if faults else {}
    write_manifest(run_dir, cfg.rl.train.seed, files, {**({"task": spec.key()} if builtin else {}), **label})
    tok = load_tokenizer(model_path, cfg.sft.model.trust_remote_code, cfg.rl.data.chat_template)
    prompts = load_prompts(files["eval"], tok, cfg.rl.data)[0] if files["eval"] else None

    log = MetricsLog(run_dir / "metrics.jsonl")
    acc = {r["stage"]: (Accuracy(**r["greedy"]), Accuracy(**r["sampled"]))
           for r in read_metrics(run_dir / "metrics.jsonl") if r.get("phase") == "eval"}

    def measured(stage: str, path) -> None:
        if prompts is None or stage in acc:
            return
        acc[stage] = measure(cfg, path, prompts, cfg.rl.train.seed if seed is None else seed)
        log.write({"phase": "eval", "stage": stage, **({"faults_injected": list(faults)} if faults else {}),
                   "greedy": asdict(acc[stage][0]), "sampled": asdict(acc[stage][1])})
        console.print(f"{STAGES[stage]}: greedy accuracy {acc[stage][0]}", highlight=False)

    measured("before", model_path)
    sft = run_phase(run_dir, "sft", cfg.sft.model_copy(deep=True),
                    lambda c, d: train_sft(c, d, spec, phase="sft"), cfg.resume, console)
    measured("after_sft", sft["final_model"])
    rl_cfg = cfg.rl_phase()
    rl_cfg.model.path = sft["final_model"]
    rl = run_phase(run_dir, "rl", rl_cfg, lambda c, d: train_rl(c, d, spec, phase="rl"), cfg.resume, console)
    measured("after_rl", rl["final_model"])
    log.close()

    phases = {"sft": sft, "rl": rl}
    total_flops = sum(p["compute"]["flops"] for p in phases.values())
    summary = {
        "accuracy": {k: g.as_dict() for k, (g, _) in acc.items()},
        "sampled_pass1": {k: s.as_dict() for k, (_, s) in acc.items()},
        "seconds": {"build": build_s, **{k: v["seconds"] for k, v in phases.items()},
                    "eval": sum(g.seconds + s.seconds for g, s in acc.values()),
                    "total": time.perf_counter() - t_start},
        "phases": phases,
        "flops": {"sft": sft["compute"]["flops"], "rl": rl["compute"]["flops"], "total": total_flops},
        "truncated": cfg.truncate.model_dump() if cfg.truncate.rollouts else None,
        "eval_problems": len(prompts) if prompts else 0,
        **({"task": f"{spec.digits}-digit {spec.name}"} if builtin else {}),
        **label,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    records = [*read_metrics(run_dir / "sft" / "metrics.jsonl"), *read_metrics(run_dir / "rl" / "metrics.jsonl")]
    plot_run(run_dir, [(k, g.value, g.ci95) for k, (g, _) in acc.items()], records)
    table = summary_table(acc, phases, summary["eval_problems"])
    console.print(table, width=130)  # a log file is 80 columns to rich; the table needs ~120
    write_report(run_dir, command, summary, table)
    console.print(f"run directory: {run_dir}  (summary.json, report.md, plot.png, sft/, rl/)", highlight=False)
    return summary


def summary_table(acc: dict, phases: dict, n: int) -> Table:
    t = Table(title=f"Held-out accuracy on {n} problems (95% CI)" if n else "No eval set: phases only")
    for col in ("stage", "greedy accuracy", "sampled pass@1", "phase wall time", "phase throughput", "phase FLOPs"):
        t.add_column(col)
    # SFT's throughput in tokens trained on, RL's in tokens its generator processed (prompts and responses)
    rate = {"after_sft": ("sft", "trained", "flops_trained_tokens"),
            "after_rl": ("rl", "generated", "flops_generated_tokens")}
    for name in ("before", "after_sft", "after_rl"):
        g, s = acc.get(name, ("-", "-"))
        ph = rate.get(name)
        wall = tput = flops = "-"
        if ph:
            p = phases[ph[0]]
            wall, flops = f"{p['seconds']:.0f} s", f"{p['compute']['flops']:.3g}"
            tput = f"{p['compute'][ph[2]] / p['seconds']:.0f} {ph[1]} tok/s" if p["seconds"] else "-"
        t.add_row(name.replace("_", " "), str(g), str(s), wall, tput, flops)
    return t


def write_report(run_dir: Path, command: str, summary: dict, table: Table) -> None:
    console = Console(record=True, width=130, file=open(os.devnull, "w"))
    console.print(table)
    a, f = summary["accuracy"], summary["flops"]
    lines = [f"# exactrl {command} report", ""]
    if summary.get("faults_injected"):
        lines += [banner(summary["faults_injected"], "this run"), ""]
    if summary.get("task"):
        lines += [f"Task: {summary['task']} (built-in), {summary['eval_problems']} held-out problems.", ""]
    lines += ["```", console.export_text().rstrip(), "```", ""]
    if {"before", "after_sft", "after_rl"} <= a.keys():
        lines += [f"SFT moved greedy accuracy from {100 * a['before']['value']:.1f}% to "
                  f"{100 * a['after_sft']['value']:.1f}%; RL from the SFT model reached "
                  f"{100 * a['after_rl']['value']:.1f}%.", ""]
    truncated = summary["truncated"]
    lines += [
        f"Compute (exactrl/compute.py: 6ND per trained sequence, 2ND per generated one, N parameters, D tokens of "
        f"prompt and response): SFT {f['sft']:.3g} FLOPs, RL {f['rl']:.3g} FLOPs, {f['total']:.3g} in all"
        + (f" (truncated RL: {truncated['rollouts']} rollouts)." if truncated else "."), "",
        f"Total wall time {summary['seconds']['total']:.0f} s. Files: `config.yaml` (replay with `exactrl {command} "
        "--config`), `manifest.json`, `metrics.jsonl` (the accuracies), `summary.json`, `plot.png`, and each "
        "phase's run: `sft/` and `rl/` (config.yaml, metrics.jsonl with FLOPs per logged step, final/).", "",
        "![training curves](plot.png)", "",
    ]
    (run_dir / "report.md").write_text("\n".join(lines))
