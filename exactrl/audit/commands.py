"""`exactrl audit stack` and `exactrl audit run`: the command-line face of the installed-stack
probe (stack.py) and of the audit of past runs (runs.py), added to the CLI by exactrl/cli.py."""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

audit_app = typer.Typer(no_args_is_help=True, help="Was my stack, or my past run, hit by a known silent gradient bug?")


@audit_app.command("stack")
def audit_stack_cmd(as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
                    python: str | None = typer.Option(None,
                                                         help="Audit another environment's python (default: this "
                                                              "one)."),
                    world: list[int] = typer.Option([1, 2], help="World sizes to test.")):
    """Tiny real runs of every backend configuration; EXACT / BROKEN / ERROR per row. Exit 1 unless all exact."""
    import json

    from exactrl.audit import stack
    from exactrl.progress import progress

    versions = stack.probe_versions(python or sys.executable)
    bar = progress(len(stack.configurations(versions)) * len(world), "audit stack", enabled=not as_json, unit="config")
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
