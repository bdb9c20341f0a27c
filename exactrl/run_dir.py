"""Run directories: ``runs/<name>/`` with the resolved config and a status file saying how the
run ended, never overwriting a past run.

A directory is claimed atomically (``status.json`` created with O_EXCL), so two processes can
never share one. ``status.json`` holds ``state``: running, success, error, interrupted
(SIGINT/SIGTERM), canary or nonfinite, with the message. A directory whose run failed before
it saved or logged anything (only config.yaml, manifest.json, status.json and an empty
metrics.jsonl) is taken over by the next run with the same output_dir. A run that continues
itself (train.resume_from=latest) takes over its own ended directory whole, checkpoints and
metrics kept, unless it holds final/ (the run is done).

Under exactrl's own launcher (``distributed.nproc_per_node`` > 1, exactrl/distributed/launch.py)
the ranks also leave notes in the launcher's directory (``EXACTRL_LAUNCH_DIR``): the run directory
rank 0 created, and how each rank ended. The launcher prints the one line and, when rank 0 could
not (killed, or stopped by a peer's failure), records the end in status.json itself.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

import yaml

from exactrl.config.loader import ConfigError, dump_config

STATUS = "status.json"
MANIFEST_LOCK = ".manifest.json.lock"  # held while manifest.json is updated (exactrl/audit/manifest.py)
FAILED_STATES = ("error", "interrupted", "canary", "check", "nonfinite")
# What a run leaves before its first saved or logged result; nothing in them is lost by reuse.
SCAFFOLD = {STATUS, "config.yaml", ".config.yaml.tmp", "manifest.json", MANIFEST_LOCK, "metrics.jsonl",
            f".{STATUS}.tmp"}

_current: Path | None = None  # the run directory this process created (its status is ours to write)
LAUNCH_DIR = "EXACTRL_LAUNCH_DIR"


def read_status(path: Path) -> dict | None:
    try:
        return json.loads((Path(path) / STATUS).read_text())
    except (OSError, ValueError):
        return None


def _alive(status: dict) -> bool:
    """Whether the process that wrote a 'running' status still runs (unknowable on another host)."""
    if status.get("host") != socket.gethostname():
        return True
    try:
        os.kill(int(status.get("pid", 0)), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, OverflowError):
        pass
    return True


def _reusable(path: Path, status: dict | None) -> bool:
    if status is None:
        return False
    ended = _ended(status)
    names = {p.name for p in path.iterdir()}
    metrics = path / "metrics.jsonl"
    return ended and names <= SCAFFOLD and (not metrics.exists() or metrics.stat().st_size == 0)


def _ended(status: dict) -> bool:
    return status.get("state") in FAILED_STATES or (status.get("state") == "running" and not _alive(status))


def _continuable(path: Path, status: dict | None) -> bool:
    """An ended run without final/, or a finished study (it writes none: more cells can join it)."""
    if status is None or (path / "final").exists():
        return False
    return _ended(status) or (status.get("state") == "success" and status.get("command") == "study")


def finished(path: Path) -> str | None:
    """Why the run in ``path`` cannot be continued (train.resume_from=latest, a pipeline's resume=true): it has
    written final/ and ended; None otherwise."""
    status = read_status(path)
    if status is None or not (path / "final").exists() or not (status.get("state") == "success" or _ended(status)):
        return None
    return (f"output_dir '{path}' holds a run that has written final/ (it ended '{status.get('state')}'): nothing is "
            "left to resume; choose another output_dir")


def _refusal(path: Path, status: dict | None) -> str:
    if status is None:
        how = ("no status.json: a run from before exactrl wrote one, or not a run; "
               "delete it if it holds nothing you need")
    elif status.get("state") == "running" and _alive(status):
        how = f"its run is still going (pid {status.get('pid')} on {status.get('host')})"
    else:
        how = f"its run ended '{status.get('state')}'" + (f": {status['message']}" if status.get("message") else "")
    return f"output_dir '{path}' already holds a run ({how}); choose another output_dir (nothing was overwritten)"


def _claim(path: Path, continues: bool = False) -> bool:
    """Create status.json exclusively; take over a failed, empty attempt (or, ``continues``, the
    ended run itself) by renaming its status away first. The whole read-judge-rename-create runs
    under an exclusive lock on the directory: without it a second claimant that had read the old
    status could rename the winner's new one away and win too (flock is released when its holder
    exits, so a killed claimant leaves no stale lock). Returns whether an earlier attempt's files
    were kept."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return _claim_locked(path, continues)
    finally:
        os.close(fd)


