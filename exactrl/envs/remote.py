"""An environment served over HTTP (env.url): the EnvPool interface, one request per episode call, in the JSON of
exactrl/envs/server.py (the reference server). A batch's requests go out together (threads), so a server that
answers in parallel runs a turn's episodes in parallel. Nothing is retried: a step is not idempotent. A server
that is down, too slow, refuses or garbles an answer ends that episode with an EnvError naming the server, the
episode, the turn and what happened; what the server answers is checked as an in-process result is."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

from exactrl.envs.base import Action, EnvError, StepResult, check_observation, check_step
from exactrl.envs.process import _GRACE, EnvPool
from exactrl.serving import ServerUnreachable, check_server


class RemoteEnvPool(EnvPool):
    """Episodes of the environment served at ``url``; ``timeout``: env.timeout, per episode call on the server."""

    def __init__(self, url: str, timeout: float = 30.0, check: bool = True):
        self.url, self.timeout = url.rstrip("/"), timeout
        self.client = uuid.uuid4().hex[:8]  # keeps this rank's episodes apart from other ranks' on one server
        self._threads = ThreadPoolExecutor(32, thread_name_prefix="env-http")
        if check:
            try:
                check_server(url, "env.url", what="environment server",
                             start="python -m exactrl.envs.server --cls MODULE:CLASS")
            except ServerUnreachable as e:
                raise EnvError(str(e)) from None

    def _post(self, path: str, body: dict, where: str, wait: float):
        """The server's JSON answer, or an EnvError naming ``where``."""
        data = json.dumps({**body, "client": self.client}).encode()
        request = urllib.request.Request(f"{self.url}/{path}", data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=wait) as response:
                answer = json.loads(response.read())
        except urllib.error.HTTPError as e:
            detail = " ".join(e.read().decode(errors="replace").split())[:300]
            return EnvError(f"{where}: the environment server {self.url} answered HTTP {e.code} {detail}")
        except (urllib.error.URLError, OSError) as e:  # TimeoutError and ConnectionError are OSErrors
            why = getattr(e, "reason", e)
            if isinstance(why, TimeoutError):
                return EnvError(f"{where}: no answer from the environment server {self.url} within {wait:g}s")
            return EnvError(f"{where}: the environment server {self.url} cannot be reached ({why}); is it running "
                            "(python -m exactrl.envs.server --cls MODULE:CLASS --port N)?")
        except json.JSONDecodeError as e:
            return EnvError(f"{where}: the environment server {self.url} answered something that is not JSON ({e})")
        if not isinstance(answer, dict):
            return EnvError(f"{where}: the environment server {self.url} answered {str(answer)[:200]!r}, not a "
                            "JSON object")
        if "error" in answer:
            return EnvError(f"{where}: {' '.join(str(answer['error']).split())}")
        return answer

    def _batch(self, path: str, bodies: list[dict], wheres: list[str], make) -> list[object]:
        # the reference server runs one call at a time: the batch's last may wait for all the others
        wait = (self.timeout + _GRACE) * len(bodies) + 5.0
        answers = self._threads.map(lambda b, w: self._post(path, b, w, wait), bodies, wheres)
        out = []
        for answer, where in zip(answers, wheres):
            if isinstance(answer, EnvError):
                out.append(answer)
                continue
            try:
                out.append(make(answer, where))
            except EnvError as e:
                out.append(e)
        return out

    def reset(self, episodes: list[tuple[int, dict]]) -> list[object]:
        def make(answer, where):
            return check_observation(answer.get("observation"), where)

        return self._batch("reset", [{"episode": e, "row": row} for e, row in episodes],
                           [f"environment server {self.url}, episode {e}, reset" for e, _ in episodes], make)

    def step(self, actions: list[tuple[int, Action]]) -> list[object]:
        def make(answer, where):
            missing = [k for k in ("observation", "reward", "done", "info") if k not in answer]
            if missing:
                raise EnvError(f"{where} answered {json.dumps(answer)[:200]} without {', '.join(missing)}")
            return check_step(StepResult(answer["observation"], answer["reward"], answer["done"], answer["info"]),
                              where)

        return self._batch("step", [{"episode": e, "action": asdict(a)} for e, a in actions],
                           [f"environment server {self.url}, episode {e}, turn {a.turn}, step" for e, a in actions],
                           make)

    def end(self, ids: list[int]) -> None:
        if ids:  # freeing the server's instances is a courtesy: a server without /end, or down, is no error
            self._post("end", {"episodes": list(ids)}, "end", self.timeout + _GRACE)

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
