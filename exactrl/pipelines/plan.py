"""`exactrl config check CONFIG`: validate a config of any command as a run would (the same one-line
errors, exit 2) without running it, and print the run's plan: optimizer steps, samples and, where the
data decides it, tokens per step, and the FLOPs estimate of exactrl/compute.py.

Nothing is trained or loaded onto a device. A local data file is read (its rows counted; with a local
tokenizer its mean tokens per sample measured); a local model's parameters are counted on the meta
device. Paths that are not here (a recipe written for another machine) are reported as not found and
the plan goes on with what the options give: --params (N), --tokens-per-sample (D), --rollout-tokens,
--data-rows.
"""

from __future__ import annotations

import math
from pathlib import Path

import yaml

from exactrl.compute import rl_flops, sft_flops
from exactrl.config.loader import ConfigError, load_config
from exactrl.config.methods import METHODS
from exactrl.pipelines.plan_base import Options, PhasePlan, _local, _n_params, _tokenizer

# A section only one command's config has, checked in this order: the first found names the command.
# in order: task.* is also rl's and eval's (after their own keys), env.* also rl's (after rl's)
SIGNATURES = (("study", "methods"), ("study", "seeds"), ("study", "mixed"), ("study", "bugs"), ("rl", "algo"),
              ("rl", "rollout"), ("rl", "reward"), ("rl", "critic"), ("eval", "pass_at_k"), ("eval", "env"),
              ("demo", "task"), ("pipeline", "sft"), ("pipeline", "rl"), ("pipeline", "truncate"), ("dpo", "dpo"),
              ("kto", "kto"), ("rm", "rm"), ("kd", "kd"))


def detect_command(path: Path) -> str:
    """The command a config file is for, from its top-level sections (sft when none tells)."""
    try:
        data = yaml.safe_load(path.read_text()) if path.is_file() else None
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        data = None  # load_config reports it, with the line
    keys = set(data) if isinstance(data, dict) else set()
    return next((command for command, key in SIGNATURES if key in keys), "sft")


def plan_sft(cfg, spec, opts: Options, model_path: str | None = None) -> PhasePlan:
    from exactrl.data.encode import load_sft
    from exactrl.data.files import read_rows

    p = PhasePlan("sft", samples_per_step=cfg.train.global_batch_size)
    model_dir = _local(model_path or cfg.model.path, spec, "model", p.notes, "model")
    data = _local(cfg.data.train, spec, "sft_train", p.notes, "data.train")
    rows = len(read_rows(data)) if data else opts.data_rows
    if cfg.train.max_steps:
        p.steps = cfg.train.max_steps
    elif rows is not None:
        p.steps = max(1, math.ceil(cfg.train.epochs * rows / cfg.train.global_batch_size))
    else:
        p.notes.append(f"steps unknown: train.epochs={cfg.train.epochs} of data not here; give --data-rows")
    p.tokens_per_sample = opts.tokens_per_sample
    tok = _tokenizer(model_dir, cfg, p.notes) if data and p.tokens_per_sample is None else None
    if tok is not None:
        examples, _ = load_sft(data, tok, cfg.data)
        p.tokens_per_sample = sum(len(e.input_ids) for e in examples) / len(examples)
        p.notes.append(f"{p.tokens_per_sample:.1f} tokens per sample on average in {data}")
    p.n_params = _n_params(model_dir, opts, p.notes, cfg)
    if None not in (p.steps, p.tokens_per_sample, p.n_params):
        p.flops = sft_flops(p.n_params, p.steps * p.samples_per_step, p.tokens_per_sample)
    return p


