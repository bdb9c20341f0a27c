"""A stand-in for the vLLM engine process (exactrl/rollout/vllm_server.py's backend protocol) that
runs a Hugging Face model with exactrl's decode loop, in this environment (reporting log-probs in
vLLM's convention, over the top-k/top-p kept set): the client, the
engine process, the weight channel, the digests, the weights state and every timeout are tested
by the fast suite without vLLM (tests/test_vllm_generator.py). The real engine is tested there
too when its environment exists. Test-only faults come from $EXACTRL_FAKE_ENGINE (JSON: hang_on_load,
die_in_load: the process exits on the sync's first bucket, generate_seconds, wake_with_base: a
wake-up from sleep that brings back the base weights, TRL issue #5312), never from product code.

Sleep mode as vLLM's: level 1 keeps the weights in host memory (here: a copy, the model's own zeroed,
as freed memory would be), level 2 discards them; the weights state and the wake-up's check are the
real engine's (exactrl/checks/weight_sync.py WeightsState, exactrl/rollout/vllm_worker.py)."""

from __future__ import annotations

import json
import os
import time
from collections import namedtuple

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from exactrl.checks.weight_sync import WeightsState, digest_of
from exactrl.distributed.export import hf_tensors
from exactrl.losses.token_losses import kept_logprobs
from exactrl.rollout import weight_channel
from exactrl.rollout.generator import SamplingParams
from exactrl.rollout.hf import HFEngine
from exactrl.rollout.stops import StopStrings
from exactrl.rollout.vllm_server import sequence_scores
from exactrl.rollout.vllm_worker import resident_digest

Logprob = namedtuple("Logprob", "logprob rank")  # vLLM's (vllm/logprobs.py), without the decoded text


