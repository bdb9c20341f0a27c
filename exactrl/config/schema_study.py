"""The typed configuration of `exactrl study`: a grid of methods x seeds on one task at equal
data, each cell trained and evaluated the same way (exactrl/pipelines/study.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from exactrl.config.methods import NAMES
from exactrl.config.schema import DataConfig, OptimConfig, Section, SFTConfig, TrainConfig
from exactrl.config.schema_commands import TaskConfig
from exactrl.config.schema_env import TOOL_TASKS
from exactrl.config.schema_rl import AlgoConfig, RLConfig, RolloutConfig

# The methods a study compares besides the mixed-policy algorithms of the registry: SFT alone,
# SFT then RL (rl.algo.name, GRPO by default) and its truncated variant (truncated.*).
SFT_BASED = ("sft", "sft_rl", "sft_rl_truncated")
# The seed paper's grid (arXiv 2604.23747, table 2): its three SFT-based rows and the five
# mixed-policy methods it compares; chord and uft join by config.
PAPER_GRID = (*SFT_BASED, "luffy", "relift", "srft", "prefix_rft", "hpt")
# The default grid adds RL alone (GRPO from the initial model), the other baseline a method has to beat.
DEFAULT_GRID = (*PAPER_GRID, "grpo")


def _study_sft(steps: int = 400) -> SFTConfig:
    # 400 steps of 32 demonstrations (12,800: 0.64 epochs of the 20,000), in micro-batches of 8:
    # four per step, so a fault that drops middle micro-batches has some to drop (the exact gradient
    # does not depend on the split). No evaluation inside the phase: the study evaluates every cell
    # alike. The base model's pretraining (base.*) takes the same settings on its own corpus, for
    # 800 steps. (800 SFT steps ranked the methods the same and took the study past 50 minutes on
    # a 2-core AVX2 machine.)
    return SFTConfig(
        data=DataConfig(eval=None),
        train=TrainConfig(global_batch_size=32, micro_batch_size=8, max_steps=steps, log_every=10),
        optim=OptimConfig(lr=3e-3, warmup_steps=20, scheduler="cosine"),
    )


def _rl_phase(steps: int, group_size: int, lr: float, warmup: int, scheduler: str, log_every: int) -> RLConfig:
    """An RL phase of 128 samples per step in micro-batches of 32 (four per step), on the SFT
    problems (the study sets data.train), without evaluation inside it."""
    return RLConfig(
        data=DataConfig(eval=None),
        train=TrainConfig(global_batch_size=128, micro_batch_size=32, max_steps=steps, log_every=log_every),
        optim=OptimConfig(lr=lr, warmup_steps=warmup, scheduler=scheduler),
        rollout=RolloutConfig(temperature=1.0, max_new_tokens=48),
        algo=AlgoConfig(group_size=group_size),
    )


def _study_rl() -> RLConfig:
    # The demo's GRPO phase: 40 steps of 16 prompts x 8 at 1e-4.
    return _rl_phase(40, 8, 1e-4, 5, "constant", 1)


def _study_mixed() -> RLConfig:
    # Equal data: 400 steps of 32 prompts, each with its one demonstration, show a method the
    # 12,800 demonstrations SFT sees; groups of 4 (a mixed-policy method's demonstration and 3 of
    # the policy's responses). lr 3e-4 from the base model (GRPO there at 1e-3 fell from 30% to 0%
    # greedy in 100 steps); from start=init, SFT's 3e-3 learns the format sooner.
    return _rl_phase(400, 4, 3e-4, 20, "cosine", 10)


class TruncatedConfig(Section):
    max_steps: int = Field(10, gt=0,
                           description="RL steps of the truncated SFT-then-RL cell (the seed paper: 50 of the full "
                                       "run's 500).")
    lr: float = Field(2e-4, gt=0,
                      description="Its learning rate (the seed paper: 5e-6 against the full run's 1e-6).")


class BugsConfig(Section):
    grids: dict[str, list[str]] = Field(
        default_factory=lambda: {"dropped-micro-batches": ["fault.dropped_micro_batches=true", "audit.canary=warn"],
                                 "mean-of-means": ["fault.mean_of_means=true"]},
        description="--with-bugs: each entry a grid run again with these overrides on every phase of its "
                    "methods (the fault.* options; audit.canary=warn lets a run the canary stops go on, and the "
                    "study counts the steps it flagged).")
    methods: list[str] = Field(list(SFT_BASED),
                               description="The methods run with the faults (the seed paper's bugs were in the "
                                           "SFT-then-RL stack; the mixed-policy methods ran on their own code); the "
                                           "others keep their clean cells.")


class StudyConfig(Section):
    """`exactrl study`: methods x seeds at equal data, held-out accuracy with 95% intervals, FLOPs, wall time."""

    task: TaskConfig = Field(default_factory=lambda: TaskConfig(model="small"),
                             description="The built-in task (the small initial model: exactrl/tasks/tiny_model.py).")
    methods: list[str] = Field(list(DEFAULT_GRID),
                               description="The grid's methods: sft, sft_rl, sft_rl_truncated, or an RL algo.name "
                                           "trained from the task's initial model (" + ", ".join(NAMES) + "): "
                                           "grpo is RL alone, a mixed-policy method learns from the demonstrations "
                                           "too.")
    seeds: list[int] = Field([0, 1], description="Training seeds (train.seed of every phase); the task stays the same. "
                                                 "One seed ranks nothing: where a phase change happens moves with "
                                                 "the seed, even with float rounding.")
    start: Literal["base", "init"] = Field(
        "base",
        description="What every method starts from. 'base': a base model, the task's initial model pretrained "
                    "(base.*) on the task's pretraining corpus -- problems disjoint from the SFT and held-out ones, "
                    "worked with every carry forgotten -- so that it knows the format, solves the problems that "
                    "need no carry and has never seen a carry, as the seed paper's methods start from a pretrained "
                    "base model; trained once per study, its FLOPs in no cell's. 'init': the task's randomly "
                    "initialised model, from which RL alone never earns a reward.")
    base: SFTConfig = Field(default_factory=lambda: _study_sft(800),
                            description="The base model's pretraining (start=base), from the task's initial model on "
                                        "its pretraining corpus (data.train is the study's).")
    sft: SFTConfig = Field(default_factory=_study_sft,
                           description="The SFT phase of the SFT-based methods (model and data: the task's).")
    rl: RLConfig = Field(default_factory=_study_rl,
                         description="The RL phase of sft_rl (rl.algo.name, GRPO by default), from the SFT model, on "
                                     "the SFT problems (equal data).")
    truncated: TruncatedConfig = TruncatedConfig()
    mixed: RLConfig = Field(default_factory=_study_mixed,
                            description="The settings the RL methods trained from the task's initial model share (RL "
                                        "alone, the mixed-policy methods), on the SFT problems and their "
                                        "demonstrations; algo.name is the cell's.")
    method_overrides: dict[str, list[str]] = Field(
        default_factory=dict,
        description="Per-method key=value overrides of its RL phase, e.g. {luffy: [algo.luffy.demonstrations=2]}.")
    jobs: int = Field(0, ge=0,
                      description="Cells trained at once, each seed of each grid in a process of its own with its "
                                  "share of the CPU threads (the tiny models train about as fast on one thread as "
                                  "on two); 0 = one per CPU core (on a GPU: 1), at most one per seed and grid; 1 = "
                                  "one after another in the study's own process.")
    eval_size: int = Field(1000, gt=0, description="Held-out problems every cell is evaluated on (greedy).")
    bugs: BugsConfig = BugsConfig()
    output_dir: str = Field("runs/study-{time}",
                            description="Study directory (one directory per cell; a rerun with the same directory "
                                        "continues, never re-running a finished cell); {time} is filled in.")

    @model_validator(mode="after")
    def _one_task(self):
        if self.task.name in TOOL_TASKS:
            raise ValueError(f"task.name={self.task.name} is a tool task, answered in episodes; a study compares "
                             "one-turn methods (the mixed-policy ones learn from one-turn demonstrations)")
        for phase in ("rl", "mixed"):
            if getattr(self, phase).task != TaskConfig():
                raise ValueError(f"{phase}.task: every cell of a study runs the study's task (task.*)")
        return self

    @model_validator(mode="after")
    def _known_methods(self):
        known = (*SFT_BASED, *NAMES)
        for where, names in (("methods", self.methods), ("bugs.methods", self.bugs.methods),
                             ("method_overrides", list(self.method_overrides))):
            unknown = [m for m in names if m not in known]
            if unknown:
                raise ValueError(f"{where}: {', '.join(unknown)} is not a method; the methods are "
                                 f"{', '.join(known)}")
        if len(set(self.methods)) != len(self.methods) or len(set(self.seeds)) != len(self.seeds):
            raise ValueError("methods and seeds each name every entry once")
        return self
