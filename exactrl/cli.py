"""The one entry point: ``exactrl <command> [--config FILE] [key.path=value ...]``."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from exactrl.audit.commands import audit_app
from exactrl.config import ConfigError, DemoConfig, PipelineConfig, RLConfig, SFTConfig, load_config
from exactrl.config.loader import describe_keys
from exactrl.config.methods import METHODS
from exactrl.config.schema_commands import EvalCommandConfig
from exactrl.config.schema_kd import KDConfig
from exactrl.config.schema_pref import DPOConfig, KTOConfig
from exactrl.config.schema_rm import RMConfig
from exactrl.config.schema_study import StudyConfig
from exactrl.run import exits
from exactrl.run.exits import Terminated
from exactrl.run_dir import replay_overrides

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="exactrl: LLM post-training where every optimizer step applies exactly the gradient asked for.")
console = Console(stderr=True)

ConfigOpt = typer.Option(None, "--config", "-c",
                         help="YAML config file (e.g. examples/sft_tiny.yaml or runs/X/config.yaml).")
OverridesArg = typer.Argument(None, help="Dotted overrides, e.g. optim.lr=3e-4 train.micro_batch_size=4")
DemoOverridesArg = typer.Argument(None, help="Dotted overrides, e.g. task.n_sft=5000 sft.train.max_steps=200 "
                                              "rl.optim.lr=1e-4")
PipelineOverridesArg = typer.Argument(None, help="Dotted overrides, e.g. sft.train.epochs=3 rl.optim.lr=1e-6 "
                                                  "truncate.rollouts=50")
COMMANDS = {"sft": SFTConfig, "kd": KDConfig, "dpo": DPOConfig, "kto": KTOConfig, "rm": RMConfig, "rl": RLConfig,
            "pipeline": PipelineConfig, "demo": DemoConfig, "eval": EvalCommandConfig, "study": StudyConfig}


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    import transformers

    if not torch.cuda.is_available():
        # As exactrl/device.py tells DeepSpeed, but before anything a command does first (the demo saves the
        # built-in model, and accelerate imports DeepSpeed in save_pretrained, before any device is chosen).
        os.environ.setdefault("DS_ACCELERATOR", "cpu")

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


_signalled: int | None = None  # the signal that is stopping this process
_again: list[threading.Timer] = []


def _on_signal(signum, frame):
    global _signalled
    _signalled = signum
    if frame is not None and frame.f_code.co_name == "__del__":
        # Python prints and drops an exception raised in a finalizer (seen: regex's, mid-rollout), and the
        # run would go on: the same signal again in a moment, when the main thread is back in ordinary code.
        _again.append(threading.Timer(0.1, os.kill, (os.getpid(), signum)))
        _again[-1].start()
        return
    raise KeyboardInterrupt() if signum == signal.SIGINT else Terminated()


def _stopped(signum: int):
    end, name = (exits.SIGINT, "SIGINT (Ctrl-C)") if signum == signal.SIGINT else (exits.SIGTERM, "SIGTERM")
    return _fail(end.status, end.label, f"{name}; checkpoints written so far are intact", end.code)


def _fail(status: str, label: str, message: str, code: int):
    from exactrl.run_dir import note_end, set_status

    if _signalled is not None and status != "interrupted":  # e.g. a reward process killed by the same signal
        return _stopped(_signalled)
    set_status(status, message)
    if not note_end(status, label, message, code):  # a rank under exactrl's launcher: the launcher prints it once
        console.print(f"[bold red]{label}:[/bold red] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def _relaunch(nproc: int) -> typer.Exit:
    """This command as ``nproc`` processes under torchrun; their end as one line, one exit code and the
    run directory's status, as one process would give (the ranks' notes: exactrl/run_dir.py)."""
    import tempfile

    from exactrl.distributed.launch import relaunch_under_torchrun
    from exactrl.run_dir import adopt, launch_notes

    with tempfile.TemporaryDirectory(prefix="exactrl-launch-") as tmp:
        notes = Path(tmp)
        try:
            code = relaunch_under_torchrun(nproc, notes)
        except BaseException:  # SIGINT/SIGTERM: every rank is gone now; the run ends as this signal says
            run_dir, _ = launch_notes(notes)
            if run_dir is not None:
                adopt(run_dir)
            raise
        run_dir, ends = launch_notes(notes)
    if code == 0:
        return typer.Exit(0)
    # The first rank to fail is the cause; torchrun then SIGTERMs the others, which end 'interrupted'.
    cause = next((e for e in ends if e["state"] != "interrupted"), ends[0] if ends else None)
    if cause is None:
        cause = {"state": "error", "label": "error", "code": code,
                 "message": f"torchrun ended with exit code {code} before any rank said why; its output, if any, "
                            "is above"}
    if run_dir is not None:
        adopt(run_dir)
    return _fail(cause["state"], cause["label"], cause["message"], cause["code"])


def _run(kind: str, config: Path | None, overrides: list[str] | None, fn) -> None:
    """Runs a command; its end (exit code, the one line, status.json) is the row of exactrl/run/exits.py's table
    that the error raised matches (docs/exit-codes.md): 0 success, 2 a problem in the input, 3 a check stopped it,
    4 a non-finite step, 1 a failure after training or a bug, 130/143 SIGINT/SIGTERM."""
    from exactrl.algorithms.common import preflight
    from exactrl.distributed.engine import NonFiniteError
    from exactrl.distributed.launch import end_rank, shutdown, under_launcher
    from exactrl.run.start_checks import check_before_start
    from exactrl.run_dir import forget_current, note_end, record_event, set_status

    global _signalled
    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        cfg = load_config(COMMANDS[kind], config, replay_overrides(config, overrides or [], console))
        if not under_launcher():  # the launcher checked for its ranks
            check_before_start(cfg)
        nproc = getattr(getattr(cfg, "distributed", None), "nproc_per_node", 1)
        if nproc > 1 and not under_launcher():
            preflight(cfg, nproc)  # what every rank would refuse, refused once and before the start-up
            raise _relaunch(nproc)
        _quiet_libraries()
        fn(cfg)
        set_status("success")
        shutdown()
    except KeyboardInterrupt:
        raise _stopped(signal.SIGINT) from None
    except Terminated:
        raise _stopped(signal.SIGTERM) from None
    except typer.Exit:
        raise
    except BaseException as e:
        end = exits.ending(e)
        if end is None:
            if _signalled is not None:  # e.g. a collective broken by a peer that stopped first: the signal is the cause
                raise _stopped(_signalled) from None
            # A bug: record it, keep the traceback.
            set_status(exits.BUG.status, f"{type(e).__name__}: {e}")
            note_end(exits.BUG.status, exits.BUG.label, f"{type(e).__name__}: {e} (a bug; the traceback is above)",
                     exits.BUG.code)
            raise
        if isinstance(e, NonFiniteError):
            record_event({"event": "nonfinite", "step": None if e.step is None else e.step + 1, "message": str(e)})
        raise _fail(end.status, end.label, exits.message(e), e.code if end.code is None else end.code) from None
    finally:
        for timer in _again:  # none may fire once the handlers are restored
            timer.cancel()
            timer.join()
        _again.clear()
        for s, handler in previous.items():
            signal.signal(s, handler)
        _signalled = None
        forget_current()
    end_rank()  # a rank of a multi-process run that succeeded: no interpreter teardown to abort in


def _say_final(path) -> None:
    from exactrl.distributed.launch import is_main

    if is_main():
        console.print(f"final model: {path}")


def _stdout_console() -> Console:
    # Off a terminal rich assumes 80 columns and wraps tables; a log file has no width.
    return Console() if sys.stdout.isatty() else Console(width=160)


def _version(value: bool) -> None:
    if value:
        from exactrl import __version__

        print(f"exactrl {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")):
    """exactrl: LLM post-training where every optimizer step applies exactly the gradient asked for."""


@app.command()
def sft(config: Path | None = ConfigOpt, overrides: list[str] | None = OverridesArg):
    """Supervised fine-tuning (prompt/completion or chat messages JSONL)."""
    from exactrl.algorithms.sft import train_sft

    _run("sft", config, overrides, lambda cfg: _say_final(train_sft(cfg).final_model))


@app.command()
def kd(config: Path | None = ConfigOpt, overrides: list[str] | None = OverridesArg):
    """Knowledge distillation on SFT data: NLL mixed with a divergence to a frozen teacher, exact per token."""
    from exactrl.algorithms.kd import train_kd

    _run("kd", config, overrides, lambda cfg: _say_final(train_kd(cfg).final_model))


def _rl_help() -> tuple[str, str]:
    """The rl command's one-line help and its table of algo.name's choices, from the methods' rows."""
    families = {}
    for m in METHODS.values():
        families.setdefault(m.family, []).append(m.name)
    short = "RL from verifiable rewards: " + "; ".join(
        ("" if family == "policy-gradient" else family + " ") + ", ".join(names) for family, names in families.items())
    width = max(map(len, METHODS)) + 2
    table = "\n".join(f"{m.name:<{width}}{m.summary} ({m.short_paper})" for m in METHODS.values())
    return short + ".", f'RL from verifiable rewards. algo.name (docs/algorithms/<family>.md):\n\n\b\n{table}'


