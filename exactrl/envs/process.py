"""Where a user's environment runs: one child Python per rank and run (exactrl/child.py), holding one instance
per live episode, called one batch per turn.

An environment is the user's code, as a reward is: it may raise, hang, return garbage, call ``sys.exit`` or
crash the interpreter, and none of that may end the run or hang it. Each episode's reset and step runs in the
child's main thread under its own limit (env.timeout): a watchdog thread interrupts the call with a signal of
its own, not SIGALRM, so an environment that uses ``signal.alarm`` itself (math-verify) keeps its timer and
ours. The child answers each episode as it finishes, so the parent knows which episode is running; if that one
has not answered ``timeout + _GRACE`` seconds later (it swallowed the interrupt, or hangs in C code), or the
child dies, the child is killed and restarted. The instances it held are lost with it: every episode still live
there then gets an EnvError. Every failure is an EnvError for its episode alone, in one line naming the
environment class, the episode, the turn and what went wrong; the rollout decides (env.on_error).
"""

from __future__ import annotations

import signal
import threading
import time

from exactrl.child import Child, import_attr
from exactrl.envs.base import Action, EnvError, check_observation, check_step

_GRACE = 2.0  # seconds past env.timeout before the parent kills a child whose episode ignored its interrupt
_NOT_RUN = object()  # a batch's result slot not yet answered (None is an observation)
_READY_TIMEOUT = 300.0  # importing an environment (a simulator, a model) may be slow, but not endless


class EnvPool:
    """The environments of one rank: ``reset`` and ``step`` take a batch of episodes and answer each with its
    result or an EnvError instance (returned, not raised). ``tools``: the tools' OpenAI-style schemas for the
    chat template (env.tools), else None."""

    tools: list[dict] | None = None

    def reset(self, episodes: list[tuple[int, dict]]) -> list[object]:
        raise NotImplementedError

    def step(self, actions: list[tuple[int, Action]]) -> list[object]:
        raise NotImplementedError

    def end(self, ids: list[int]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _where(name: str, episode: int, turn: int | None) -> str:
    return f"environment {name}, episode {episode}, " + ("reset" if turn is None else f"turn {turn}, step")


def _one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())


class _Interrupted(BaseException):
    """A call ran past env.timeout; a BaseException, so an environment's ``except Exception`` lets it through."""


class _Watchdog:
    """Interrupts the main thread's current call once its deadline passes: a thread that sends SIGUSR1 to the
    main thread (a signal to the main thread also cuts short a blocking sleep or read). Tokens keep a late
    signal from interrupting the next call."""

    def __init__(self):
        self._main = threading.get_ident()
        self._cond = threading.Condition()
        self._token = 0
        self._armed = self._fired = None
        self._deadline = None
        signal.signal(signal.SIGUSR1, self._handler)
        threading.Thread(target=self._watch, daemon=True).start()

    def _handler(self, signum, frame):
        if self._armed is not None and self._armed == self._fired:
            raise _Interrupted

    def arm(self, seconds: float) -> None:
        with self._cond:
            self._token += 1
            self._armed, self._deadline = self._token, time.monotonic() + seconds
            self._cond.notify()

    def disarm(self) -> None:
        with self._cond:
            self._armed = self._deadline = None

    def _watch(self) -> None:
        with self._cond:
            while True:
                left = None if self._deadline is None else self._deadline - time.monotonic()
                if left is None or left > 0:
                    self._cond.wait(left)
                    continue
                self._fired, self._deadline = self._armed, None
                signal.pthread_kill(self._main, signal.SIGUSR1)


