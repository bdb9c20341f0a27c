"""`exactrl study`: the seed paper's comparison (arXiv 2604.23747) as one command -- a grid of
methods x seeds on one task at equal data, every cell trained through the same trainers a user's
run takes and evaluated the same way, then one table, one plot and report.md.

Every method starts from the same base model (start=base): the task's initial model pretrained
once per study on problems disjoint from the others, worked with every carry forgotten -- it knows
the format, solves what needs no carry and has never seen a carry, which sampling will not find and
the demonstrations show (start=init: the randomly initialised model).
Equal data: every method sees the task's SFT problems and their demonstrations, nothing else.
SFT learns the demonstrations; SFT-then-RL (and its truncated variant) continues from the seed's
SFT model with RL on the same problems; an RL method of the registry trains from the base model
on the same problems, a mixed-policy one learning from their demonstrations too.
Every cell's final model answers the same held-out problems greedily; its FLOPs count the
phases it needed (an SFT-based cell includes its SFT phase), as does its wall time.

The study directory holds one directory per cell (``clean/<method>-seed<s>/``, and per
--with-bugs grid ``bugs-<name>/<method>-seed<s>/``), each a run directory of its own with a
``cell.json`` once finished. A rerun with the same output_dir never re-runs a finished cell; a
cell that failed is reported and the others go on (it is tried again by the next run).

Cells run ``jobs`` at a time, each chain of them -- one seed of one grid, its SFT cell first --
in a process of its own with its share of the CPU threads: the chains share nothing but the
task's cached files and write only their own cells.
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.connection
import os
import shutil
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console

from exactrl.algorithms.rl import train_rl
from exactrl.algorithms.sft import train_sft
from exactrl.audit.manifest import write_manifest
from exactrl.config.loader import with_overrides
from exactrl.config.schema_study import SFT_BASED, StudyConfig
from exactrl.data.encode import encode_prompts
from exactrl.data.jsonl import read_jsonl
from exactrl.metrics import read_metrics
from exactrl.models.loading import load_causal_lm, load_tokenizer
from exactrl.pipelines.study_report import write_study_report
from exactrl.rewards import Rewards
from exactrl.rollout.hf import HFEngine
from exactrl.run.evaluation import evaluate_accuracy
from exactrl.run_dir import create_run_dir
from exactrl.tasks.builtin import BuiltinSpec, ensure_builtin

CLEAN = "clean"


class StudyIncomplete(RuntimeError):
    """Some cells failed; the others, the tables over them and the report are written."""


@dataclass(frozen=True)
class Cell:
    method: str
    seed: int
    grid: str = CLEAN  # "clean", or the name of a --with-bugs grid (bugs.grids)

    @property
    def name(self) -> str:
        return f"{self.method}-seed{self.seed}"

    @property
    def folder(self) -> str:
        return CLEAN if self.grid == CLEAN else f"bugs-{self.grid}"


def grid(cfg: StudyConfig, name: str = CLEAN) -> list[Cell]:
    """The cells of one grid in the order they run: per seed, SFT first (the SFT-based methods
    continue from its model), then the rest as listed. A bugs grid holds the methods the faults
    apply to (bugs.methods); the others keep their clean cells."""
    methods = cfg.methods if name == CLEAN else [m for m in cfg.methods if m in cfg.bugs.methods]
    needs_sft = any(m in SFT_BASED for m in methods)
    order = (["sft"] if needs_sft else []) + [m for m in methods if m != "sft"]
    return [Cell(m, s, name) for s in cfg.seeds for m in order]


def chains(cells: list[Cell]) -> list[list[Cell]]:
    """The cells grouped by (grid, seed), in order: each group runs in one process, its SFT cell
    before the cells that continue from it."""
    out: dict[tuple[str, int], list[Cell]] = {}
    for c in cells:
        out.setdefault((c.grid, c.seed), []).append(c)
    return list(out.values())


class Study:
    def __init__(self, cfg: StudyConfig, console: Console, with_bugs: bool = False, *, directory: Path | None = None):
        """``directory``: the existing directory of a running study, for a process running some of
        its cells (the study's own process creates or continues the directory and its manifest)."""
        self.cfg, self.console, self.with_bugs = cfg, console, with_bugs
        self.spec = BuiltinSpec(**cfg.task.model_dump())
        self.paths = ensure_builtin(self.spec)
        self.failures: dict[Cell, str] = {}
        if directory is not None:
            self.dir = directory
            return
        continues = Path(cfg.output_dir).is_dir()
        self.dir = create_run_dir(cfg.output_dir, "study", cfg, continues=continues)
        write_manifest(self.dir, cfg.seeds[0], {"sft_train": self.paths.sft_train,
                                                "mixed_train": self.paths.mixed_train, "eval": self.paths.eval},
                       {"task": self.spec.key(), "study": {"methods": cfg.methods, "seeds": cfg.seeds,
                                                            "with_bugs": with_bugs}})

    def run(self) -> dict:
        grids = [CLEAN, *(self.cfg.bugs.grids if self.with_bugs else ())]
        cells = [c for g in grids for c in grid(self.cfg, g)]
        done = sum(self.result(c) is not None for c in cells)
        self.console.print(f"[bold]exactrl study[/bold] -> {self.dir}: {len(cells)} cells "
                           f"({len(self.cfg.methods)} methods x {len(self.cfg.seeds)} seeds"
                           + (f", {len(grids) - 1} bug grids" if len(grids) > 1 else "") + f"), {done} already done")
        todo = chains([c for c in cells if self.result(c) is None])
        base = self.ensure_base() if self.cfg.start == "base" else None
        # jobs=0: a process per core on a CPU; one GPU's cells run one after another
        jobs = min(self.cfg.jobs or (1 if torch.cuda.is_available() else os.cpu_count() or 1), len(todo))
        if jobs > 1:
            self.run_parallel(todo, jobs)
        else:
            t0 = time.perf_counter()
            for cell in (c for chain in todo for c in chain):
                self.console.print(f"[bold][{cells.index(cell) + 1}/{len(cells)}][/bold] {cell.folder}/{cell.name} "
                                   f"(study time {time.perf_counter() - t0:.0f} s)")
                self.run_cell(cell)
        results = {c: r for c in cells if (r := self.result(c)) is not None}
        summary = write_study_report(self.dir, self.cfg, grids, cells, results, self.failures, self.console, base)
        if summary["failed"]:
            raise StudyIncomplete(f"{len(summary['failed'])} of {len(cells)} cells did not finish (the report covers "
                                  f"the others; each failed cell's error.txt says why): run the study again with "
                                  f"output_dir={self.dir} to retry only them")
        return summary

    def run_parallel(self, todo: list[list[Cell]], jobs: int) -> None:
        """Run the chains ``jobs`` at a time, each in a fresh process with its share of the CPU
        threads; a cell that did not write its cell.json failed (its error.txt, or how its process
        ended, says why)."""
        threads = max(1, torch.get_num_threads() // jobs)
        self.console.print(f"{len(todo)} chains of cells (a seed of a grid each), {jobs} at a time, {threads} "
                           f"CPU thread{'s' if threads > 1 else ''} each")
        spawn, queue, running = multiprocessing.get_context("spawn"), list(todo), {}
        try:
            while queue or running:
                while queue and len(running) < jobs:
                    chain = queue.pop(0)
                    p = spawn.Process(target=_run_chain, args=(self.cfg.model_dump(), str(self.dir), self.with_bugs,
                                                                chain, threads))
                    p.start()
                    running[p.sentinel] = (p, chain)
                for sentinel in multiprocessing.connection.wait(list(running)):
                    p, chain = running.pop(sentinel)
                    p.join()
                    for cell in chain:
                        if self.result(cell) is None:
                            self.failures[cell] = self.failure(cell, p.exitcode)
        finally:
            for p, _ in running.values():
                p.terminate()
                p.join()

    def failure(self, cell: Cell, exitcode: int | None) -> str:
        error = self.cell_dir(cell) / "error.txt"
        if error.exists():
            return error.read_text().splitlines()[0]
        return f"its process ended with exit code {exitcode} before the cell finished"

    # ------------------------------------------------------------------ the base model

    @property
    def start_model(self) -> Path:
        """The model every method starts from."""
        return self.dir / "base" / "model" if self.cfg.start == "base" else self.paths.model

    def ensure_base(self) -> dict:
        """Pretrain the base model once (base/, base.json once finished) and return its figures."""
        where, done = self.dir / "base", self.dir / "base" / "base.json"
        if not done.exists():
            if where.exists():
                shutil.rmtree(where)
            where.mkdir(parents=True)
            self.console.print(f"[bold]base model[/bold]: the initial model pretrained on {self.paths.pretrain.name} "
                               f"({self.cfg.base.train.max_steps} steps)")
            cfg = with_overrides(self.cfg.base, [f"data.train={self.paths.pretrain}",
                                                 f"train.seed={self.cfg.task.seed}"])
            write_manifest(where, self.cfg.task.seed, {"pretrain": self.paths.pretrain},
                           {"task": self.spec.key(), "study_base": True})
            res = train_sft(cfg, where, self.spec, phase="base", final_name="model")
            figures = {**phase_figures(where, "base", res.seconds), **self.evaluate(where / "model")}
            tmp = where / ".base.json.tmp"
            tmp.write_text(json.dumps(figures, indent=2))
            os.replace(tmp, done)
        base = json.loads(done.read_text())
        self.console.print(f"  base model: greedy accuracy {100 * base['accuracy']:.1f}% on {len(base['outcomes'])} "
                           f"problems, {base['flops']:.3g} FLOPs (in no cell's), {base['seconds']:.0f} s",
                           soft_wrap=True)
        return base

    # ------------------------------------------------------------------ one cell

    def cell_dir(self, cell: Cell) -> Path:
        return self.dir / cell.folder / cell.name

    def result(self, cell: Cell) -> dict | None:
        path = self.cell_dir(cell) / "cell.json"
        return json.loads(path.read_text()) if path.exists() else None

    def run_cell(self, cell: Cell) -> None:
        where = self.cell_dir(cell)
        if where.exists():  # an unfinished attempt: its files are the study's own, and start again
            shutil.rmtree(where)
        where.mkdir(parents=True)
        try:
            result = self.train(cell, where)
            result |= self.evaluate(where / "model")
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as e:  # a failed cell is reported; the others go on
            message = f"{type(e).__name__}: {e}"
            (where / "error.txt").write_text(message + "\n\n" + traceback.format_exc())
            self.failures[cell] = message
            self.console.print(f"[red]cell {cell.folder}/{cell.name} failed[/red]: {message} (the others go on; "
                               "the next run of the study tries it again)", soft_wrap=True)
            return
        tmp = where / ".cell.json.tmp"
        tmp.write_text(json.dumps({"method": cell.method, "seed": cell.seed, "grid": cell.grid, **result}, indent=2))
        os.replace(tmp, where / "cell.json")  # the cell counts as finished only once this exists
        self.console.print(f"  {cell.folder}/{cell.name}: greedy accuracy {100 * result['accuracy']:.1f}% on "
                           f"{len(result['outcomes'])} problems, {result['flops']:.3g} FLOPs, "
                           f"{result['seconds']:.0f} s", soft_wrap=True)

    def overrides(self, cell: Cell, method: str) -> list[str]:
        """A phase's settings on top of its section: the seed, the method's own, the grid's faults."""
        faults = self.cfg.bugs.grids[cell.grid] if cell.grid != CLEAN else []
        return [f"train.seed={cell.seed}", *self.cfg.method_overrides.get(method, []), *faults]

    def train(self, cell: Cell, where: Path) -> dict:
        """Train the cell's phases into ``where``. Returns its phases' figures (an SFT-based cell's
        include the seed's SFT phase, whose model it starts from), their FLOPs and wall time."""
        cfg, m = self.cfg, cell.method
        start = self.cell_dir(Cell("sft", cell.seed, cell.grid)) / "model" if m in SFT_BASED[1:] else self.start_model
        write_manifest(where, cell.seed, {"sft_train": self.paths.sft_train, "mixed_train": self.paths.mixed_train},
                       {"task": self.spec.key(), "study_cell": {"method": m, "seed": cell.seed, "grid": cell.grid,
                                                                "start": str(start),
                                                                "overrides": self.overrides(cell, m)}})
        if m == "sft":
            res = train_sft(with_overrides(cfg.sft, [f"model.path={self.start_model}", *self.overrides(cell, m)]),
                            where, self.spec, phase="sft", final_name="model")
            phases = {"sft": phase_figures(where, "sft", res.seconds)}
        elif m in SFT_BASED:
            sft = Cell("sft", cell.seed, cell.grid)
            if self.result(sft) is None:
                raise RuntimeError(f"it continues from {sft.folder}/{sft.name}, which did not finish")
            settings = [f"data.train={self.paths.mixed_train}"]  # equal data: RL on the SFT problems
            if m == "sft_rl_truncated":
                settings += [f"train.max_steps={cfg.truncated.max_steps}", f"optim.lr={cfg.truncated.lr}"]
            rl = with_overrides(cfg.rl, [*settings, *self.overrides(cell, m)])
            res = train_rl(rl, where, self.spec, phase="rl", model_path=str(self.cell_dir(sft) / "model"),
                           final_name="model")
            phases = {"sft": self.result(sft)["phases"]["sft"], "rl": phase_figures(where, "rl", res.seconds)}
        else:
            rl = with_overrides(cfg.mixed, [f"algo.name={m}", f"data.train={self.paths.mixed_train}",
                                            *self.overrides(cell, m)])
            res = train_rl(rl, where, self.spec, phase="rl", model_path=str(self.start_model), final_name="model")
            phases = {"rl": phase_figures(where, "rl", res.seconds)}
        return {"phases": phases, "flops": sum(p["flops"] for p in phases.values()),
                "seconds": sum(p["seconds"] for p in phases.values()),
                "canary_flagged": sum(p["canary_flagged"] for p in phases.values()),
                "faults": cfg.bugs.grids[cell.grid] if cell.grid != CLEAN else []}

    def evaluate(self, model_dir: Path) -> dict:
        """Greedy answers to the first eval_size held-out problems, each scored by the task's checker."""
        tok, model = load_tokenizer(model_dir), load_causal_lm(model_dir, trainable=False)
        r = self.cfg.rl
        prompts = encode_prompts(read_jsonl(self.paths.eval)[: self.cfg.eval_size], tok, r.data.max_length)
        outcomes: list[int] = []
        with Rewards(r.reward.specs()[0]) as rewards:
            acc = evaluate_accuracy(HFEngine(model, tok, r.eval.batch_size).generate, prompts, rewards.eval,
                                    batch_size=r.eval.batch_size,
                                    max_new_tokens=r.eval.max_new_tokens, stop=tuple(r.rollout.stop),
                                    timeout=r.reward.timeout,
                                    on_batch=lambda _p, _g, values: outcomes.extend(int(v >= 1.0) for v in values))
        return {"accuracy": acc.value, "outcomes": outcomes}


def phase_figures(where: Path, phase: str, seconds: float) -> dict:
    """A phase's FLOPs (the last count its metrics logged), training wall time and the steps the
    canary flagged (a fault it was told only to warn about)."""
    records = [r for r in read_metrics(where / "metrics.jsonl") if r.get("phase") == phase]
    last = max(records, key=lambda r: r["step"]) if records else {}  # its counts are running totals
    return {"flops": last.get("flops", 0.0), "seconds": seconds, "canary_flagged": last.get("canary_fired", 0)}


def _run_chain(cfg: dict, directory: str, with_bugs: bool, cells: list[Cell], threads: int) -> None:
    """A study's process for one chain of cells (Study.run_parallel)."""
    torch.set_num_threads(threads)
    study = Study(StudyConfig.model_validate(cfg), Console(), with_bugs, directory=Path(directory))
    for cell in cells:
        study.console.print(f"[bold]{cell.folder}/{cell.name}[/bold] starts")
        study.run_cell(cell)


def run_study(cfg: StudyConfig, console: Console | None = None, with_bugs: bool = False) -> dict:
    return Study(cfg, console or Console(), with_bugs).run()