RL_SHORT_HELP, RL_HELP = _rl_help()


@app.command()
def dpo(config: Path | None = ConfigOpt, overrides: list[str] | None = OverridesArg):
    """Preference pairs {prompt, chosen, rejected}: dpo, robust, ipo, simpo, orpo, exact per pair."""
    from exactrl.algorithms.dpo import train_dpo

    _run("dpo", config, overrides, lambda cfg: _say_final(train_dpo(cfg).final_model))


@app.command()
def kto(config: Path | None = ConfigOpt, overrides: list[str] | None = OverridesArg):
    """Unpaired rows {prompt, completion, label}: KTO, its reference point z over each whole step."""
    from exactrl.algorithms.kto import train_kto

    _run("kto", config, overrides, lambda cfg: _say_final(train_kto(cfg).final_model))


@app.command()
def rm(config: Path | None = ConfigOpt, overrides: list[str] | None = OverridesArg):
    """A reward model: Bradley-Terry on preference pairs, or (rm.kind=process) per step; exact per pair/step."""
    from exactrl.algorithms.rm import train_rm

    _run("rm", config, overrides, lambda cfg: _say_final(train_rm(cfg).final_model))


@app.command(short_help=RL_SHORT_HELP, help=RL_HELP)
def rl(config: Path | None = ConfigOpt, overrides: list[str] | None = OverridesArg):
    from exactrl.algorithms.rl import train_rl
    from exactrl.tasks.builtin import BuiltinSpec

    _run("rl", config, overrides, lambda cfg: _say_final(train_rl(cfg, spec=BuiltinSpec(**cfg.task.model_dump()))
                                                         .final_model))


