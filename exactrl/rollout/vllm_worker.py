"""Inside vLLM's worker (``worker_extension_cls``, called through ``LLM.collective_rpc``): take the
trainer's weights from the weight channel into vLLM's in-place reload, digest what it loaded
under Hugging Face names, and keep the weights state.

The digest undoes what vLLM does to Hugging Face's tensors when it loads them: q/k/v and
gate/up are fused into one matrix (``packed_modules_mapping``: split back along the output
dimension by the layer's ``output_sizes``), the vocabulary of embeddings and head is padded
(cut back to ``org_vocab_size``), a tied head is the embeddings' own parameter (kept once under
its first name, as Hugging Face saves it). Under tensor parallelism every rank takes the whole
tensors from the channel (vLLM's loaders keep their shard) and the shards are gathered back before
digesting (hf_pieces).
"""

from __future__ import annotations

import torch

from exactrl.checks.weight_sync import WeightsDigest, WeightsState, WeightSyncError, digest_of
from exactrl.rollout import weight_channel

# vLLM hands a worker's exception back to the engine as a plain Exception with its message: the mark
# lets the engine process tell a refused sync from any other failure (vllm_server.py).
SYNC_MARK = "[weight sync] "


def _marked(fn):
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except WeightSyncError as e:
            raise WeightSyncError(SYNC_MARK + str(e)) from None
    return call


def _tp_size(module: torch.nn.Module) -> int:
    return getattr(module, "tp_size", 1) or 1


