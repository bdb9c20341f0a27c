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
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
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


def shm_op_cached(extensions_dir: str) -> bool:
    """Whether DeepSpeed's shared-memory op is already compiled in ``extensions_dir`` (torch's JIT extension
    layout: NAME/NAME.so), i.e. whether the first DeepSpeed set-up loads it in seconds or compiles it."""
    return (Path(extensions_dir) / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").is_file()


def _run_world(python: str, world: int, configs: list[dict], on_event, timeout: float, versions: dict,
               path: str) -> list[StackRow]:
    """One process group running every configuration; rows as they arrive, and the stages before them, go to
    ``on_event(kind, world, data)``: "deepspeed" (its set-up starts; data: whether its op is cached, where),
    "ready" (the rows start), "row" (data: the StackRow)."""
    extensions = torch_extensions_dir(versions.get("deepspeed"))
    env = {**os.environ, "PYTHONPATH": f"{path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "TORCH_EXTENSIONS_DIR": extensions}
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"] if world > 1 else []
    cmd = [python, *launcher, "-m", "exactrl.audit.stack_worker", json.dumps(configs)]
    rows: list[StackRow] = []
    with tempfile.TemporaryFile("w+") as err:  # a file, not a pipe: DeepSpeed's logs could fill a pipe and block
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        lines: queue.Queue = queue.Queue()

        def read() -> None:  # in a thread, so a process that hangs cannot outlast the timeout
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=read, daemon=True).start()
        deadline, note = time.monotonic() + timeout, ""
        while True:
            try:
                line = lines.get(timeout=max(deadline - time.monotonic(), 0))
            except queue.Empty:
                proc.kill()
                note = f"timed out after {timeout:.0f} s"
                break
            if line is None:
                break
            if line.startswith("AUDIT-STAGE deepspeed"):
                on_event("deepspeed", world, {"cached": shm_op_cached(extensions), "dir": extensions})
            elif line.startswith("AUDIT-READY"):
                on_event("ready", world, None)
            elif line.startswith("AUDIT "):
                data = json.loads(line[6:])
                rows.append(StackRow(data["backend"], world, data["k"], data.get("stage"), data.get("offload"),
                                     data.get("rel_err"), data.get("error")))
                on_event("row", world, rows[-1])
        proc.wait()
        err.seek(0)
        last = next((ln for ln in reversed(err.read().strip().splitlines()) if ln.strip()), "no output")
    for c in configs[len(rows):]:  # the process died (or was stopped) before reaching these
        rows.append(StackRow(c["backend"], world, c["k"], c.get("stage"), c.get("offload"),
                             error=f"process died: {note or last[-200:]}"))
        on_event("row", world, rows[-1])
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


def audit_stack(python: str | None = None, worlds=(1, 2), on_event=None, timeout: float = 600) -> tuple[dict, list[
    StackRow]]:
    """Every configuration at every world size; ``on_event(kind, world, data)`` hears each world's stages and
    rows as they happen ("start", then as _run_world says)."""
    python = python or sys.executable
    versions = probe_versions(python)
    configs = configurations(versions)
    rows: list[StackRow] = []
    path = exactrl_only_path()
    on_event = on_event or (lambda kind, world, data: None)
    try:
        for world in worlds:
            on_event("start", world, len(configs))
            rows += _run_world(python, world, configs, on_event, timeout, versions, path)
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
