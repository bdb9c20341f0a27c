"""The built-in task section (task.*): which built-in problems, data and models 'builtin' and 'builtin-sft' mean
in `exactrl rl`, `exactrl demo` and `exactrl study` (exactrl/tasks/builtin.py BuiltinSpec takes its fields)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from exactrl.config.schema import Section
from exactrl.tasks.tiny_model import SIZES, parameters


def _size(name: str) -> str:
    """The built-in model's size as the help states it: derived from its shapes, so it cannot drift from them."""
    return f"{parameters(name) / 1e6:.2f}M parameters, {SIZES[name]['num_hidden_layers']} layers"


class TaskConfig(Section):
    name: Literal["addition", "multiplication", "calculator"] = Field(
        "addition", description="The built-in task: 'addition' (two operands of task.digits digits, exactrl/tasks/"
                                "arithmetic.py), 'multiplication' (a task.digits-digit number times 2-9, a teacher "
                                "that also slips: exactrl/tasks/multiplication.py), harder for the tiny model, or "
                                "'calculator' (addition as chats whose teacher sometimes calls a calculator tool, "
                                "exactrl/tasks/calculator.py: the multi-turn task).")
    seed: int = Field(0, description="Seed of the problems, the SFT style mix and the initial model.")
    digits: int | None = Field(None, ge=1, le=6,
                               description="Digits per operand (multiplication: of the first); unset = the task's "
                                           "own, 3 for addition, 4 for multiplication.")
    slip_prob: float | None = Field(None, ge=0, le=1,
                                    description="multiplication: how often its teacher forgets a carry of 4 or more "
                                                "(then its answer is wrong); unset = 0.6. The addition teacher "
                                                "has no slips.")
    direct_fraction: float = Field(0.5, ge=0, le=1,
                                   description="The SFT teacher tends to skip the working when the first operand's "
                                               "last digit is below 10 x this (see exactrl/tasks/arithmetic.py).")
    skip_prob: float = Field(0.75, ge=0, le=1, description="How often the teacher skips the working on those problems.")
    model: Literal["tiny", "small"] = Field("tiny",
                                            description=f"The initial model: 'tiny' ({_size('tiny')}: the demo's) "
                                                        f"or 'small' ({_size('small')}: learns the worked solutions "
                                                        "in fewer steps, at twice the step rate; the study's). Both: "
                                                        "exactrl/tasks/tiny_model.py.")
    n_sft: int = Field(20000, gt=0, description="SFT demonstrations.")
    n_rl: int = Field(20000, gt=0, description="RL prompts (disjoint from the SFT problems).")
    n_eval: int = Field(2000, gt=0, description="Held-out problems (disjoint from both).")

    @model_validator(mode="after")
    def _slips_are_multiplications(self):
        if self.slip_prob is not None and self.name != "multiplication":
            raise ValueError(f"task.slip_prob={self.slip_prob} is the multiplication teacher's; set "
                             "task.name=multiplication or unset it")
        return self
