"""A child Python for the user's code: rewards (rewards/worker.py) and environments (envs/process.py).

The user's code may hang, call ``sys.exit``, crash the interpreter, or need the main thread (math-verify times
its parsing with ``signal.alarm``). So it is imported and called in a child Python, in its main thread, over a
socket pair. A plain subprocess, not multiprocessing's spawn: that re-runs the user's main script in the child
and cannot start from stdin or a notebook; not a fork, which would copy the trainer's threads, CUDA state and
memory. The child takes this process's import path (the user's module is found where this process would find
it) and exits by itself when the parent goes away, even in the middle of a call (its parent changes), so no
run leaves one behind.
"""

from __future__ import annotations

import importlib
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection


def import_attr(spec: str, what: str, form: str, example: str):
    """``module:name`` imported, as (object, None), or (None, a one-line error naming ``what`` and ``spec``);
    ``form`` and ``example`` show how to write it (module:function, my_rewards:exact_match)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        return None, f"{what} '{spec}' must be written {form}, e.g. {example}"
    if module_name == "__main__":  # the child has a main module of its own
        return None, (f"{what} '{spec}': it runs in a process of its own, so it must live in an importable module "
                      "(a .py file on the Python path), not in the main script")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        return None, f"{what} '{spec}': cannot import module '{module_name}' ({e})"
    except Exception as e:  # the module's own code failed while importing
        return None, f"{what} '{spec}': importing '{module_name}' raised {type(e).__name__}: {e}"
    obj = getattr(module, attr, None)
    if not callable(obj):
        return None, f"{what} '{spec}': module '{module_name}' has no callable '{attr}'"
    return obj, None


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


class Child:
    """A child Python running ``target(conn, *args)`` (``target`` a ``module:function`` that the child imports;
    it should import little: the child starts with nothing but the standard library). ``conn`` is this side's
    end of the socket pair; a request of None asks the target to return."""

    def __init__(self, target: str, args: tuple):
        mine, theirs = socket.socketpair()
        fd = theirs.fileno()
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where exactrl is importable from
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)}
        self.proc = subprocess.Popen([sys.executable, "-c", f"from exactrl.child import main; main({fd})"],
                                     pass_fds=[fd], stdin=subprocess.DEVNULL, env=env)
        theirs.close()
        self.conn = Connection(mine.detach())
        self._finalizer = weakref.finalize(self, _stop, self.proc, self.conn, 1.0)
        self.conn.send((sys.path, target, args))

    def stop(self, grace: float = 0.0) -> int | None:
        """Stop the child (killing it unless it returns within ``grace`` seconds) and wait for it: its exit code."""
        self._finalizer.detach()
        return _stop(self.proc, self.conn, grace)


def _exit_with(parent: int) -> None:
    """Exit as soon as ``parent`` is gone: a killed rank's child must not run on (an idle one also sees its
    socket close, one busy in the user's code would not)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def main(fd: int) -> None:
    """The child's entry point: take the parent's import path and the target, then run it."""
    threading.Thread(target=_exit_with, args=(os.getppid(),), daemon=True).start()
    conn = Connection(fd)
    sys.path[:], target, args = conn.recv()
    module, _, name = target.partition(":")
    getattr(importlib.import_module(module), name)(conn, *args)
