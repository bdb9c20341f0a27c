"""Inside vLLM's worker (``worker_extension_cls``, called through ``LLM.collective_rpc``): take the
trainer's weights from the weight channel into vLLM's in-place reload, digest what it loaded
under Hugging Face names, and keep the weights state.

The digest undoes what vLLM does to Hugging Face's tensors when it loads them: q/k/v and
gate/up are fused into one matrix (``packed_modules_mapping``: split back along the output
dimension by the layer's ``output_sizes``), the vocabulary of embeddings and head is padded
(cut back to ``org_vocab_size``), a tied head is the embeddings' own parameter (kept once under
its first name, as Hugging Face saves it). Tensor parallelism would shard them too: TP 1 only.
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


def hf_pieces(model: torch.nn.Module, module_name: str, leaf: str, t: torch.Tensor):
    """(Hugging Face name, tensor) of the vLLM parameter ``module_name.leaf`` holding ``t``: a
    fused one split back, a padded vocabulary cut."""
    module = model.get_submodule(module_name)
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    parent, _, fused = module_name.rpartition(".")
    if fused in packed and len(packed[fused]) > 1:
        for part, piece in zip(packed[fused], torch.split(t, list(module.output_sizes), dim=0)):
            yield f"{parent}.{part}.{leaf}", piece
        return
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
    Llama while every digest agreed)."""
    names = {id(m): n for n, m in model.named_modules()}
    params = dict(model.named_parameters())  # a tied head once, under its first name
    records, done, processed = {}, set(), set()

    def capturing(original):
        def process(layer, *args, **kwargs):
            prefix = names.get(id(layer))
            processed.add(id(layer))
            for leaf, t in layer.named_parameters(recurse=False):
                if prefix is not None and f"{prefix}.{leaf}" in params:
                    records.update(digest_of(hf_pieces(model, prefix, leaf, t.detach())).tensors)
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
    for layer in layers:
        if id(layer) not in processed:
            layer.quant_method.process_weights_after_loading(layer)
    for name, param in model.named_parameters():
        if name not in done:
            module_name, _, leaf = name.rpartition(".")
            records.update(digest_of(hf_pieces(model, module_name, leaf, param.detach())).tensors)
    return WeightsDigest(records)


def resident_digest(model: torch.nn.Module) -> str:
    """The digest of ``model``'s parameters as the engine holds them (its own names and layout):
    what a wake-up from sleep must give back."""
    return digest_of((n, p.detach()) for n, p in model.named_parameters()).value


class WeightSyncExtension:
    """Methods vLLM mixes into its worker class (``self`` is the worker)."""

    def exactrl_start(self, name: str, sleeps: bool = False) -> None:
        self.exactrl_weights = WeightsState(name)
        self.exactrl_group, self.exactrl_sleeps = None, sleeps
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

    def exactrl_open_channel(self, host: str, port: int, timeout: float) -> None:
        store = weight_channel.join_store(host, port, timeout)
        self.exactrl_group = weight_channel.open_group(store, 1, timeout)

    @_marked
    def exactrl_load(self, version: int, timeout: float) -> dict:
        """Receive a whole sync into vLLM's in-place reload (which also redoes what loading does
        after the weights are in: the CPU backend's repacking for its kernels), digest what the
        model now holds, and record the new version."""
        received = (t for bucket in weight_channel.receive(self.exactrl_group, timeout) for t in bucket)
        digest = reload_verified(self.model_runner.get_model(),
                                 lambda: self.exactrl_reload(weights_iterator=received, is_checkpoint_format=True))
        model = self.model_runner.get_model()
        self.exactrl_weights.synced(version, digest.value, resident_digest(model) if self.exactrl_sleeps else None)
        return digest.tensors

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