class HFBackend:
    def __init__(self, model: str, name: str, dtype: str, seed: int, max_model_len: int, enforce_eager: bool,
                 gpu_memory_utilization: float, trust_remote_code: bool = False, sleep_level: int = 0,
                 tensor_parallel_size: int = 1, max_logprobs: int = 20):
        torch.set_num_threads(1)
        faults = json.loads(os.environ.get("EXACTRL_FAKE_ENGINE", "{}"))
        hang_on_load, generate_seconds = faults.get("hang_on_load", False), faults.get("generate_seconds", 0.0)
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
        self.engine = HFEngine(self.model, AutoTokenizer.from_pretrained(model), batch_size=64)
        self.state_ = WeightsState(name)
        self.group, self.hang_on_load, self.generate_seconds = None, hang_on_load, generate_seconds
        self.max_model_len = max_model_len
        self.die_in_load = faults.get("die_in_load", False)
        self.path, self.wake_with_base, self.sleeps, self.host = model, faults.get("wake_with_base", False), \
            sleep_level > 0, None
        if self.sleeps:
            self.state_.resident = resident_digest(self.model)

    def info(self) -> dict:
        return {"pid": os.getpid()}

    def open_channel(self, host: str, port: int, timeout: float, world: int = 2, first: int = 1,
                     bind: str | None = None, backend: str = "gloo") -> None:
        self.group = weight_channel.open_group(weight_channel.join_store(host, port, timeout), first, timeout, world,
                                               bind, backend)
        print(f"weight channel: member {first} of {world} ({backend})", flush=True)

    def load(self, version: int, timeout: float) -> dict:
        if self.hang_on_load:  # a sync that never completes: the engine never takes the weights
            time.sleep(3600)
        own = dict(self.model.named_parameters())
        for bucket in weight_channel.receive(self.group, timeout):
            if self.die_in_load:  # an engine that dies in the middle of a sync
                os._exit(3)
            with torch.no_grad():
                for name, t in bucket:
                    own[name].copy_(t)
        digest = digest_of(hf_tensors(self.model, lambda t: t))
        self.state_.synced(version, digest.value, resident_digest(self.model) if self.sleeps else None)
        return digest.tensors

    def state(self):
        return self.state_.kind, self.state_.version, self.state_.digest, self.state_.asleep

    @torch.no_grad()
    def sleep(self, level: int):
        self.state_.slept(level)
        print(f"sleep({level})", flush=True)  # the engine's log: tests count the sleeps of a run
        self.host = {n: p.detach().clone() for n, p in self.model.named_parameters()} if level == 1 else None
        for p in self.model.parameters():
            p.zero_()
        # what a GPU engine would free: its weights (it has no KV cache); on a GPU, vLLM's device counts it
        return self.state(), sum(p.numel() * p.element_size() for p in self.model.parameters())

    @torch.no_grad()
    def wake_up(self):
        kept = self.state_.asleep == 1 and self.state_.kind != "dropped"
        own = dict(self.model.named_parameters())
        if self.host is not None and self.wake_with_base:  # TRL #5312: the base weights come back from disk
            base = AutoModelForCausalLM.from_pretrained(self.path, dtype=next(self.model.parameters()).dtype)
            self.host = {n: p.detach() for n, p in base.named_parameters()}
        for name, t in (self.host or {}).items():
            own[name].copy_(t)
        self.host = None
        self.state_.woke(resident_digest(self.model) if kept else None)
        print("woke", flush=True)
        return self.state()

    def rpc(self, method: str):
        if method == "reload_weights":  # vLLM's reload from disk, guarded as the worker extension guards it
            self.state_.reload_base("reload_weights from disk")
        if method == "restart":  # an engine restarted behind the client's back (a supervisor, a Ray actor restart)
            self.state_ = WeightsState(self.state_.engine)
        return None

    def probe(self, ids: list[int]) -> list[float]:
        return self.engine.probe_logprobs(ids)

    @torch.no_grad()
    def score(self, sequences: list[list[int]], k: int) -> list[tuple]:
        """vLLM's prompt log-probs (at temperature 1, from the model's logits in fp32), each position shaped as vLLM
        gives it ({token id: Logprob} of the token and the k best, by rank), through the real engine's reading of
        them (vllm_server.sequence_scores)."""
        out = []
        for ids in sequences:
            lp = self.model(input_ids=torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
            positions = [None]
            for t in range(1, len(ids)):
                row = lp[t - 1]
                entry = {ids[t]: Logprob(float(row[ids[t]]), int((row > row[ids[t]]).sum()) + 1)}
                if k:
                    top, top_ids = row.topk(k)
                    entry |= {int(i): Logprob(float(v), r) for r, (v, i) in enumerate(zip(top, top_ids), 1)}
                positions.append(entry)
            out.append(sequence_scores(positions, ids, k))
        return out

    def generate(self, requests, params: dict) -> dict:
        time.sleep(self.generate_seconds)
        p = SamplingParams(**{**params, "n": 1, "stop": tuple(params["stop"])})
        stop = StopStrings(self.engine.tok, p.stop) if p.stop else None
        for ids, _ in requests:  # vLLM's own check (v1/engine/input_processor.py _validate_prompt_len)
            if len(ids) >= self.max_model_len:
                raise ValueError(f"The decoder prompt (length {len(ids)}) plus the number of requested output tokens "
                                 f"(at least 1) is longer than the maximum model length of {self.max_model_len}")
        # the requests' seeds are already each response's own (row_seed): drawn with as they are
        gens = self.engine._generate_batch([(i, ids, seed) for i, (ids, seed) in enumerate(requests)], p, stop)
        rows = []
        for (ids, _), g in zip(requests, gens):  # and vLLM stops a request at max_model_len tokens, unfinished
            room, lp = self.max_model_len - len(ids), self.kept(ids, g, p)  # (v1/core/sched/utils.py check_stop)
            rows.append((g.response_ids[:room], None if lp is None else lp[:room]))
        return {"rows": rows, "state": self.state()}

    @torch.no_grad()
    def kept(self, prompt: list[int], g, p: SamplingParams):
        """The log-probs in vLLM's convention (the client declares logprobs_over="kept"): sampled with top-k or
        top-p, renormalised over the kept set; the decode loop's are over the vocabulary."""
        if g.logprobs is None or p.greedy or (p.top_k == 0 and p.top_p >= 1.0):
            return g.logprobs
        ids = torch.tensor([list(prompt) + list(g.response_ids)])
        lp = kept_logprobs(self.model(input_ids=ids).logits.float(), ids, p.temperature, p.top_p, p.top_k)
        return lp[0, len(prompt) - 1 :].tolist()