def plan_rl(cfg, spec, opts: Options, model_path: str | None = None) -> PhasePlan:
    """Every RL sample is planned as a rollout (8ND), but the demonstrations a luffy or srft group holds
    (6ND, of --tokens-per-sample tokens: a demonstration's length, --rollout-tokens a rollout's); the
    demonstrations other mixed-policy methods add as they go are not planned (a note says so)."""
    from exactrl.data.encode import load_prompts
    from exactrl.data.files import read_rows
    from exactrl.pipelines.pipeline import rl_data_kind

    a, t = cfg.algo, cfg.train
    per_rollout = a.ppo_epochs * a.mini_batches
    p = PhasePlan("rl", samples_per_step=t.global_batch_size, group_size=a.group_size,
                  prompts_per_rollout=t.global_batch_size * a.mini_batches // a.group_size)
    model_dir = _local(model_path or cfg.model.path, spec, "model", p.notes, "model")
    data = _local(cfg.data.train, spec, rl_data_kind(cfg), p.notes, "data.train")
    rows = len(read_rows(data)) if data else opts.data_rows
    if t.max_steps:
        p.rollouts = t.max_steps // per_rollout
    elif rows is not None:
        p.rollouts = max(1, math.ceil(t.epochs * rows / p.prompts_per_rollout))
    else:
        p.notes.append(f"rollouts unknown: train.epochs={t.epochs} of data not here; give --data-rows")
    p.steps = None if p.rollouts is None else p.rollouts * per_rollout
    p.tokens_per_sample = opts.rollout_tokens or opts.tokens_per_sample
    tok = _tokenizer(model_dir, cfg, p.notes) if data and p.tokens_per_sample is None else None
    if tok is not None:  # a rollout's length is the policy's to decide: bound it by the response limit
        prompts, _ = load_prompts(data, tok, cfg.data)
        p.tokens_per_sample = sum(len(q.input_ids) for q in prompts) / len(prompts) + cfg.rollout.max_new_tokens
        p.notes.append(f"tokens per rollout at most {p.tokens_per_sample:.1f} (mean prompt + "
                       f"rollout.max_new_tokens={cfg.rollout.max_new_tokens}): the FLOPs are an upper bound")
    p.n_params = _n_params(model_dir, opts, p.notes, cfg)
    # a group of luffy or srft holds m demonstrations (6ND each, of a demonstration's length) and the rest rollouts
    m = METHODS[a.name]
    demos = getattr(a, m.config).demonstrations if m.demonstrations_in_group else 0
    demo_tokens = opts.tokens_per_sample or p.tokens_per_sample
    if demos:
        p.notes.append(f"{a.group_size - demos} rollouts (8ND, D = {p.tokens_per_sample}) and {demos} "
                       f"demonstration(s) (6ND, D = {demo_tokens}) per prompt")
    elif m.demonstrations:
        p.notes.append(f"algo.name={a.name} also trains on demonstrations it adds to a rollout as it goes: planned "
                       "as rollouts alone, a lower bound")
    if None not in (p.rollouts, p.tokens_per_sample, p.n_params):
        p.flops = rl_flops(p.n_params, p.rollouts, p.prompts_per_rollout, a.group_size - demos, p.tokens_per_sample,
                           demonstrations_per_prompt=demos, demonstration_tokens=demo_tokens,
                           training_passes=a.ppo_epochs)
    return p


def plan(cfg, command: str, opts: Options) -> list[PhasePlan]:
    from exactrl.tasks.builtin import BuiltinSpec

    if command == "eval":
        return []
    if command in ("dpo", "kto", "rm"):
        from exactrl.pipelines.plan_pref import plan_preference

        return [plan_preference(cfg, command, BuiltinSpec(), opts)]
    if command == "kd":
        from exactrl.pipelines.plan_pref import plan_kd

        return [plan_kd(cfg, BuiltinSpec(), opts)]
    if command == "sft":
        return [plan_sft(cfg, BuiltinSpec(), opts)]
    if command == "rl":
        return [plan_rl(cfg, BuiltinSpec(**cfg.task.model_dump()), opts)]
    if command == "study":
        return plan_study(cfg, opts)
    spec = BuiltinSpec(**cfg.task.model_dump()) if command == "demo" else BuiltinSpec()
    # the RL phase starts from the SFT model: the SFT phase's model stands for it (same architecture)
    return [plan_sft(cfg.sft, spec, opts), plan_rl(cfg.rl_phase(), spec, opts, model_path=cfg.sft.model.path)]


def plan_study(cfg, opts: Options) -> list[PhasePlan]:
    """A study's base model pretraining (start=base, once), then one seed's phases of its grid: the
    SFT phase the SFT-based methods share, then each method's RL phase (exactrl/pipelines/study.py);
    the grid runs them once per seed."""
    from exactrl.config.loader import with_overrides
    from exactrl.config.schema_study import SFT_BASED
    from exactrl.tasks.builtin import BuiltinSpec, ensure_builtin

    spec = BuiltinSpec(**cfg.task.model_dump())
    paths = ensure_builtin(spec)
    mixed = str(paths.mixed_train)
    phases = []
    if cfg.start == "base":
        phases.append(plan_sft(with_overrides(cfg.base, [f"data.train={paths.pretrain}"]), spec, opts))
        phases[-1].name = "base"
        phases[-1].notes.append("once per study, the model every method starts from; its FLOPs count in no cell")
    if any(m in SFT_BASED for m in cfg.methods):
        phases.append(plan_sft(cfg.sft, spec, opts))
    for m in (m for m in cfg.methods if m != "sft"):
        settings = [f"data.train={mixed}", *cfg.method_overrides.get(m, [])]
        if m == "sft_rl_truncated":
            settings += [f"train.max_steps={cfg.truncated.max_steps}", f"optim.lr={cfg.truncated.lr}"]
        rl = with_overrides(cfg.rl if m in SFT_BASED else cfg.mixed, settings if m in SFT_BASED else [
            f"algo.name={m}", *settings])
        phase = plan_rl(rl, spec, opts, model_path=cfg.sft.model.path)
        phase.name = f"{m}: rl"
        phases.append(phase)
    if len(phases) > (cfg.start == "base"):
        phases[-1].notes.append(f"the grid runs these phases once per seed: x {len(cfg.seeds)} for the whole study")
    return phases


def describe(phases: list[PhasePlan]) -> list[str]:
    """The plan as printed lines."""
    out = []
    for p in phases:
        steps = "?" if p.steps is None else str(p.steps)
        head = f"{p.name}: {steps} optimizer steps of {p.samples_per_step} samples"
        if p.name in ("dpo", "rm"):
            head = f"{p.name}: {steps} optimizer steps of {p.samples_per_step // 2} pairs ({p.samples_per_step} seqs)"
        if p.name.endswith("rl"):
            rollouts = "?" if p.rollouts is None else str(p.rollouts)
            head += f" ({rollouts} rollouts of {p.prompts_per_rollout} prompts x {p.group_size} responses)"
        tokens = ("unknown" if p.tokens_per_sample is None
                  else f"{p.tokens_per_sample * p.samples_per_step:.4g} ({p.tokens_per_sample:.4g} per sample)")
        n = "unknown" if p.n_params is None else f"{p.n_params:.4g}"
        if p.name == "kd":
            n += f" (student), {'unknown' if p.teacher_params is None else f'{p.teacher_params:.4g}'} (teacher)"
        flops = "unknown" if p.flops is None else f"{p.flops:.3g}"
        out += [head, f"  tokens per step: {tokens}; N = {n} parameters; FLOPs: {flops}"]
        out += [f"  {note}" for note in p.notes]
    known = [p.flops for p in phases]
    if len(phases) > 1:
        out.append(f"total FLOPs: {sum(known):.3g}" if None not in known else "total FLOPs: unknown")
    return out


def check_config(path: Path, command: str | None, overrides: list[str], opts: Options, commands: dict) -> list[str]:
    """Load and validate ``path`` as ``command`` (detected when None; ``commands``: name -> config class)
    would, then plan it: the lines to print. A problem raises what a run would raise (ConfigError,
    DataError, ...)."""
    command = command or detect_command(path)
    if command not in commands:
        raise ConfigError(f"--command {command}: choose one of {', '.join(commands)}")
    cfg = load_config(commands[command], path, overrides)
    return [f"{path}: a valid `exactrl {command}` config", *describe(plan(cfg, command, opts))]


def run_check(path: Path | None, command: str | None, overrides: list[str], opts: Options, commands: dict) -> int:
    """`exactrl config check`: the plan on stdout and exit code 0, or what a run would refuse in one line on
    stderr and exit code 2."""
    from rich.console import Console
    from rich.markup import escape

    from exactrl.data.jsonl import DataError
    from exactrl.models.loading import ModelLoadError

    try:
        if path is None:
            raise ConfigError("exactrl config check needs a config file, e.g. exactrl config check "
                              "examples/sft_tiny.yaml")
        lines = check_config(path, command, overrides, opts, commands)
    except (ConfigError, DataError, ModelLoadError, OSError) as e:
        Console(stderr=True).print(f"[bold red]error:[/bold red] {escape(str(e))}", highlight=False, soft_wrap=True)
        return 2
    print("\n".join(lines))
    return 0
