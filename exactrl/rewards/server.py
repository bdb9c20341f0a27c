"""A small reference reward server: serves any ``module:function`` reward over HTTP in the JSON
format of exactrl/rewards/remote.py. The function runs in a process of its own (as in a run,
exactrl/rewards/worker.py), so rewards that need the main thread (math-verify) work here too.

    python -m exactrl.rewards.server exactrl.rewards.mathverify:reward --port 8000
    exactrl rl ... reward.fn=http://127.0.0.1:8000/
"""

from __future__ import annotations

import argparse
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from exactrl.rewards import load_reward_fn


def make_server(spec: str, host: str = "127.0.0.1", port: int = 8000, timeout: float = 60.0) -> ThreadingHTTPServer:
    """``timeout``: seconds per batch before the reward process is killed and the request fails (5xx)."""
    fn = load_reward_fn(spec)

    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # health check
            self._send(200, {"reward": spec})

        def do_POST(self):
            try:
                batch = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                prompts, completions, answers = batch["prompts"], batch["completions"], batch.get("answers")
            except (ValueError, KeyError, TypeError) as e:
                return self._send(400, {"error": f"expected {{prompts, completions, answers}}: {e}"})
            answers = answers or [None] * len(completions)
            if fn.needs_answer and None in answers:
                error = f"{spec} needs an answer for every prompt; got null at position {answers.index(None)}"
                return self._send(400, {"error": error})
            try:
                rewards = [float(r) for r in fn(prompts, completions, answers, timeout)]
            except Exception as e:  # the reward's own failure: a server error, retried by the client
                return self._send(500, {"error": f"{type(e).__name__}: {e}"})
            self._send(200, {"rewards": rewards})

        def log_message(self, *args):  # quiet: one line per batch is noise at RL rates
            pass

    return ThreadingHTTPServer((host, port), Handler)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("fn", help="module:function(prompts, completions, answers) -> list[float]")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds per batch before the reward process is killed (a 5xx)")
    args = parser.parse_args()
    server = make_server(args.fn, args.host, args.port, args.timeout)
    print(f"serving {args.fn} on http://{args.host}:{server.server_port}/", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
