"""`exactrl study`: the seed paper's comparison (arXiv 2604.23747) as one command -- a grid of
methods x seeds on one task at equal data, every cell trained through the same trainers a user's
run takes and evaluated the same way, then one table, one plot and report.md.

Equal data: every method sees the task's SFT problems and their demonstrations, nothing else.
SFT learns the demonstrations; SFT-then-RL (and its truncated variant) continues from the seed's
SFT model with RL on the same problems; an RL method of the registry trains from the task's
initial model on the same problems, a mixed-policy one learning from their demonstrations too.
Every cell's final model answers the same held-out problems greedily; its FLOPs count the
phases it needed (an SFT-based cell includes its SFT phase), as does its wall time.

The study directory holds one directory per cell (``clean/<method>-seed<s>/``, and per
--with-bugs grid ``bugs-<name>/<method>-seed<s>/``), each a run directory of its own with a
``cell.json`` once finished. A rerun with the same output_dir never re-runs a finished cell; a
cell that failed is reported and the others go on (it is tried again by the next run).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

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


class Study:
    def __init__(self, cfg: StudyConfig, console: Console, with_bugs: bool = False):
        self.cfg, self.console, self.with_bugs = cfg, console, with_bugs
        self.spec = BuiltinSpec(**cfg.task.model_dump())
        continues = Path(cfg.output_dir).is_dir()
        self.dir = create_run_dir(cfg.output_dir, "study", cfg, continues=continues)
        self.paths = ensure_builtin(self.spec)
        write_manifest(self.dir, cfg.seeds[0], {"sft_train": self.paths.sft_train,
                                                "mixed_train": self.paths.mixed_train, "eval": self.paths.eval},
                       {"task": self.spec.key(), "study": {"methods": cfg.methods, "seeds": cfg.seeds,
                                                            "with_bugs": with_bugs}})
        self.failures: dict[Cell, str] = {}

    def run(self) -> dict:
        grids = [CLEAN, *(self.cfg.bugs.grids if self.with_bugs else ())]
        cells = [c for g in grids for c in grid(self.cfg, g)]
        done = sum(self.result(c) is not None for c in cells)
        self.console.print(f"[bold]exactrl study[/bold] -> {self.dir}: {len(cells)} cells "
                           f"({len(self.cfg.methods)} methods x {len(self.cfg.seeds)} seeds"
                           + (f", {len(grids) - 1} bug grids" if len(grids) > 1 else "") + f"), {done} already done")
        t0 = time.perf_counter()
        for i, cell in enumerate(cells, start=1):
            if self.result(cell) is not None:
                continue
            self.console.print(f"[bold][{i}/{len(cells)}][/bold] {cell.folder}/{cell.name} "
                               f"(study time {time.perf_counter() - t0:.0f} s)")
            self.run_cell(cell)
        results = {c: r for c in cells if (r := self.result(c)) is not None}
        summary = write_study_report(self.dir, self.cfg, grids, cells, results, self.failures, self.console)
        if summary["failed"]:
            raise StudyIncomplete(f"{len(summary['failed'])} of {len(cells)} cells did not finish (the report covers "
                                  f"the others; each failed cell's error.txt says why): run the study again with "
                                  f"output_dir={self.dir} to retry only them")
        return summary

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
        self.console.print(f"  {cell.name}: greedy accuracy {100 * result['accuracy']:.1f}% on "
                           f"{len(result['outcomes'])} problems, {result['flops']:.3g} FLOPs, "
                           f"{result['seconds']:.0f} s")

    def overrides(self, cell: Cell, method: str) -> list[str]:
        """A phase's settings on top of its section: the seed, the method's own, the grid's faults."""
        faults = self.cfg.bugs.grids[cell.grid] if cell.grid != CLEAN else []
        return [f"train.seed={cell.seed}", *self.cfg.method_overrides.get(method, []), *faults]

    def train(self, cell: Cell, where: Path) -> dict:
        """Train the cell's phases into ``where``. Returns its phases' figures (an SFT-based cell's
        include the seed's SFT phase, whose model it starts from), their FLOPs and wall time."""
        cfg, m = self.cfg, cell.method
        write_manifest(where, cell.seed, {"sft_train": self.paths.sft_train, "mixed_train": self.paths.mixed_train},
                       {"task": self.spec.key(), "study_cell": {"method": m, "seed": cell.seed, "grid": cell.grid,
                                                                "overrides": self.overrides(cell, m)}})
        if m == "sft":
            res = train_sft(with_overrides(cfg.sft, self.overrides(cell, m)), where, self.spec, phase="sft",
                            final_name="model")
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
            res = train_rl(rl, where, self.spec, phase="rl", model_path=str(self.paths.model), final_name="model")
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
            acc = evaluate_accuracy(model, tok, prompts, rewards.eval, batch_size=r.eval.batch_size,
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


def run_study(cfg: StudyConfig, console: Console | None = None, with_bugs: bool = False) -> dict:
    return Study(cfg, console or Console(), with_bugs).run()
