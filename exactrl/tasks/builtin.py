"""Materialise the built-in task on disk (cached): model dir, tokenizer, SFT/RL/eval JSONL files.

Everything a user would otherwise download lives in one directory, so the built-in default
runs through exactly the code path a user's own checkpoint and data take.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from filelock import FileLock

from exactrl.tasks import arithmetic, calculator, multiplication, preference
from exactrl.tasks.tiny_model import SIZES, save_tiny_model
from exactrl.tasks.tokenizer import save_tokenizer


def cache_dir() -> Path:
    """Where built-in artefacts live: $EXACTRL_CACHE, else ~/.cache/exactrl."""
    return Path(os.environ.get("EXACTRL_CACHE") or Path.home() / ".cache" / "exactrl")


# task.name -> (its digits, its teacher's slip_prob) when not given: exactrl/tasks/<module>.py
TASKS = {"addition": (3, None), "multiplication": (4, 0.6), "calculator": (3, None)}
PREFIX = {"addition": "arith-", "multiplication": "mul-", "calculator": "calc-"}  # of each task's cache key


@dataclass(frozen=True)
class BuiltinSpec:
    seed: int = 0
    digits: int | None = None  # None: the task's own (TASKS)
    direct_fraction: float = 0.5
    skip_prob: float = 0.75
    n_sft: int = 20000
    n_rl: int = 20000
    n_eval: int = 2000
    name: str = "addition"
    slip_prob: float | None = None  # multiplication's teacher slips (None: the task's own)
    model: str = "tiny"  # the initial model's size (tiny_model.SIZES)

    def __post_init__(self):
        if self.name not in TASKS:
            raise ValueError(f"no built-in task '{self.name}'; the tasks are {', '.join(TASKS)}")
        if self.model not in SIZES:
            raise ValueError(f"no built-in model size '{self.model}'; the sizes are {', '.join(SIZES)}")
        if self.name != "multiplication" and self.slip_prob is not None:
            raise ValueError(f"slip_prob is the multiplication teacher's; the {self.name} task has none")
        digits, slip = TASKS[self.name]
        object.__setattr__(self, "digits", digits if self.digits is None else self.digits)
        object.__setattr__(self, "slip_prob", slip if self.slip_prob is None else self.slip_prob)

    def key(self) -> str:
        fields = asdict(self)
        name = fields.pop("name")
        if fields["model"] == "tiny":  # caches made before there were two sizes keep their key
            fields.pop("model")
        if name != "multiplication":  # only its teacher slips (and addition's caches keep their first key)
            fields.pop("slip_prob")
        return PREFIX[name] + "-".join(f"{k}{v}" for k, v in fields.items())


@dataclass(frozen=True)
class BuiltinPaths:
    root: Path
    model: Path
    sft_train: Path
    rl_train: Path
    eval: Path
    mixed_train: Path  # the SFT problems with answers and demonstrations (mixed-policy methods)
    pretrain: Path  # the RL problems worked with every carry forgotten (a study's base model)


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, path)


def ensure_builtin(spec: BuiltinSpec = BuiltinSpec(), cache: Path | None = None) -> BuiltinPaths:
    """Build (once) and return the paths of the built-in model and data for ``spec``."""
    root = Path(cache or cache_dir()) / spec.key()
    paths = BuiltinPaths(root, root / "model-init", root / "sft_train.jsonl", root / "rl_train.jsonl",
                         root / "eval.jsonl", root / "mixed_train.jsonl", root / "pretrain.jsonl")
    if (root / "DONE").exists() and paths.mixed_train.exists() and paths.pretrain.exists():
        return paths
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(root / ".lock"):  # several ranks or runs may ask at once: one builds, the others wait
        if not (root / "DONE").exists():
            _build(spec, paths)
        else:  # a cache built before these files existed
            if not paths.mixed_train.exists():
                _write_mixed(spec, paths)
            if not paths.pretrain.exists():
                _write_pretrain(spec, paths)
    return paths


def _build(spec: BuiltinSpec, paths: BuiltinPaths) -> None:
    root = paths.root
    tok = save_tokenizer(paths.model)
    save_tiny_model(paths.model, tok, seed=spec.seed, **SIZES[spec.model])
    if spec.name == "multiplication":
        _build_multiplication(spec, paths)
        return
    rows = _addition_rows(spec)
    train = arithmetic.generate("train", spec.n_sft + spec.n_rl, spec.seed, spec.digits)
    _write_jsonl(paths.sft_train, rows.sft_rows(train[: spec.n_sft], spec.direct_fraction, spec.skip_prob, spec.seed))
    _write_mixed(spec, paths)
    _write_jsonl(paths.rl_train, rows.rl_rows(train[spec.n_sft :]))
    _write_pretrain(spec, paths)
    _write_jsonl(paths.eval, rows.rl_rows(arithmetic.generate("eval", spec.n_eval, spec.seed, spec.digits)))
    (root / "DONE").write_text(json.dumps(asdict(spec)))


def _addition_rows(spec: BuiltinSpec):
    """The module writing the rows of an addition problem: the addition task's, or the calculator task's (the same
    problems, with a tool)."""
    return calculator if spec.name == "calculator" else arithmetic


def _write_mixed(spec: BuiltinSpec, paths: BuiltinPaths) -> None:
    sft = arithmetic.generate("train", spec.n_sft + spec.n_rl, spec.seed, spec.digits)[: spec.n_sft]
    _write_jsonl(paths.mixed_train, _addition_rows(spec).mixed_rows(sft, spec.direct_fraction, spec.skip_prob,
                                                                    spec.seed))


def _write_pretrain(spec: BuiltinSpec, paths: BuiltinPaths) -> None:
    """The RL split's problems (disjoint from the SFT and held-out ones) worked with every carry forgotten."""
    if spec.name == "multiplication":
        problems = multiplication.generate("train", spec.n_sft + spec.n_rl, spec.seed, spec.digits)[spec.n_sft :]
        rows = [{"prompt": p.prompt, "completion": multiplication.worked_solution(p, frozenset(range(spec.digits)))}
                for p in problems]
    else:
        rows = _addition_rows(spec).pretrain_rows(arithmetic.generate("train", spec.n_sft + spec.n_rl, spec.seed,
                                                                      spec.digits)[spec.n_sft :])
    _write_jsonl(paths.pretrain, rows)