def _claim_locked(path: Path, continues: bool) -> bool:
    kept = False
    if any(path.iterdir()):
        status = read_status(path)
        kept = continues and _continuable(path, status)
        if not kept and not _reusable(path, status):
            raise ConfigError((continues and finished(path)) or _refusal(path, status))
        try:
            os.replace(path / STATUS, path / f".{STATUS}.tmp")
        except FileNotFoundError:
            raise ConfigError(_refusal(path, None)) from None
        for name in () if kept else SCAFFOLD:
            (path / name).unlink(missing_ok=True)
    try:
        fd = os.open(path / STATUS, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        raise ConfigError(_refusal(path, read_status(path))) from None
    os.close(fd)
    return kept


def create_run_dir(template: str, command: str, cfg, continues: bool = False) -> Path:
    """Claim the run directory ``template`` names. ``continues``: this launch continues the run
    already there (train.resume_from=latest, resolved in cfg)."""
    global _current
    path = Path(template.format(command=command, time=time.strftime("%Y%m%d-%H%M%S")))
    try:
        path.mkdir(parents=True, exist_ok=True)
        kept = _claim(path, continues)
    except (FileExistsError, NotADirectoryError):
        raise ConfigError(f"output_dir '{path}': it (or a parent) is a file, not a directory; "
                          "choose another output_dir") from None
    except OSError as e:
        raise ConfigError(f"output_dir '{path}': cannot create the run directory ({e.strerror}); "
                          "choose another output_dir") from None
    _current = path
    note("run_dir", {"path": str(path.resolve())})
    set_status("running", command=command)
    if kept:  # the records after this one redo the steps after the checkpoint (or all, from none)
        # a pipeline or a study (no train section) continues each phase or cell on its own
        record_event({"event": "continued", "resume_from": getattr(getattr(cfg, "train", None), "resume_from", None)})
    tmp = path / ".config.yaml.tmp"  # a crash mid-write leaves no half config.yaml
    dump_config(cfg, tmp)
    os.replace(tmp, path / "config.yaml")
    return path


def set_status(state: str, message: str | None = None, **fields) -> None:
    """Record this process's run state in its run directory (if it created one), atomically.
    Never raises: on a full disk the run's own error is the one to report."""
    if _current is None:
        return
    old = read_status(_current) or {}
    now = time.strftime("%Y-%m-%dT%H:%M:%S")
    status = {**old, **fields, "state": state, "message": message, "pid": os.getpid(), "host": socket.gethostname(),
              "started": old.get("started", now), "updated": now}
    tmp = _current / f".{STATUS}.tmp"
    try:
        tmp.write_text(json.dumps(status, indent=2) + "\n")
        os.replace(tmp, _current / STATUS)
    except OSError:
        pass


def record_event(record: dict) -> None:
    """Append a record to this process's run's metrics.jsonl (how a run stopped, next to its steps)."""
    if _current is None:
        return
    try:
        with open(_current / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"time": round(time.time(), 3), **record}) + "\n")
    except OSError:
        pass


def forget_current() -> None:
    """After a run has recorded its end (tests run several in one process)."""
    global _current
    _current = None


def note(name: str, record: dict) -> bool:
    """Leave ``record`` for exactrl's launcher, if this process runs under it (atomically)."""
    where = os.environ.get(LAUNCH_DIR)
    if not where:
        return False
    tmp = Path(where) / f".{name}.tmp"
    try:
        tmp.write_text(json.dumps(record))
        os.replace(tmp, Path(where) / name)
    except OSError:
        return False
    return True


def note_end(state: str, label: str, message: str, code: int) -> bool:
    """Tell the launcher how this rank ended; False when there is no launcher to tell (print it then)."""
    rank = os.environ.get("RANK", "0")
    return note(f"end-rank{rank}.json", {"rank": int(rank), "state": state, "label": label, "message": message,
                                          "code": code, "time": time.time()})


def launch_notes(where: Path) -> tuple[Path | None, list[dict]]:
    """What the ranks left in the launcher's directory: the run directory (None before rank 0 made
    one) and each rank's end, first first."""
    try:
        run_dir = Path(json.loads((where / "run_dir").read_text())["path"])
    except (OSError, ValueError, KeyError):
        run_dir = None
    ends = []
    for f in where.glob("end-*.json"):
        try:
            ends.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            pass
    return run_dir, sorted(ends, key=lambda e: e["time"])


def adopt(path: Path) -> None:
    """Make ``path`` this process's run directory, its status ours to write, unless its run succeeded:
    the launcher records the end of the whole run, which rank 0 may not have known (killed, or
    stopped by a peer's failure) or not recorded."""
    global _current
    if (read_status(path) or {}).get("state") != "success":
        _current = path


def replay_overrides(config: Path | None, overrides: list[str], console) -> list[str]:
    """Replaying ``--config runs/X/config.yaml`` of a run with an explicit output_dir would
    collide with that run: unless output_dir is given, the replay goes next to it."""
    if config is None or config.name != "config.yaml" or any(o.startswith("output_dir=") for o in overrides):
        return overrides
    try:
        saved = yaml.safe_load(config.read_text()) or {}
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return overrides  # load_config reports it
    out = saved.get("output_dir") if isinstance(saved, dict) else None
    if not isinstance(out, str) or "{time}" in out or Path(out).resolve() != config.parent.resolve():
        return overrides
    console.print(f"replaying {config}: output_dir '{out}' holds that run, so this one writes to "
                  f"'{out}-replay-{{time}}'", highlight=False, soft_wrap=True)
    return [*overrides, f"output_dir={out}-replay-{{time}}"]
