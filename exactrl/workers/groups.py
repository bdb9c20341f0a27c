"""Ray actor groups behind the Worker and Generator interfaces (ray.enabled; docs/scaling-out.md).

One actor class, RoleActor, is one process of the run: a rank of a trainer role holding its
worker (policy, reference, critic, reward model, teacher: exactrl/workers/worker.py, built as in one process), or a
rollout engine holding a generator (the Hugging Face decode loop over a model of its own). The
driver (the `exactrl rl` process) holds handles only:
  WorkerGroup  a trainer role's ranks: a call runs the same Worker method with the same arguments on
               every rank (each takes its micro-batches from the plan; collectives run inside the
               group's own process group, gloo on CPU, NCCL on GPUs) and returns rank 0's result;
  EngineGroup  the Generator protocol over the engines: a request's prompts are split between them,
               each prompt with its own seed, so no response depends on which engine samples it
               (exactrl/rollout/generator.py); the policy's rank 0 pushes its exported weights to
               every engine, which verifies what it loaded: to vLLM engines over one weight channel
               to all their workers at once (exactrl/rollout/weight_channel.py, as OpenRLHF's
               model-update group), to the decode loop's engines through Ray's object store.
An actor that dies stops the run with an error naming it (ray_cluster.results), never a hang.
"""

from __future__ import annotations

import functools
import os
import secrets
import socket
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from exactrl.audit.manifest import record_fact
from exactrl.checks.weight_sync import WeightsDigest
from exactrl.config.loader import ConfigError
from exactrl.device import place, use_device
from exactrl.distributed.launch import init_process_group, rank
from exactrl.distributed.ray_cluster import (
    SHARE,
    Cluster,
    actor_options,
    bundles_needed,
    failures,
    import_ray,
    reserve,
    results,
)
from exactrl.models.loading import load_causal_lm
from exactrl.rollout import weight_channel
from exactrl.rollout.generator import SamplingParams, WeightSyncError, prompt_seeds
from exactrl.rollout.hf import HFEngine
from exactrl.rollout.vllm_generator import VLLMGenerator, vllm_generator
from exactrl.seeding import seed_everything
from exactrl.workers.load import check_generator
from exactrl.workers.worker import Worker