@app.command()
def demo(config: Path | None = ConfigOpt, overrides: list[str] | None = DemoOverridesArg):
    """Built-in task, tiny model: accuracy before, after SFT and after SFT -> GRPO."""
    from exactrl.pipelines.demo import run_demo

    _run("demo", config, overrides, lambda cfg: run_demo(cfg, _stdout_console()))


@app.command()
def pipeline(config: Path | None = ConfigOpt, overrides: list[str] | None = PipelineOverridesArg):
    """SFT, then RL (any algo.name) from the SFT model: accuracy before and after each phase, FLOPs, one summary.

    \b
    e.g. exactrl pipeline --config examples/pipeline_tiny.yaml
         exactrl pipeline --config my.yaml truncate.rollouts=50 truncate.lr=5e-6   (truncated SFT-then-RL)
         exactrl pipeline --config my.yaml output_dir=runs/p resume=true           (continue it)
    """
    from exactrl.pipelines.pipeline import run_pipeline

    _run("pipeline", config, overrides, lambda cfg: run_pipeline(cfg, _stdout_console()))


BugsOpt = typer.Option("--with-bugs", help="Also run the grid with the bugs.grids faults on and print both tables "
                                          "side by side.")


@app.command()
def study(config: Path | None = ConfigOpt, overrides: list[str] | None = OverridesArg,
          with_bugs: Annotated[bool, BugsOpt] = False):
    """The seed paper's comparison: methods x seeds at equal data, accuracy [95% CI], FLOPs, wall time, report.md.

    \b
    e.g. exactrl study                                  (the default grid on the built-in task)
         exactrl study seeds=[0,1,2] --with-bugs
         exactrl study output_dir=runs/study-X          (continue: finished cells are not re-run)
    """
    from exactrl.pipelines.study import run_study

    _run("study", config, overrides, lambda cfg: run_study(cfg, _stdout_console(), with_bugs))


