"""`exactrl demo`: the pipeline (exactrl/pipelines/pipeline.py) on the built-in task and tiny model.
Accuracy before, after SFT, after SFT -> GRPO.

Every number in the final table is measured on the same held-out problems (disjoint from all
training data), greedy, with Wilson 95% intervals; sampled pass@1 at the RL temperature is
shown beside it because RL typically moves sampled accuracy first.
"""

from __future__ import annotations

from rich.console import Console

from exactrl.config.schema_commands import DemoConfig
from exactrl.pipelines.pipeline import run_pipeline
from exactrl.seeding import seed_everything
from exactrl.tasks.builtin import BuiltinSpec, ensure_builtin


def run_demo(cfg: DemoConfig, console: Console | None = None) -> dict:
    console = console or Console()
    spec = BuiltinSpec(**cfg.task.model_dump())
    seed_everything(cfg.task.seed)
    paths = ensure_builtin(spec)
    console.print(f"built-in task: {spec.digits}-digit {spec.name}, {cfg.task.n_sft} SFT demonstrations, "
                  f"{cfg.task.n_rl} RL prompts, {cfg.task.n_eval} held-out problems (cached in {paths.root})",
                  soft_wrap=True, highlight=False)
    return run_pipeline(cfg, console, spec, command="demo", seed=cfg.task.seed)
