"""Python rewards run in a process of their own, started once per run (per rank).

A reward is the user's code: it may hang, call ``sys.exit``, crash the interpreter, or need the main thread
(math-verify times its parsing with ``signal.alarm``). So it is imported and called in a child Python
(exactrl/child.py), in its main thread, one batch per request. The parent waits at most ``timeout`` seconds for
a batch; then, or when the child dies, the child is killed (a fresh one starts with the next batch) and the
caller decides: fallback or stop.
"""

from __future__ import annotations

import signal
import threading

from exactrl.child import Child, import_attr

_READY_TIMEOUT = 300.0  # importing a reward module (sympy, a model) may be slow, but not endless


class WorkerTimeout(Exception):
    """The batch took longer than its time limit; the child was killed."""


class WorkerDied(Exception):
    """The child ended during the batch, or the reward called sys.exit."""


class WorkerRaised(Exception):
    """The reward raised; the message is the original 'Type: message'."""


def _import(spec: str):
    return import_attr(spec, "reward function", "module:function", "my_rewards:exact_match")


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


class RewardWorker:
    """The parent's handle on the child that holds ``specs``. ``needs_answer``: spec -> whether
    the function wants an answer per row (a function attribute ``needs_answer = False`` says no).
    Not thread-safe on its own; ``call`` holds a lock so a threaded server may share one."""

    def __init__(self, specs: list[str]):
        self.specs = list(specs)
        self._lock = threading.Lock()
        self._child = self._conn = None
        self.needs_answer: dict[str, bool] = {}
        self._start()

    def _start(self) -> None:
        self._child = child = Child("exactrl.rewards.worker:_serve", (self.specs,))
        if not child.conn.poll(_READY_TIMEOUT):
            self._reap()
            raise RuntimeError(f"the reward process did not load {self.specs} within {_READY_TIMEOUT:g}s")
        try:
            kind, payload = child.conn.recv()
        except EOFError:
            code = self._reap()
            raise RuntimeError(f"the reward process ended (exit code {code}) while importing {self.specs}") from None
        if kind == "load_error":
            self._reap()
            raise ValueError(payload)
        self._conn = child.conn
        self.needs_answer = payload

    @property
    def _proc(self):  # the child's Popen (tests watch it being replaced and reaped)
        return None if self._child is None else self._child.proc

    def _reap(self, grace: float = 0.0) -> int | None:
        """Stop the child (killing it unless ``grace``) and wait for it."""
        if self._child is None:
            return None
        code = self._child.stop(grace)
        self._child = self._conn = None
        return code

    def call(self, spec: str, prompts, completions, answers, timeout: float | None) -> list:
        with self._lock:
            if self._child is None:
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
