"""A reference environment server: serves any environment class over HTTP in the JSON of exactrl/envs/remote.py.
The instances live in an environment process of its own, with env.timeout per call, as in a run
(exactrl/envs/process.py), so an environment that hangs or exits ends its episode, not the server.

    python -m exactrl.envs.server --cls my_envs:Maze --args '{"size": 5}' --port 8100
    exactrl rl ... env.url=http://127.0.0.1:8100/

POST /reset {"episode": int, "row": {...}, "client": str} -> {"observation": ...}
POST /step {"episode": int, "action": {"ids": [...], "text": str, "finished": bool, "turn": int}, "client": str}
          -> {"observation": ..., "reward": float | null, "done": bool, "info": {...}}
POST /end {"episodes": [int, ...], "client": str} -> {}
An episode's failure (its environment raised, hung, returned garbage) is answered {"error": "..."} with status
200: the episode ends, the server serves on. "client" keeps the episodes of several trainer ranks apart.
"""

from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from exactrl.envs.base import Action, EnvError
from exactrl.envs.process import ProcessEnvPool
from exactrl.serving import send_json


def make_server(cls: str, args: dict | None = None, host: str = "127.0.0.1", port: int = 8100,
                timeout: float = 30.0) -> ThreadingHTTPServer:
    """An HTTP server over a ProcessEnvPool of ``cls(**args)`` (``timeout`` seconds per episode call); a class
    that cannot be loaded raises EnvError here."""
    pool = ProcessEnvPool(cls, args, timeout)
    lock = threading.Lock()  # one environment process: one call at a time

    def key(episode, body: dict) -> str:
        """The pool's name for a client's episode (errors name it): "7", or "7@client" when a client is named."""
        client = body.get("client")
        return f"{int(episode)}@{client}" if client else str(int(episode))

    def answer(result) -> dict:
        if isinstance(result, EnvError):
            return {"error": str(result)}
        if hasattr(result, "done"):
            return {"observation": result.observation, "reward": result.reward, "done": result.done,
                    "info": result.info}
        return {"observation": result}

    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, payload: dict) -> None:
            try:
                json.dumps(payload)
            except (TypeError, ValueError) as e:  # an observation or info JSON cannot carry
                code, payload = 200, {"error": f"{cls}: its result is not JSON ({e})"}
            send_json(self, code, payload)

        def do_GET(self):  # health check
            self._send(200, {"env": cls})

        def do_POST(self):
            path = self.path.rstrip("/")
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                with lock:
                    if path == "/reset":
                        (result,) = pool.reset([(key(body["episode"], body), body["row"])])
                    elif path == "/step":
                        action = Action(**body["action"])
                        (result,) = pool.step([(key(body["episode"], body), action)])
                    elif path == "/end":
                        pool.end([key(e, body) for e in body["episodes"]])
                        return self._send(200, {})
                    else:
                        return self._send(404, {"error": f"no endpoint {self.path}: POST /reset, /step or /end"})
            except (ValueError, KeyError, TypeError) as e:
                return self._send(400, {"error": f"malformed request to {path} ({type(e).__name__}: {e}); see "
                                                 "exactrl/envs/server.py for the JSON"})
            self._send(200, answer(result))

        def log_message(self, *args):  # quiet: one line per call is noise at RL rates
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.pool = pool
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cls", required=True, help="the environment class, module:Class")
    parser.add_argument("--args", default="{}", help="its constructor's keyword arguments, as a JSON object")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per episode call (env.timeout)")
    args = parser.parse_args()
    try:
        kwargs = json.loads(args.args)
        if not isinstance(kwargs, dict):
            raise ValueError("not a JSON object")
    except ValueError as e:
        parser.error(f"--args {args.args!r}: {e}; give a JSON object, e.g. '{{\"size\": 5}}'")
    try:
        server = make_server(args.cls, kwargs, args.host, args.port, args.timeout)
    except EnvError as e:
        parser.exit(2, f"error: {e}\n")
    print(f"serving {args.cls} on http://{args.host}:{server.server_port}/", flush=True)
    try:
        server.serve_forever()
    finally:
        server.pool.close()


if __name__ == "__main__":
    main()