class RoleActor:
    """One process of a Ray run: what it holds, by role ("policy", "critic", "reference", "reward", "teacher",
    "engine")."""

    def __init__(self):
        self.held = {}

    def rendezvous(self) -> tuple[str, int]:
        """Where this actor's group meets to form its process group (called on rank 0): its node and a free port."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return import_ray().util.get_node_ip_address(), port

    def join(self, rank: int, world: int, where: tuple[str, int], device: str) -> None:
        """Become rank ``rank`` of ``world``, as a launcher would set it, on this actor's device. LOCAL_RANK 0: Ray
        shows an actor only the GPUs of its bundle (CUDA_VISIBLE_DEVICES), so its device is cuda:0."""
        os.environ.update(MASTER_ADDR=where[0], MASTER_PORT=str(where[1]), RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_RANK="0")
        use_device(device)
        if world > 1:
            init_process_group()

    def build(self, role: str, cfg, path: str, kwargs: dict, in_policy: bool = False) -> None:
        """``role``'s worker, as Worker.build makes it in one process (seeded alike: a LoRA adapter's
        random start is the same); ``in_policy``: on the policy's model (LoRA's reference)."""
        seed_everything(cfg.train.seed)
        self.held[role] = Worker.build(cfg, role, path, **kwargs, policy=self.held["policy"] if in_policy else None)

    def build_engine(self, cfg, path: str, tokenizer, run_dir: Path, phase: str, index: int) -> None:
        """A rollout engine: the decode loop over a model of its own (in fp32, as the policy's), whose
        decoding is self-checked like the policy's (recorded as generation/<phase>/engine<index>); or
        with rollout.engine=vllm, a vLLM engine process this actor starts and speaks to (from
        rollout.vllm.python's environment), checked at every sync by its digest and probe."""
        if cfg.rollout.engine == "vllm":
            self.held["engine"] = vllm_generator(cfg, path, tokenizer, run_dir, index)
            return
        m = cfg.model
        model = place(load_causal_lm(path, trainable=False, attn=m.attn_implementation,
                                     trust_remote_code=m.trust_remote_code), use_device(cfg.distributed.device))
        check_generator(cfg, model, tokenizer, run_dir, phase, sampled=True, role=f"engine{index}")
        self.held["engine"] = HFEngine(model, tokenizer, cfg.rollout.batch_size)

    def call(self, role: str, method: str, *args, **kwargs):
        return getattr(self.held[role], method)(*args, **kwargs)

    def join_weight_channel(self, host: str, port: int, first: int, world: int, backend: str) -> None:
        """Have this actor's vLLM engine join the policy's weight channel (EngineGroup.load_weights), listening on
        this node's address (gloo) or on its GPUs (NCCL)."""
        self.held["engine"].join_channel(host, port, first, world, import_ray().util.get_node_ip_address(), backend)

    def sleep_engine(self) -> int | None:
        """Let a vLLM engine release its memory while the trainer trains (rollout.vllm.sleep_level); the bytes freed."""
        return getattr(self.held.get("engine"), "sleep", lambda: None)()

    def close_engine(self) -> None:
        """End what the engine holds outside this process (a vLLM engine's own processes)."""
        getattr(self.held.get("engine"), "close", lambda: None)()


# The Worker methods a group runs on every rank (rank 0's result comes back); score: the reward model's
# (ModelReward, exactrl/workers/reward_model.py, calls it from the driver with the whole gathered rollout).
CALLS = frozenset({"forward", "forward_fields", "train_step", "step", "save", "save_state", "load_state", "apply",
                   "check_generation", "canary_summary", "score"})


class WorkerGroup:
    """A trainer role's rank actors behind Worker's methods (CALLS, push_weights)."""

    def __init__(self, role: str, actors: list, ready: list):
        self.role, self.actors, self.world_size = role, actors, len(actors)
        self.names = [f"the {role}'s rank {i} of {len(actors)}" for i in range(len(actors))]
        self._ready = ready  # the builds: awaited before the first call, so a failed one is raised as itself

    def wait(self) -> None:
        if self._ready:
            results(self._ready, self.names, f"building the {self.role}")
            self._ready = []

    def _all(self, method: str, *args, **kwargs):
        self.wait()
        ray = import_ray()
        args = [ray.put(a) for a in args]  # stored once, read by every rank
        refs = [a.call.remote(self.role, method, *args, **kwargs) for a in self.actors]
        return results(refs, self.names, f"{self.role}.{method}")[0]

    def __getattr__(self, method: str):
        if method not in CALLS:
            raise AttributeError(f"a Ray group of {self.__dict__.get('role')} ranks has no '{method}'")
        return functools.partial(self._all, method)

    def push_weights(self, generator, check=None):
        """Worker.push_weights on every rank: they export together, rank 0 sends (EngineGroup.load_weights)
        and verifies (digest, probe); its SyncReport comes back."""
        generator.wait()
        report = self._all("push_weights", generator, check)
        generator.weights_version = report.version
        return report


def split(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges covering range(n), their lengths differing by at most one."""
    return [(n * j // parts, n * (j + 1) // parts) for j in range(parts)]


@dataclass(frozen=True)
class Channel:
    """How the policy's rank 0 sends to vLLM engines (rollout.vllm.*): one weight channel to all their workers."""

    timeout: float  # every broadcast's (rollout.vllm.sync_timeout)
    bucket_bytes: int
    tp: int  # workers per engine (ray.engine_tp)
    backend: str  # gloo or nccl (rollout.vllm.weight_channel, resolved: channel_backend)
    key: str = field(default_factory=lambda: secrets.token_hex(8))  # the run's channel in the sender's process


_SENDING: dict[str, tuple] = {}  # in the policy's rank 0: the open channel (store, group) by Channel.key


class EngineGroup:
    """The Generator protocol (exactrl/rollout/generator.py) over rollout engine actors."""

    synced = False  # each engine decodes alone
    rank0_sends = True  # the policy's other ranks take part in the export's gathers only (load_weights)

    def __init__(self, actors: list, tokenizer, ready: list, logprobs_over: str = HFEngine.logprobs_over,
                 channel: Channel | None = None):
        self.actors, self.tok, self._ready, self.weights_version = actors, tokenizer, ready, 0
        self.logprobs_over = logprobs_over  # the engines' convention (exactrl/rollout/generator.py)
        self.channel = channel  # vLLM engines: rank 0 sends to their workers directly
        self.names = [f"rollout engine {j} of {len(actors)}" for j in range(len(actors))]
        self.name = f"the {len(actors)} Ray rollout engine{'s' if len(actors) > 1 else ''}"

    def __getstate__(self):  # sent to the policy's ranks for the push: handles and names, not the tokenizer
        return {**self.__dict__, "tok": None, "_ready": []}

    def wait(self) -> None:
        if self._ready:
            results(self._ready, self.names, "building the rollout engines")
            self._ready = []

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams | None = None, seeds=None, **kwargs):
        """Prompt i keeps seeds[i] (by default its position in ``prompt_ids``) on whichever engine samples it."""
        self.wait()
        p = params or SamplingParams(**kwargs)
        seeds = list(prompt_seeds(positions=range(len(prompt_ids)))) if seeds is None else list(seeds)
        parts = [(j, a, b) for j, (a, b) in enumerate(split(len(prompt_ids), len(self.actors))) if a < b]
        refs = [self.actors[j].call.remote("engine", "generate", prompt_ids[a:b], p, seeds[a:b]) for j, a, b in parts]
        done = results(refs, [self.names[j] for j, _, _ in parts], "a rollout")
        return [replace(g, prompt_index=g.prompt_index + a) for (_, a, _), gens in zip(parts, done) for g in gens]

    def load_weights(self, named) -> int | None:
        """Called by every rank of the policy (Worker.push_weights): all take part in the export's gathers; rank 0
        sends the tensors once to every engine, each of which copies them in and compares (HFEngine.load_weights).
        Returns the engines' new version (None on the other ranks)."""
        if rank() != 0:
            for _ in named:
                pass
            return None
        if self.channel is not None:
            versions = self._send(named)
        else:
            sent = import_ray().put([(name, t.detach().cpu()) for name, t in named])
            versions = results([e.call.remote("engine", "load_weights", sent) for e in self.actors], self.names,
                               "a weight push")
        if len(set(versions)) != 1:
            raise WeightSyncError(f"the rollout engines hold different weights versions after a push: "
                                  f"{dict(zip(self.names, versions))}")
        self.weights_version = versions[0]
        return self.weights_version

    def _send(self, named) -> list[int]:
        """Broadcast ``named`` over the weight channel to every engine's workers while each engine
        loads and digests them (VLLMGenerator.receive_weights): the tensors leave this process once,
        whatever the number of engines. A broken broadcast waits for every engine's own end of the
        sync (bounded by its timeout) and names what each one saw."""
        c = self.channel
        if c.key not in _SENDING:
            _SENDING[c.key] = self._open(c)
        refs = [e.call.remote("engine", "receive_weights") for e in self.actors]
        try:
            weight_channel.send(_SENDING[c.key][1], named, c.bucket_bytes, c.timeout, weight_channel.device(c.backend))
        except weight_channel.ChannelTimeout as e:
            del _SENDING[c.key]
            seen = [f"{name} took them" if why is None else f"{name}: {why}"
                    for name, why in zip(self.names, failures(refs, 2 * c.timeout))]
            raise WeightSyncError(f"the weight push to {self.name} broke off ({e}; rollout.vllm.sync_timeout "
                                  f"{c.timeout:g} s): " + "; ".join(seen)) from None
        return results(refs, self.names, "a weight push")

    def _open(self, c: Channel) -> tuple:
        """The weight channel from this process (member 0, on its node's address) to every engine's workers
        (engine j's from 1 + j x TP)."""
        host, world = import_ray().util.get_node_ip_address(), 1 + len(self.actors) * c.tp
        store = weight_channel.serve_store(host, c.timeout)
        joins = [e.join_weight_channel.remote(host, store.port, 1 + j * c.tp, world, c.backend)
                 for j, e in enumerate(self.actors)]
        try:
            group, error = weight_channel.open_group(store, 0, c.timeout, world, host, c.backend), None
        except RuntimeError as e:
            group, error = None, str(e).strip().splitlines()[0]
        results(joins, self.names, "joining the weight channel")  # an engine's own failure first
        if error is not None:
            raise WeightSyncError(f"{self.name} did not join the weight channel within {c.timeout:g} s "
                                  f"(rollout.vllm.sync_timeout; {error})")
        return store, group

    def weights_digest(self) -> WeightsDigest:
        """Engine 0's digest of the weights it holds (engine_digests has every engine's)."""
        return self.engine_digests()[0][1]

    def engine_digests(self) -> list[tuple[str, WeightsDigest]]:
        """Each engine's digest of the weights it holds (HFEngine.load_weights computes it), by name: the sync
        check compares every one with what was sent (Worker.push_weights), under rollout.sync_check."""
        digests = results([e.call.remote("engine", "weights_digest") for e in self.actors], self.names,
                          "a weights digest")
        return list(zip(self.names, digests))

    def probe_logprobs(self, ids: list[int]) -> list[float]:
        """Engine 0's log-probs of the probe sequence (every engine's digest equals what was sent)."""
        return results([self.actors[0].call.remote("engine", "probe_logprobs", ids)], self.names[:1], "the probe")[0]

    def sleep(self) -> int | None:
        """Every engine sleeps until the next push or request (a vLLM engine with rollout.vllm.sleep_level > 0;
        anything else does nothing); each wakes by itself and checks what it woke with. The bytes of GPU memory
        they freed together (None where none is measured)."""
        freed = results([a.sleep_engine.remote() for a in self.actors], self.names,
                        "putting the rollout engines to sleep")
        return None if all(f is None for f in freed) else sum(f for f in freed if f is not None)

    def close(self) -> None:
        """Stop the engines' own processes (vLLM's) before the run's final save; the actors end with the run."""
        if not self._ready:
            results([a.close_engine.remote() for a in self.actors], self.names, "closing the rollout engines")


class RayRoles:
    """The roles of an RL run as Ray actor groups (exactrl/workers/placement.py's interface)."""

    def __init__(self, cfg, run_dir: Path, phase: str):
        r, self.cfg, self.run_dir, self.phase = cfg.ray, cfg, run_dir, phase
        self.cluster = Cluster.connect(r.address, bundles_needed(r.placement, r.ranks, r.engines, r.engine_tp))
        self.actors, self.groups, self.policy_path = [], [], None
        try:
            self.gpu = self.cluster.gpu(cfg.distributed.device)
            self.channel = self.channel_backend() if cfg.rollout.engine == "vllm" else None
            if self.gpu and r.engine_tp > 1 and r.placement == "colocated":
                raise ConfigError(f"ray.engine_tp={r.engine_tp} with ray.placement=colocated on GPUs: an actor cannot "
                                  "span the one-GPU bundles the roles share, so a tensor-parallel engine needs "
                                  "ray.placement=split (a bundle of ray.engine_tp GPUs per engine)")
            # colocated: one set of bundles every role shares, rank i (and engine i) on bundle i
            self.shared = reserve(max(r.ranks, r.engines * r.engine_tp), self.gpu, "colocated") \
                if r.placement == "colocated" else None
        except BaseException:  # the run never starts: leave the cluster as it was found
            self.close()
            raise
        if self.shared is not None:
            self.groups.append(self.shared)
        record_fact(run_dir, "ray", {"address": r.address, "placement": r.placement, "ranks": r.ranks,
                                     "engines": r.engines, "engine_tp": r.engine_tp, "gpu": self.gpu,
                                     "weight_channel": self.channel,
                                     "nodes": len(import_ray().nodes()), "async_rollouts": r.async_rollouts,
                                     "max_staleness": r.max_staleness if r.async_rollouts else 0})

    def _start(self, what: str, count: int, size: int = 1) -> list:
        """``count`` actors, each taking ``size`` devices (a tensor-parallel engine's): split, a bundle of
        ``size`` devices each, in a set of their own; colocated, the i-th on shared bundle i x ``size``
        (one device: tensor-parallel engines are refused colocated on GPUs)."""
        if self.shared is not None:
            group, share, stride, size = self.shared, SHARE, size, 1
        else:
            group, share, stride = reserve(count, self.gpu, what, size), 1.0, 1
            self.groups.append(group)
        remote = import_ray().remote(RoleActor)
        actors = [remote.options(**actor_options(group, i * stride, self.gpu, share, size)).remote()
                  for i in range(count)]
        self.actors += actors
        return actors

    def worker(self, role: str, path: str, policy: WorkerGroup | None = None, **kwargs) -> WorkerGroup:
        """``role``'s ranks, built as Worker.build builds one (returns at once; the group waits at its first call)."""
        if role == "policy":
            self.policy_path = path
        if role == "reference" and self.cfg.model.lora.rank > 0:  # the policy's own model, adapters off
            return WorkerGroup(role, policy.actors, [a.build.remote(role, self.cfg, path, kwargs, in_policy=True)
                                                     for a in policy.actors])
        actors, world = self._start(role, self.cfg.ray.ranks), self.cfg.ray.ranks
        where = actors[0].rendezvous.remote()  # resolved by each join: nothing here waits
        for i, a in enumerate(actors):
            a.join.remote(i, world, where, self.cfg.distributed.device)
        return WorkerGroup(role, actors, [a.build.remote(role, self.cfg, path, kwargs) for a in actors])

    def generator(self, policy: WorkerGroup, tokenizer) -> EngineGroup:
        """The rollout engines, each loading the policy's starting model (its weights are pushed before any rollout)."""
        r, cfg = self.cfg.ray, self.cfg
        if cfg.rollout.engine == "vllm" and cfg.rollout.vllm.python:  # where this process finds it, not the actor
            vllm = cfg.rollout.vllm.model_copy(update={"python": os.path.abspath(cfg.rollout.vllm.python)})
            cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"vllm": vllm})})
        actors = self._start("rollout engines", r.engines, size=r.engine_tp)
        ready = [a.build_engine.remote(cfg, self.policy_path, tokenizer, self.run_dir, self.phase, j)
                 for j, a in enumerate(actors)]
        if cfg.rollout.engine != "vllm":
            return EngineGroup(actors, tokenizer, ready)
        v = cfg.rollout.vllm
        return EngineGroup(actors, tokenizer, ready, VLLMGenerator.logprobs_over,
                           Channel(v.sync_timeout, v.bucket_mb << 20, r.engine_tp, self.channel))

    def channel_backend(self) -> str:
        """rollout.vllm.weight_channel, auto resolved: nccl where the policy's rank 0 and every engine hold GPUs of
        their own (split on GPUs), else gloo (NCCL refuses two members on one GPU: colocated; and needs GPUs)."""
        choice, split = self.cfg.rollout.vllm.weight_channel, self.cfg.ray.placement == "split"
        if choice == "nccl" and not self.gpu:
            raise ConfigError("rollout.vllm.weight_channel=nccl: NCCL moves tensors between GPUs and this run's actors "
                              "have none; use gloo (or auto)")
        return "nccl" if choice == "nccl" or (choice == "auto" and split and self.gpu) else "gloo"

    def close(self) -> None:
        """End every actor and release every bundle of the run, then leave a cluster this run joined."""
        ray = import_ray()
        from ray.util.placement_group import placement_group_table, remove_placement_group

        for a in self.actors:
            ray.kill(a)
        for g in self.groups:
            remove_placement_group(g)
        # removal is asynchronous: a run started next on the same cluster must find the bundles free
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(placement_group_table(g).get("state") != "REMOVED"
                                                  for g in self.groups):
            time.sleep(0.1)
        self.cluster.close()