def _gather(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Every tensor-parallel rank's ``t``, joined along ``dim`` in rank order (a collective: every rank
    calls it, in the same order)."""
    from vllm.distributed import get_tp_group

    return get_tp_group().all_gather(t.contiguous(), dim)


def _local_sizes(module: torch.nn.Module, tp: int) -> list[int]:
    """The rows of each fused part (q/k/v, gate/up) in this rank's shard of a fused layer."""
    if hasattr(module, "num_kv_heads") and hasattr(module, "head_size"):  # QKVParallelLinear
        v_head = getattr(module, "v_head_size", module.head_size)
        return [module.num_heads * module.head_size, module.num_kv_heads * module.head_size,
                module.num_kv_heads * v_head]
    return [size // tp for size in module.output_sizes]


def _whole(module: torch.nn.Module, part: int, piece: torch.Tensor, tp: int) -> torch.Tensor:
    """Part ``part`` of a fused column-parallel layer, gathered from every rank's piece; k and v heads
    that several ranks hold alike (fewer kv heads than ranks) kept once."""
    full = _gather(piece, 0)
    replicas = getattr(module, "num_kv_head_replicas", 1) if part > 0 else 1
    return torch.cat(full.chunk(tp)[::replicas]) if replicas > 1 else full


def hf_pieces(model: torch.nn.Module, module_name: str, leaf: str, t: torch.Tensor):
    """(Hugging Face name, tensor) of the vLLM parameter ``module_name.leaf`` holding ``t``: a
    fused one split back, a padded vocabulary cut, and under tensor parallelism the whole tensor
    gathered from every rank's shard (column-parallel layers and the vocabulary by rows, row-parallel
    layers by columns; norms and other replicated tensors as they are). A layer sharded another way
    gives a tensor of another shape than was sent: the digest names it, the run stops."""
    module = model.get_submodule(module_name)
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    parent, _, fused = module_name.rpartition(".")
    tp = _tp_size(module)
    if fused in packed and len(packed[fused]) > 1:
        sizes = list(module.output_sizes) if tp == 1 else _local_sizes(module, tp)
        for i, (part, piece) in enumerate(zip(packed[fused], torch.split(t, sizes, dim=0))):
            yield f"{parent}.{part}.{leaf}", piece if tp == 1 else _whole(module, i, piece, tp)
        return
    if tp > 1:
        from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            t = _gather(t, 0)
        elif isinstance(module, RowParallelLinear) and t.dim() == 2:  # its bias is whole on every rank
            t = _gather(t, 1)
    vocab = getattr(module, "org_vocab_size", None)
    yield f"{module_name}.{leaf}", t[:vocab] if vocab is not None and t.shape[0] > vocab else t


def reload_verified(model: torch.nn.Module, reload) -> WeightsDigest:
    """Run ``reload()`` (vLLM's in-place reload of ``model``) and digest what it loaded. A layer
    whose kernels repack its weights after loading (the CPU backend packs every linear layer for
    oneDNN and drops the plain weight) is digested as its weights stand just before that, where
    the loaders (the fusions included) put them; every other parameter as it stands after the
    reload. What the repacked kernels compute is the probe's to check.

    A layer the reload put back without processing it is processed now: vLLM 0.32 skips a head
    tied to the embeddings (no checkpoint tensor of its own), and on the CPU its kernel then keeps
    the old weights packed -- a stale head that the probe caught (log-probs off by 0.59 on a tiny
    Llama while every digest agreed).

    Under tensor parallelism each rank keeps its shards as they stand and gathers them after the
    reload, in sorted order: the ranks process their layers in different orders, and a gather is a
    collective every rank must enter alike."""
    names = {id(m): n for n, m in model.named_modules()}
    params = dict(model.named_parameters())  # a tied head once, under its first name
    records, done, processed, shards = {}, set(), set(), {}
    sharded = any(_tp_size(m) > 1 for m in model.modules())

    def digest(module_name: str, leaf: str, t: torch.Tensor) -> None:
        if sharded:
            shards[(module_name, leaf)] = t
        else:
            records.update(digest_of(hf_pieces(model, module_name, leaf, t)).tensors)

    def capturing(original):
        def process(layer, *args, **kwargs):
            prefix = names.get(id(layer))
            processed.add(id(layer))
            for leaf, t in layer.named_parameters(recurse=False):
                if prefix is not None and f"{prefix}.{leaf}" in params:
                    digest(prefix, leaf, t.detach())
                    done.add(f"{prefix}.{leaf}")
            return original(layer, *args, **kwargs)
        return process

    layers = [m for m in model.modules() if getattr(m, "quant_method", None) is not None]
    methods = {id(m.quant_method): m.quant_method for m in layers}
    for method in methods.values():
        method.process_weights_after_loading = capturing(method.process_weights_after_loading)
    try:
        reload()
    finally:
        for method in methods.values():
            del method.process_weights_after_loading  # the class's own again
    for layer in layers:  # digested before processing, as the reload's own (a skipped layer holds its old weights)
        if id(layer) not in processed:
            capturing(layer.quant_method.process_weights_after_loading)(layer)
    for name, param in model.named_parameters():
        if name not in done:
            module_name, _, leaf = name.rpartition(".")
            digest(module_name, leaf, param.detach())
    for (module_name, leaf), t in sorted(shards.items(), key=lambda item: item[0]):
        records.update(digest_of(hf_pieces(model, module_name, leaf, t)).tensors)
    return WeightsDigest(records)


def resident_digest(model: torch.nn.Module) -> str:
    """The digest of ``model``'s parameters as the engine holds them (its own names and layout):
    what a wake-up from sleep must give back."""
    return digest_of((n, p.detach()) for n, p in model.named_parameters()).value


class WeightSyncExtension:
    """Methods vLLM mixes into its worker class (``self`` is the worker)."""

    def exactrl_start(self, name: str, sleeps: bool = False) -> None:
        self.exactrl_weights = WeightsState(name)
        self.exactrl_group, self.exactrl_sleeps, self.exactrl_on = None, sleeps, weight_channel.HOST
        if sleeps:  # each wake-up is checked against what went to sleep
            self.exactrl_weights.resident = resident_digest(self.model_runner.get_model())
        # vLLM's in-place reload: from an iterator (the sync below) or, without one, from the checkpoint on
        # disk -- the base weights, which a sync must never be overwritten with (TRL issue #5312).
        self.exactrl_reload = self.reload_weights

        @_marked
        def guarded(weights_iterator=None, *args, **kwargs):
            if weights_iterator is None:
                self.exactrl_weights.reload_base("reload_weights from disk")
            return self.exactrl_reload(weights_iterator, *args, **kwargs)

        self.reload_weights = guarded

    def exactrl_open_channel(self, host: str, port: int, timeout: float, world: int = 2, first: int = 1,
                             bind: str | None = None, backend: str = "gloo") -> None:
        """Join the channel served at ``host:port`` as member ``first`` + this worker's tensor-parallel
        rank (the sender is 0; under Ray every engine's workers join one channel, engine j's from
        1 + j x TP), listening on ``bind`` (gloo) or on this worker's GPU (NCCL)."""
        from vllm.distributed import get_tensor_model_parallel_rank

        store = weight_channel.join_store(host, port, timeout)
        self.exactrl_group = weight_channel.open_group(store, first + get_tensor_model_parallel_rank(), timeout, world,
                                                       bind, backend)
        self.exactrl_on = weight_channel.device(backend)

    @_marked
    def exactrl_load(self, version: int, timeout: float) -> dict:
        """Receive a whole sync into vLLM's in-place reload (which also redoes what loading does
        after the weights are in: the CPU backend's repacking for its kernels), digest what the
        model now holds, and record the new version."""
        received = (t for bucket in weight_channel.receive(self.exactrl_group, timeout, self.exactrl_on)
                    for t in bucket)
        digest = reload_verified(self.model_runner.get_model(),
                                 lambda: self.exactrl_reload(weights_iterator=received, is_checkpoint_format=True))
        model = self.model_runner.get_model()
        self.exactrl_weights.synced(version, digest.value, resident_digest(model) if self.exactrl_sleeps else None)
        return digest.tensors

    def exactrl_free_bytes(self) -> int | None:
        """Free memory on this worker's GPU, as the driver counts it (every process's use); None on CPU."""
        return torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else None

    def exactrl_sleep(self, level: int) -> None:
        self.exactrl_weights.slept(level)

    @_marked
    def exactrl_woke(self) -> None:
        """After vLLM's wake-up: weights that slept in host memory must be back unchanged."""
        s = self.exactrl_weights
        kept = s.asleep == 1 and s.kind != "dropped"
        s.woke(resident_digest(self.model_runner.get_model()) if kept else None)

    def exactrl_state(self) -> tuple[str, int, str | None, int]:
        s = self.exactrl_weights
        return s.kind, s.version, s.digest, s.asleep