def _serve(conn, spec: str, args: dict, timeout: float) -> None:
    """The child: load the class and build one instance to check it (kept for the first episode), then answer
    batches until told to stop. A request is ("reset", [(episode, row)]), ("step", [(episode, Action)]) or
    ("end", [episode]); each episode of a batch is answered as it finishes: (index, True, result) or
    (index, False, "the one-line error")."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the parent decides
    cls, error = import_attr(spec, "environment class", "module:Class", "my_envs:MyEnv")
    if error is None and not all(callable(getattr(cls, m, None)) for m in ("reset", "step")):
        error = f"environment class '{spec}' has no reset(row) and step(action) methods (exactrl/envs/base.py)"
    if error is None:
        try:
            spare = cls(**args)
        except Exception as e:
            error = f"environment class '{spec}': {spec.partition(':')[2]}(**env.args) raised {_one_line(e)}"
    if error is not None:
        conn.send(("load_error", error))
        return
    conn.send(("ready", None))
    envs, watchdog = {}, _Watchdog()

    def call(episode: int, item, reset: bool):
        nonlocal spare
        where = _where(spec, episode, None if reset else item.turn)
        try:
            try:
                watchdog.arm(timeout)
                if reset:
                    env, spare = spare if spare is not None else cls(**args), None
                    envs[episode] = env
                    return True, check_observation(env.reset(item), where)
                if episode not in envs:
                    return False, f"{where}: no such episode (never reset, already done or ended)"
                result = check_step(envs[episode].step(item), where)
                if result.done:
                    del envs[episode]
                return True, result
            finally:
                watchdog.disarm()
        except _Interrupted:
            message = f"{where} took longer than env.timeout={timeout:g}s (interrupted)"
        except SystemExit as e:
            message = f"{where} called sys.exit({e.code!r})"
        except EnvError as e:
            message = str(e)
        except Exception as e:
            message = f"{where} raised {_one_line(e)}"
        envs.pop(episode, None)  # a failed episode ends
        return False, message

    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if request is None:
            return
        kind, items = request
        if kind == "end":
            for episode in items:
                envs.pop(episode, None)
            continue
        for index, (episode, item) in enumerate(items):
            ok, payload = call(episode, item, kind == "reset")
            try:
                conn.send((index, ok, payload))
            except Exception as e:  # a result that cannot be pickled
                envs.pop(episode, None)
                conn.send((index, False, f"{_where(spec, episode, None if kind == 'reset' else item.turn)} "
                                         f"returned something that cannot be sent back ({_one_line(e)})"))


class ProcessEnvPool(EnvPool):
    """``cls(**args)`` per episode, in a child process; ``timeout`` seconds per episode call."""

    def __init__(self, cls: str, args: dict | None = None, timeout: float = 30.0, tools: list[dict] | None = None):
        self.spec, self.args, self.timeout, self.tools = cls, dict(args or {}), timeout, tools
        self._child = None
        self._live: set[int] = set()  # episodes whose instance lives in the current child
        self._lost: dict[int, str] = {}  # episode -> why its instance is gone (its child was killed)
        # one batch at a time over the child's connection: under ray.async_rollouts the next rollout's episodes run in
        # a thread (rollout/schedule.py) while evaluation runs its own on the main thread, through this same pool
        self._lock = threading.Lock()
        self._start()

    def _start(self) -> None:
        child = Child("exactrl.envs.process:_serve", (self.spec, self.args, self.timeout))
        try:
            if not child.conn.poll(_READY_TIMEOUT):
                raise EnvError(f"the environment process did not load '{self.spec}' within {_READY_TIMEOUT:g}s")
            kind, payload = child.conn.recv()
        except (EOFError, OSError):
            raise EnvError(f"the environment process ended (exit code {child.stop()}) while loading "
                           f"'{self.spec}'") from None
        except EnvError:
            child.stop()
            raise
        if kind == "load_error":
            child.stop()
            raise EnvError(payload)
        self._child = child

    def _kill(self, why: str) -> int | None:
        """Kill the child (its exit code); every episode it held is lost, for ``why``."""
        code = self._child.stop()
        self._child = None
        self._lost.update({e: why for e in self._live})
        self._live.clear()
        return code

    def _send(self, request) -> None:
        if self._child is not None:
            try:
                self._child.conn.send(request)
                return
            except OSError:  # it died while idle (killed from outside)
                self._kill("the environment process died between calls")
        self._start()
        self._child.conn.send(request)

    def _run(self, kind: str, items: list) -> list:
        results: list[object] = [_NOT_RUN] * len(items)
        turn = (lambda item: None) if kind == "reset" else (lambda item: item.turn)
        if kind == "reset":  # a fresh start
            for episode, _ in items:
                self._lost.pop(episode, None)
        todo = [i for i, (episode, _) in enumerate(items) if episode not in self._lost]
        killed = "the environment process was killed"
        while todo:  # one round per child: a reset batch that outlives its child carries on in a fresh one
            self._send((kind, [items[i] for i in todo]))
            conn, done, failure = self._child.conn, 0, None
            try:
                while done < len(todo) and failure is None:
                    if not conn.poll(self.timeout + _GRACE):
                        failure = (f"did not return within env.timeout={self.timeout:g}s + {_GRACE:g}s (it ignored "
                                   "the interrupt); the environment process was killed")
                        break
                    index, ok, payload = conn.recv()
                    episode = items[todo[index]][0]
                    results[todo[index]] = payload if ok else EnvError(payload)
                    if ok and (kind == "reset" or not payload.done):
                        self._live.add(episode)
                    else:
                        self._live.discard(episode)
                    done += 1
            except (EOFError, OSError):
                failure = "ended the environment process (a crash or os._exit in the environment)"
            if failure is None:
                break
            episode, item = items[todo[done]]
            where = _where(self.spec, episode, turn(item))
            self._live.discard(episode)
            killed = f"the environment process was killed when {where} failed"
            code = self._kill(killed)
            results[todo[done]] = EnvError(f"{where} {failure} (exit code {code})")
            if kind == "step":  # the rest of the batch lived in the killed child
                break
            todo = todo[done + 1:]
        for i, (episode, item) in enumerate(items):  # episodes whose instance a killed child took with it
            if episode in self._lost and not isinstance(results[i], EnvError):
                results[i] = EnvError(f"{_where(self.spec, episode, turn(item))}: its state was lost: "
                                      f"{self._lost.pop(episode)}")
            elif results[i] is _NOT_RUN:  # not run: the batch's child was killed before its turn came
                results[i] = EnvError(f"{_where(self.spec, episode, turn(item))}: not run: {killed}")
        return results

    def reset(self, episodes: list[tuple[int, dict]]) -> list[object]:
        with self._lock:
            return self._run("reset", list(episodes))

    def step(self, actions: list[tuple[int, Action]]) -> list[object]:
        with self._lock:
            return self._run("step", list(actions))

    def end(self, ids: list[int]) -> None:
        with self._lock:
            for episode in ids:
                self._live.discard(episode)
                self._lost.pop(episode, None)
            if self._child is not None:
                try:
                    self._child.conn.send(("end", list(ids)))
                except OSError:  # the child died while idle: the next call starts a fresh one
                    self._kill("the environment process died while idle")

    def close(self) -> None:  # not behind the lock: a failed run closes the pool while a batch may hang in it
        if self._child is not None:
            self._child.stop(grace=1.0)
            self._child = None

