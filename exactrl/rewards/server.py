"""A small reference reward server: serves any ``module:function`` reward over HTTP in the JSON
format of exactrl/rewards/remote.py. The function runs in a process of its own (as in a run,
exactrl/rewards/worker.py), so rewards that need the main thread (math-verify) work here too.

    python -m exactrl.rewards.server exactrl.rewards.mathverify:reward --port 8000
    exactrl rl ... reward.fn=http://127.0.0.1:8000/

With ``--model DIR`` it serves a trained reward model instead (the final/ directory of an `exactrl rm` run):
each prompt and completion is tokenised with the reward model's own tokenizer as `exactrl rm` encodes a text
pair (the prompt with the tokenizer's special tokens, the completion without, then EOS), scored at that EOS and
normalised with DIR/reward_stats.json (--raw: not; a process reward model, whose reward is a probability, with
--raw only, its steps read as reward.model reads them). Unlike reward.model in a run, which scores the policy's
sampled ids as they are, this path re-tokenises text: it serves a reward model whose tokenizer differs from the
policy's, at the cost of a decode and an encode.
"""

from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

from exactrl.rewards import load_reward_fn
from exactrl.serving import send_json


class TextRewardModel:
    """A reward model directory as a text reward: ``(prompts, completions, answers, timeout) -> scores``."""

    needs_answer = False

    def __init__(self, path: str, normalize: bool = True, per_forward: int = 8):
        # imported here: a server of a plain reward function starts without torch
        from exactrl.models.loading import load_tokenizer, load_value_model
        from exactrl.workers.reward_model import RewardModel, model_reward

        self.tok = load_tokenizer(path)
        # the checks of reward.model (a reward model's directory, its statistics), against its own tokenizer
        self.scorer = model_reward(SimpleNamespace(model=path, model_weight=1.0, model_normalize=normalize,
                                                   model_reduce="min"), self.tok, per_forward)
        model = load_value_model(path).requires_grad_(False)
        self.scorer.worker = RewardModel("reward", model, pad_id=self.tok.pad_token_id)
        self.lock = threading.Lock()  # one forward at a time: the server answers requests in threads

    def samples(self, prompts: list[str], completions: list[str]) -> list:
        from exactrl.data.batch import Sample

        tok, out = self.tok, []
        for p, c in zip(prompts, completions):
            ids = tok(p, add_special_tokens=True)["input_ids"] or [tok.bos_token_id]
            out.append(Sample(ids, tok(c, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]))
        return out

    def __call__(self, prompts, completions, answers, timeout=None) -> list[float]:
        with self.lock:
            return self.scorer(self.samples(prompts, completions))


def make_server(spec: str | None, host: str = "127.0.0.1", port: int = 8000, timeout: float = 60.0,
                model: str | None = None, normalize: bool = True) -> ThreadingHTTPServer:
    """``timeout``: seconds per batch before the reward process is killed and the request fails (5xx). ``model``:
    serve that reward model directory (TextRewardModel) instead of ``spec``."""
    fn = TextRewardModel(model, normalize) if model else load_reward_fn(spec)
    spec = spec or str(Path(model))

    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, payload: dict) -> None:
            send_json(self, code, payload)

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
    parser.add_argument("fn", nargs="?", help="module:function(prompts, completions, answers) -> list[float]")
    parser.add_argument("--model", help="serve this reward model directory (an `exactrl rm` run's final/) instead")
    parser.add_argument("--raw", action="store_true", help="--model: its raw scores, not normalised")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds per batch before the reward process is killed (a 5xx)")
    args = parser.parse_args()
    if (args.fn is None) == (args.model is None):
        parser.error("give a reward function (module:function) or --model DIR, not both")
    server = make_server(args.fn, args.host, args.port, args.timeout, args.model, not args.raw)
    print(f"serving {args.fn or args.model} on http://{args.host}:{server.server_port}/", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
