"""The one entry point: ``exactrl <command> [--config FILE] [key.path=value ...]``."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from exactrl.config import ConfigError, DemoConfig, RLConfig, SFTConfig, load_config
from exactrl.config.loader import valid_keys

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="exactrl: LLM post-training where every optimizer step applies exactly the gradient asked for.")
console = Console(stderr=True)

ConfigOpt = typer.Option(None, "--config", "-c", help="YAML config file (e.g. examples/sft_tiny.yaml or runs/X/config.yaml).")
OverridesArg = typer.Argument(None, help="Dotted overrides, e.g. optim.lr=3e-4 train.micro_batch_size=4")
COMMANDS = {"sft": SFTConfig, "rl": RLConfig, "demo": DemoConfig}


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def _run(kind: str, config: Optional[Path], overrides: Optional[list[str]], fn) -> None:
    from exactrl.algorithms.common import EvaluationError
    from exactrl.audit.canary import CanaryError
    from exactrl.data.jsonl import DataError
    from exactrl.distributed.checkpoint import CheckpointError
    from exactrl.models.loading import ModelLoadError
    from exactrl.rewards import RewardError

    from exactrl.distributed.launch import relaunch_under_torchrun, shutdown, under_launcher

    try:
        cfg = load_config(COMMANDS[kind], config, overrides or [])
        nproc = getattr(getattr(cfg, "distributed", None), "nproc_per_node", 1)
        if nproc > 1 and not under_launcher():
            raise typer.Exit(relaunch_under_torchrun(nproc))
        _quiet_libraries()
        fn(cfg)
        shutdown()
    except (ConfigError, DataError, ModelLoadError, RewardError, CheckpointError) as e:
        console.print(f"[bold red]error:[/bold red] {escape(str(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    except EvaluationError as e:  # the model is saved; the run still failed
        console.print(f"[bold red]error:[/bold red] {escape(str(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    except CanaryError as e:  # the step was not applied; checkpoints written so far are intact
        console.print(f"[bold red]stopped by the canary:[/bold red] {escape(str(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(3) from None


def _say_final(path) -> None:
    from exactrl.distributed.launch import is_main

    if is_main():
        console.print(f"final model: {path}")


@app.command()
def sft(config: Optional[Path] = ConfigOpt, overrides: Optional[list[str]] = OverridesArg):
    """Supervised fine-tuning (prompt/completion or chat messages JSONL)."""
    from exactrl.algorithms.sft import train_sft

    _run("sft", config, overrides, lambda cfg: _say_final(train_sft(cfg).final_model))


@app.command()
def rl(config: Optional[Path] = ConfigOpt, overrides: Optional[list[str]] = OverridesArg):
    """RL from verifiable rewards. algo.name (README "RL algorithms"):

    \b
    ppo                    critic + GAE, clipped policy and value losses (Schulman 2017)
    grpo                   group-normalised advantages, PPO clip (Shao 2024)
    dr_grpo                group-centred only, constant-length loss (Liu 2025)
    dapo                   clip-higher, dynamic sampling, overlong penalty (Yu 2025)
    rloo                   leave-one-out baseline (Ahmadian 2024)
    reinforce_pp           REINFORCE++: return to go, global whitening (Hu 2025)
    reinforce_pp_baseline  REINFORCE++ after subtracting the group mean
    gspo                   sequence-level ratio and clipping (Zheng 2025)
    """
    from exactrl.algorithms.rl import train_rl

    _run("rl", config, overrides, lambda cfg: _say_final(train_rl(cfg).final_model))


@app.command()
def demo(config: Optional[Path] = ConfigOpt, overrides: Optional[list[str]] = OverridesArg):
    """Built-in task, tiny model: accuracy before, after SFT and after SFT -> GRPO."""
    from exactrl.algorithms.demo import run_demo

    _run("demo", config, overrides, lambda cfg: run_demo(cfg, Console()))


audit_app = typer.Typer(no_args_is_help=True, help="Was my stack, or my past run, hit by a known silent gradient bug?")
app.add_typer(audit_app, name="audit")


@audit_app.command("stack")
def audit_stack_cmd(as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
                    python: Optional[str] = typer.Option(None, help="Audit another environment's python (default: this one)."),
                    world: list[int] = typer.Option([1, 2], help="World sizes to test.")):
    """Tiny real runs of every backend configuration; EXACT / BROKEN / ERROR per row. Exit 1 unless all exact."""
    import json

    from tqdm.auto import tqdm

    from exactrl.audit import stack

    versions = stack.probe_versions(python or sys.executable)
    bar = tqdm(total=len(stack.configurations(versions)) * len(world), desc="audit stack", unit="config", disable=as_json)
    versions, rows = stack.audit_stack(python, tuple(world), progress=lambda: bar.update(1))
    bar.close()
    if as_json:
        print(json.dumps(stack.to_json(versions, rows), indent=2))
    else:
        out = Console(width=120)
        out.print(stack.table(versions, rows))
        for note in sorted({r.known_bug for r in rows if r.known_bug}):
            out.print(f"[bold red]known bug:[/] {escape(note)}", soft_wrap=True)
        broken = sum(r.verdict != "EXACT" for r in rows)
        out.print("all configurations EXACT" if not broken else f"{broken} configuration(s) not exact", soft_wrap=True)
    raise typer.Exit(stack.exit_code(rows))


@audit_app.command("run")
def audit_run_cmd(paths: list[Path] = typer.Argument(..., help="Run directories or files (configs, launch scripts, pip freeze...)."),
                  as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")):
    """Read what past runs left behind; AFFECTED / NOT AFFECTED / UNKNOWN per known bug. Nothing is unpickled."""
    import json

    from exactrl.audit import runs

    audits = runs.audit_runs(paths)
    if as_json:
        print(json.dumps(runs.to_json(audits), indent=2))
    else:
        Console(width=120).print(runs.format_table(audits))
    raise typer.Exit(runs.exit_code(audits))


@app.command("config")
def show_config(command: str = typer.Argument(..., help="sft, rl or demo")):
    """Print every key of a command's config with its default and meaning."""
    if command not in COMMANDS:
        console.print(f"[bold red]error:[/bold red] unknown command '{command}'; choose sft, rl or demo")
        raise typer.Exit(2)
    for line in describe(COMMANDS[command]):
        print(line)


def describe(cls) -> list[str]:
    """``key = default  # description`` for every dotted key of ``cls``."""
    defaults = cls().model_dump(mode="json")
    out = []
    for key in valid_keys(cls):
        node, field_cls = defaults, cls
        for part in key.split("."):
            node = node[part]
        *sections, leaf = key.split(".")
        for part in sections:
            field_cls = field_cls.model_fields[part].annotation
        desc = field_cls.model_fields[leaf].description or ""
        out.append(f"{key} = {node!r}  # {desc}")
    return out


def main() -> None:
    """The `exactrl` command. The DeepSpeed launcher appends --local_rank=N to a script's
    arguments (unless given --no_local_rank); exactrl reads LOCAL_RANK from the environment,
    which every launcher sets, so the flag is dropped here."""
    argv, i = sys.argv, 1
    while i < len(argv):
        if argv[i].startswith("--local_rank="):
            del argv[i]
        elif argv[i] == "--local_rank" and i + 1 < len(argv):
            del argv[i : i + 2]
        else:
            i += 1
    app()


if __name__ == "__main__":
    main()