@app.command("eval")
def evaluate(config: Path | None = ConfigOpt, overrides: list[str] | None = OverridesArg):
    """Evaluate a model directory on an eval set with a reward: greedy accuracy [95% CI], pass@k, a report.

    \b
    e.g. exactrl eval model.path=runs/X/final                         (built-in problems and checker)
         exactrl eval model.path=DIR data.eval=test.jsonl eval.reward_fn=exactrl.rewards.mathverify:reward
                      pass_at_k.n=16 pass_at_k.k=[1,4,16] pass_at_k.temperature=0.7
         exactrl eval task.name=calculator model.path=builtin-sft env.tools=exactrl.tasks.calculator_tools
                      eval.max_new_tokens=96                  (greedy episodes with a tool: accuracy, tool-call rate)
    """
    from exactrl.pipelines.evaluate import run_eval

    _run("eval", config, overrides, lambda cfg: run_eval(cfg, _stdout_console()))


@app.command()
def merge(adapter: Annotated[Path, typer.Argument(help="A LoRA run's final/ or checkpoint-N/ (adapter_config.json, "
                                                      "adapter_model.safetensors).")],
          output: Annotated[Path,
                            typer.Argument(help="Directory to write the merged model to (must not exist, or be "
                                                "empty).")],
          base: Annotated[Path | None, typer.Option("--base",
                                                    help="The base model directory (default: the one the adapter's "
                                                                   "adapter_config.json records).")] = None):
    """Merge a LoRA adapter into its base model: a Hugging Face model directory that loads without peft."""
    from exactrl.models.loading import ModelLoadError
    from exactrl.models.lora import merge_adapter

    _quiet_libraries()
    try:
        path = merge_adapter(adapter, output, base)
    except (ConfigError, ModelLoadError) as e:
        console.print(f"[bold red]error:[/bold red] {escape(str(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    except OSError as e:  # a full disk, a directory that cannot be written
        where = f" '{e.filename}'" if e.filename else ""
        console.print("[bold red]error:[/bold red] "
                      f"{escape(f'{e.strerror or e}{where}')}; free space or fix the "
                      "permissions, then run again", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    console.print(f"merged model: {path}", highlight=False, soft_wrap=True)


app.add_typer(audit_app, name="audit")


@app.command("config")
def show_config(command: Annotated[str, typer.Argument(help=", ".join(COMMANDS) + "; or check, "
                                                           "or docs")],
                file: Annotated[Path | None, typer.Argument(help="check: the config file")] = None,
                overrides: list[str] | None = OverridesArg,
                as_command: Annotated[str | None, typer.Option("--command", help="check: the file's command "
                                                                                 "(default: detected)")] = None,
                params: Annotated[float | None, typer.Option(help="check: N (default: a local model's)")] = None,
                tokens_per_sample: Annotated[float | None, typer.Option(help="check: D per trained sequence "
                                                                             "(default: local data's)")] = None,
                rollout_tokens: Annotated[float | None, typer.Option(help="check: D per RL rollout")] = None,
                data_rows: Annotated[int | None, typer.Option(help="check: rows of absent data")] = None,
                teacher_params: Annotated[float | None, typer.Option(help="check: kd's teacher's N (default: a "
                                                                          "local teacher's)")] = None,
                out: Annotated[Path, typer.Option(help="docs: the folder to write into")] = Path("docs"),
                check_docs: Annotated[bool, typer.Option("--check", help="docs: write nothing; exit 1 if the "
                                                                         "committed pages differ")] = False):
    """Print every key of a command's config with its default and meaning; or, as `exactrl config check FILE`,
    validate a config without running it and print its plan (steps, samples, tokens per step, FLOPs); or, as
    `exactrl config docs`, write docs/configuration.md and docs/exit-codes.md from the schema and exits table."""
    if command == "docs":
        from exactrl.config.reference import write_docs

        code, line = write_docs(generated_pages(), out, check_docs)
        console.print(line, highlight=False, soft_wrap=True)
        raise typer.Exit(code)
    if command == "check":
        from exactrl.pipelines.plan import Options, run_check

        _quiet_libraries()
        raise typer.Exit(run_check(file, as_command, overrides or [], Options(params, tokens_per_sample,
                                                                              rollout_tokens, data_rows,
                                                                              teacher_params), COMMANDS))
    if command not in COMMANDS:
        console.print(f"[bold red]error:[/bold red] unknown command '{command}'; choose {', '.join(COMMANDS)} "
                      "(or check FILE, or docs)")
        raise typer.Exit(2)
    for line in describe_keys(COMMANDS[command]):
        print(line)


def generated_pages() -> dict[str, str]:
    """The docs/ pages `exactrl config docs` writes: the configuration reference and the exit codes."""
    from exactrl.config.reference import CONFIGURATION, render

    return {CONFIGURATION: render(COMMANDS), "exit-codes.md": exits.render()}


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