def _build_multiplication(spec: BuiltinSpec, paths: BuiltinPaths) -> None:
    """The multiplication task's files; the mixed file holds exactly the SFT rows' problems and completions."""
    train = multiplication.generate("train", spec.n_sft + spec.n_rl, spec.seed, spec.digits)
    sft = train[: spec.n_sft]
    shown = multiplication.demonstrations(sft, spec.direct_fraction, spec.skip_prob, spec.slip_prob, spec.seed)
    _write_jsonl(paths.sft_train, [{"prompt": p.prompt, "completion": c} for p, c in zip(sft, shown)])
    _write_jsonl(paths.mixed_train, [{"prompt": p.prompt, "answer": p.answer, "demonstration": c}
                                     for p, c in zip(sft, shown)])
    _write_jsonl(paths.rl_train, arithmetic.rl_rows(train[spec.n_sft :]))
    _write_pretrain(spec, paths)
    _write_jsonl(paths.eval, arithmetic.rl_rows(multiplication.generate("eval", spec.n_eval, spec.seed, spec.digits)))
    (paths.root / "DONE").write_text(json.dumps(asdict(spec)))


def ensure_builtin_preference(spec: BuiltinSpec = BuiltinSpec(),
                              cache: Path | None = None) -> preference.PreferencePaths:
    """Build (once) and return the paths of the preference, unpaired and step-labelled sets of
    ``spec`` (exactrl/tasks/preference.py), beside its model and data; they need no model."""
    if spec.name != "addition":
        raise ValueError(f"the built-in preference sets come from the addition task; task {spec.name!r} has none")
    return preference.ensure_preference(Path(cache or cache_dir()) / spec.key(), spec.seed, spec.digits, spec.n_sft,
                                        spec.n_rl, spec.n_eval)


def resolve(path: str | None, kind: str, spec: BuiltinSpec = BuiltinSpec()) -> str | None:
    """Map 'builtin' in model.path / data.* to the built-in files; other paths pass through
    ('builtin-sft', the model after SFT, needs training: exactrl/algorithms/sft.py).

    ``kind`` is one of model, sft_train, rl_train, eval, mixed_train, pretrain, or one of the
    preference sets' (preference.KINDS: pairs_train, pairs_eval, unpaired_*, steps_*), which need no model.
    """
    if path != "builtin":
        return path
    if kind in preference.KINDS:
        return str(getattr(ensure_builtin_preference(spec), kind))
    return str(getattr(ensure_builtin(spec), kind))
