"""`exactrl audit stack` and `exactrl audit run`: the command-line face of the installed-stack
probe (stack.py) and of the audit of past runs (runs.py), added to the CLI by exactrl/cli.py."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

audit_app = typer.Typer(no_args_is_help=True, help="Was my stack, or my past run, hit by a known silent gradient bug?")


class StackProgress:
    """What `audit stack` shows while it runs, per world size: the processes' start and DeepSpeed's set-up as
    lines of their own -- the first set-up on a machine compiles DeepSpeed's CPU communication op, 1-2 min on 2
    cores, which an ETA drawn from the rows would spread over them (a new user saw "ETA 2454 s" for a run of 109 s)
    -- then a bar over the rows alone. Keeps each stage's seconds (``seconds``) for the summary."""

    def __init__(self, versions: dict, show: bool):
        from exactrl.progress import progress

        self.progress, self.versions, self.show = progress, versions, show
        self.seconds: dict[int, dict[str, float]] = {}
        self.bar, self.total, self.done, self.t = None, 0, 0, 0.0

    def say(self, text: str) -> None:
        if self.show:
            print(f"audit stack: {text}", file=sys.stderr, flush=True)

    def lap(self, world: int, stage: str) -> None:
        now = time.perf_counter()
        self.seconds.setdefault(world, {})[stage] = round(now - self.t, 1)
        self.t = now

    def __call__(self, kind: str, world: int, data) -> None:
        if kind == "start":
            self.total, self.done, self.t = data, 0, time.perf_counter()
            self.say(f"world size {world}: starting {world} process{'es' * (world > 1)} (imports, process group)")
        elif kind == "deepspeed":
            self.lap(world, "start")
            if not data["cached"]:
                self.say(f"DeepSpeed {self.versions.get('deepspeed')} compiles its CPU communication op on first use "
                         f"(1-2 min on 2 cores, once: cached in {data['dir']}); the configurations follow")
        elif kind == "ready":
            self.lap(world, "deepspeed" if "start" in self.seconds.get(world, {}) else "start")
            self.bar = self.progress(self.total, f"audit stack, world {world}", enabled=self.show, unit="config")
        elif kind == "row":
            if self.bar is None:  # the process died before its rows: they come as errors at once
                self.bar = self.progress(self.total, f"audit stack, world {world}", enabled=self.show, unit="config")
            self.bar.update(1)
            self.done += 1
            if self.done == self.total:
                self.bar.close()
                self.bar = None
                self.lap(world, "rows")

    def summary(self) -> str:
        names = {"start": "start-up", "deepspeed": "DeepSpeed set-up", "rows": "configurations"}
        return "; ".join(f"world {w}: " + ", ".join(f"{names[k]} {v:.0f} s" for k, v in s.items())
                         for w, s in self.seconds.items())


@audit_app.command("stack")
def audit_stack_cmd(as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
                    python: str | None = typer.Option(None,
                                                         help="Audit another environment's python (default: this "
                                                              "one)."),
                    world: list[int] = typer.Option([1, 2], help="World sizes to test.")):
    """Tiny real runs of every backend configuration; EXACT / BROKEN / ERROR per row. Exit 1 unless all exact."""
    import json

    from exactrl.audit import stack

    shown = StackProgress(stack.probe_versions(python or sys.executable), show=not as_json)
    versions, rows = stack.audit_stack(python, tuple(world), on_event=shown)
    if as_json:
        print(json.dumps({**stack.to_json(versions, rows), "seconds": shown.seconds}, indent=2))
    else:
        out = Console(width=120)
        out.print(stack.table(versions, rows))
        for note in sorted({r.known_bug for r in rows if r.known_bug}):
            out.print(f"[bold red]known bug:[/] {escape(note)}", soft_wrap=True)
        broken = sum(r.verdict != "EXACT" for r in rows)
        out.print("all configurations EXACT" if not broken else f"{broken} configuration(s) not exact", soft_wrap=True)
        out.print(f"time: {shown.summary()}", soft_wrap=True, highlight=False)
    raise typer.Exit(stack.exit_code(rows))


@audit_app.command("run")
def audit_run_cmd(paths: list[Path] = typer.Argument(...,
                                                     help="Run directories or files (configs, launch scripts, pip "
                                                          "freeze...)."),
                  as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")):
    """Read what past runs left behind; AFFECTED / NOT AFFECTED / CONDITIONAL / UNKNOWN per known bug.

    Nothing is run or unpickled. CONDITIONAL: AFFECTED only under a condition the files leave open
    (e.g. "run on <= 21 GPUs").

    Exit codes: 0: every verdict NOT AFFECTED. 1: some verdict AFFECTED. 2: none AFFECTED, some
    UNKNOWN or CONDITIONAL (the files leave the answer open).
    """
    import json

    from exactrl.audit import report, runs

    audits = runs.audit_runs(paths)
    if as_json:
        print(json.dumps(report.to_json(audits), indent=2))
    else:
        Console(width=120).print(report.format_table(audits))
    raise typer.Exit(report.exit_code(audits))
