"""`exactrl audit stack`: is the installed training stack exact? Tiny real runs, no model.

For each backend the environment has (plain torch accumulation, FSDP2, DeepSpeed ZeRO 1-3
with offload_optimizer none/cpu), K in {1, 3, 4} and world size 1 and 2, one optimizer step
of a small MLP is compared with plain torch SGD on the full batch (exactrl/audit/stack_worker.py,
which imports only torch and DeepSpeed, so ``--python`` can audit another environment). A
configuration is EXACT within 1e-5, BROKEN beyond, ERROR when the stack cannot run it (its
exception's last line is shown and the audit goes on). BROKEN rows that match a known bug
(exactrl/audit/rules.py) get its explanation and fix.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from packaging.version import Version
from rich.table import Table

from exactrl.audit.rules import Status, deepspeed_offload

TOL = 1e-5
KS = (1, 3, 4)
ROOT = Path(__file__).resolve().parents[2]
FIX = "upgrade to deepspeed>=0.19.0, or set K<=2, or disable offload_optimizer"


@dataclass
class StackRow:
    backend: str
    world: int
    k: int
    stage: int | None = None
    offload: str | None = None
    rel_err: float | None = None
    error: str | None = None
    known_bug: str | None = None

    @property
    def verdict(self) -> str:
        if self.error is not None:
            return "ERROR"
        return "EXACT" if self.rel_err <= TOL else "BROKEN"

    def label(self) -> str:
        if self.backend == "deepspeed":
            return f"deepspeed ZeRO-{self.stage} offload={self.offload}"
        return self.backend


def probe_versions(python: str) -> dict[str, str | None]:
    code = ("import json, importlib.metadata as m\nout = {}\nfor p in ('torch', 'deepspeed'):\n"
            "    try: out[p] = m.version(p)\n    except m.PackageNotFoundError: out[p] = None\nprint(json.dumps(out))")
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    if proc.returncode:
        raise RuntimeError(f"cannot run {python}: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout)


def configurations(versions: dict) -> list[dict]:
    out = [{"backend": "torch", "k": k} for k in KS] + [{"backend": "fsdp2", "k": k} for k in KS]
    if versions.get("deepspeed"):
        out += [{"backend": "deepspeed", "stage": s, "offload": o, "k": k} for s in (1, 2, 3) for o in ("none", "cpu")
                for k in KS]
    return out


def torch_extensions_dir(deepspeed_version: str | None) -> str:
    """Where DeepSpeed's JIT-compiled ops are cached: $TORCH_EXTENSIONS_DIR if set, else one
    directory per DeepSpeed version (two versions sharing one rebuild each other's ops)."""
    from exactrl.tasks.builtin import cache_dir

    default = cache_dir() / "torch_extensions" / f"deepspeed-{deepspeed_version}"
    return os.environ.get("TORCH_EXTENSIONS_DIR") or str(default)


def exactrl_only_path() -> str:
    """A directory holding just this exactrl package (a symlink), for the audited python's
    PYTHONPATH: putting the directory exactrl is installed in there instead would, for a
    non-editable install, shadow the audited environment's torch and DeepSpeed with ours."""
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="exactrl-audit-"))
    (d / "exactrl").symlink_to(ROOT / "exactrl", target_is_directory=True)
    return str(d)


def _run_world(python: str, world: int, configs: list[dict], on_row, timeout: float, versions: dict,
               path: str) -> list[StackRow]:
    env = {**os.environ, "PYTHONPATH": f"{path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "TORCH_EXTENSIONS_DIR": torch_extensions_dir(versions.get("deepspeed"))}
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"] if world > 1 else []
    cmd = [python, *launcher, "-m", "exactrl.audit.stack_worker", json.dumps(configs)]
    rows: list[StackRow] = []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        err += f"\ntimed out after {timeout:.0f} s"
    for line in out.splitlines():
        if line.startswith("AUDIT "):
            data = json.loads(line[6:])
            rows.append(StackRow(data["backend"], world, data["k"], data.get("stage"), data.get("offload"),
                                 data.get("rel_err"), data.get("error")))
            on_row()
    last = next((ln for ln in reversed(err.strip().splitlines()) if ln.strip()), "no output")
    for c in configs[len(rows):]:  # the process died before reaching these
        rows.append(StackRow(c["backend"], world, c["k"], c.get("stage"), c.get("offload"),
                             error=f"process died: {last[-200:]}"))
        on_row()
    return rows


def explain(row: StackRow, versions: dict) -> str | None:
    if row.backend != "deepspeed" or row.verdict != "BROKEN" or not versions.get("deepspeed"):
        return None
    facts = {"uses_deepspeed": True, "zero_stage": row.stage, "offload_optimizer": row.offload, "effective_k": row.k,
             "version:deepspeed": Version(versions["deepspeed"].split("+")[0])}
    outcome = deepspeed_offload(facts)
    if outcome.status != Status.AFFECTED:
        return None
    return (f"DeepSpeed {versions['deepspeed']} drops intermediate micro-batches with a CPU-offloaded optimizer and "
            f"K>=3 (introduced by PR #6550 in 0.15.2, fixed in 0.19.0 by PR #7967): {FIX}")


def audit_stack(python: str | None = None, worlds=(1, 2), progress=None, timeout: float = 600) -> tuple[dict, list[
    StackRow]]:
    python = python or sys.executable
    versions = probe_versions(python)
    configs = configurations(versions)
    rows: list[StackRow] = []
    path = exactrl_only_path()
    try:
        for world in worlds:
            rows += _run_world(python, world, configs, progress or (lambda: None), timeout, versions, path)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    for row in rows:
        row.known_bug = explain(row, versions)
    return versions, rows


def table(versions: dict, rows: list[StackRow]) -> Table:
    t = Table(title=f"exactrl audit stack: torch {versions.get('torch')}, deepspeed "
                    f"{versions.get('deepspeed') or 'not installed'}")
    for col in ("configuration", "world", "K", "max rel. error", "verdict"):
        t.add_column(col)
    style = {"EXACT": "green", "BROKEN": "bold red", "ERROR": "yellow"}
    for r in rows:
        err = f"{r.rel_err:.1e}" if r.rel_err is not None else (r.error or "")[-90:]
        t.add_row(r.label(), str(r.world), str(r.k), err, f"[{style[r.verdict]}]{r.verdict}[/]")
    return t


def to_json(versions: dict, rows: list[StackRow]) -> dict:
    return {"versions": versions, "tolerance": TOL,
            "rows": [{**asdict(r), "verdict": r.verdict, "configuration": r.label()} for r in rows],
            "all_exact": all(r.verdict == "EXACT" for r in rows)}


def exit_code(rows: list[StackRow]) -> int:
    return 0 if all(r.verdict == "EXACT" for r in rows) else 1
