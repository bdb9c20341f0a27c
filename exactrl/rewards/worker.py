"""Python rewards run in a process of their own, started once per run (per rank).

A reward is the user's code: it may hang, call ``sys.exit``, crash the interpreter, or need
the main thread (math-verify times its parsing with ``signal.alarm``). So it is imported and
called in a child Python, in its main thread, one batch per request over a socket pair. A plain
subprocess, not multiprocessing's spawn: that re-runs the user's main script in the child and
cannot start from stdin or a notebook. The parent waits at most ``timeout`` seconds for a
batch; then, or when the child dies, the child is killed (a fresh one starts with the next
batch) and the caller decides: fallback or stop. The child also exits by itself when the parent
goes away, even in the middle of a batch (its parent changes), so no run leaves one behind.
"""

from __future__ import annotations

import importlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection

_READY_TIMEOUT = 300.0  # importing a reward module (sympy, a model) may be slow, but not endless


class WorkerTimeout(Exception):
    """The batch took longer than its time limit; the child was killed."""


class WorkerDied(Exception):
    """The child ended during the batch, or the reward called sys.exit."""


class WorkerRaised(Exception):
    """The reward raised; the message is the original 'Type: message'."""


def _import(spec: str):
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        return None, f"reward function '{spec}' must be written module:function, e.g. my_rewards:exact_match"
    if module_name == "__main__":  # the reward process has a main module of its own
        return None, (f"reward function '{spec}': rewards run in a process of their own, so the function must live in "
                      "an importable module (a .py file on the Python path), not in the main script")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        return None, f"reward function '{spec}': cannot import module '{module_name}' ({e})"
    except Exception as e:  # the module's own code failed while importing
        return None, f"reward function '{spec}': importing '{module_name}' raised {type(e).__name__}: {e}"
    fn = getattr(module, attr, None)
    if not callable(fn):
        return None, f"reward function '{spec}': module '{module_name}' has no callable '{attr}'"
    return fn, None


def _serve(conn, specs: list[str]) -> None:
    """The child: load every reward, report what each needs, then answer batches until told to stop.
    Replies are (kind, payload): "ok" with the values, "raised" with the exception's "Type: message",
    "exit" with the code the reward passed to sys.exit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the parent decides
    fns, needs = {}, {}
    for spec in specs:
        fn, error = _import(spec)
        if error:
            conn.send(("load_error", error))
            return
        fns[spec], needs[spec] = fn, bool(getattr(fn, "needs_answer", True))
    conn.send(("ready", needs))
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if request is None:
            return
        spec, prompts, completions, answers = request
        try:
            reply = ("ok", list(fns[spec](prompts, completions, answers)))
        except SystemExit as e:
            reply = ("exit", e.code)
        except Exception as e:
            reply = ("raised", f"{type(e).__name__}: {e}")
        try:
            conn.send(reply)
        except Exception as e:  # values that cannot be pickled
            conn.send(("raised", f"its result could not be sent back ({type(e).__name__}: {e})"))


def _stop(proc: subprocess.Popen, conn: Connection, grace: float) -> int | None:
    """Ask the child to stop (``grace`` seconds), then kill it; always wait for it, so no zombie
    is left. Also runs when the handle is collected and at interpreter exit (weakref.finalize)."""
    if grace > 0:
        try:
            conn.send(None)
            proc.wait(grace)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    conn.close()
    return proc.returncode


class RewardWorker:
    """The parent's handle on the child that holds ``specs``. ``needs_answer``: spec -> whether
    the function wants an answer per row (a function attribute ``needs_answer = False`` says no).
    Not thread-safe on its own; ``call`` holds a lock so a threaded server may share one."""

    def __init__(self, specs: list[str]):
        self.specs = list(specs)
        self._lock = threading.Lock()
        self._proc = self._conn = self._finalizer = None
        self.needs_answer: dict[str, bool] = {}
        self._start()

    def _start(self) -> None:
        mine, theirs = socket.socketpair()
        fd = theirs.fileno()
        # Not a fork: that would copy the trainer's threads, CUDA state and memory.
        # where exactrl is importable from
        here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)}
        proc = subprocess.Popen([sys.executable, "-c", f"from exactrl.rewards.worker import main; main({fd})"],
                                pass_fds=[fd],
                                stdin=subprocess.DEVNULL, env=env)
        theirs.close()
        parent = Connection(mine.detach())
        self._proc, self._conn = proc, parent
        self._finalizer = weakref.finalize(self, _stop, proc, parent, 1.0)
        parent.send((sys.path, self.specs))  # the reward module is found where this process would find it
        if not parent.poll(_READY_TIMEOUT):
            self._reap()
            raise RuntimeError(f"the reward process did not load {self.specs} within {_READY_TIMEOUT:g}s")
        try:
            kind, payload = parent.recv()
        except EOFError:
            code = self._reap()
            raise RuntimeError(f"the reward process ended (exit code {code}) while importing {self.specs}") from None
        if kind == "load_error":
            self._reap()
            raise ValueError(payload)
        self.needs_answer = payload

    def _reap(self, grace: float = 0.0) -> int | None:
        """Stop the child (killing it unless ``grace``) and wait for it."""
        if self._proc is None:
            return None
        self._finalizer.detach()
        code = _stop(self._proc, self._conn, grace)
        self._proc = self._conn = None
        return code

    def call(self, spec: str, prompts, completions, answers, timeout: float | None) -> list:
        with self._lock:
            if self._proc is None:
                self._start()
            try:
                self._conn.send((spec, prompts, completions, answers))
                ready = self._conn.poll(timeout)
                reply = self._conn.recv() if ready else None
            except (EOFError, OSError):  # a fresh child is started by the next call
                code = self._reap()
                raise WorkerDied(f"the reward process died (exit code {code}: a crash or os._exit in the "
                                 "reward)") from None
            if reply is None:
                self._reap()
                raise WorkerTimeout(f"no result within reward.timeout={timeout:g}s (the reward process was killed)")
        kind, payload = reply
        if kind == "ok":
            return payload
        if kind == "exit":
            raise WorkerDied(f"the reward called sys.exit({payload!r})")
        raise WorkerRaised(payload)

    def close(self) -> None:
        """Ask the child to stop; kill it if it does not within a second."""
        with self._lock:
            self._reap(grace=1.0)


def _exit_with(parent: int) -> None:
    """Exit as soon as ``parent`` is gone: a killed rank's reward process must not run on (an idle one
    also sees its socket close, one busy in a reward would not)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def main(fd: int) -> None:
    """The child's entry point: take this process's import path from the parent, then serve."""
    threading.Thread(target=_exit_with, args=(os.getppid(),), daemon=True).start()
    conn = Connection(fd)
    sys.path[:], specs = conn.recv()
    _serve(conn, specs)
