"""Verified weight sync (exactrl/checks/weight_sync.py) on the in-process generators: the digest
against one computed another way, the first differing tensor named, the probe against a plain
forward, the weights state machine, and the faults of issue 24 that need no engine process (a
parameter skipped in a sync, a LoRA sync skipped while the version moves, right bytes read
wrongly). The vLLM engine's own faults: tests/test_vllm_generator.py."""

from __future__ import annotations

import hashlib

import pytest
import torch

from exactrl.checks import weight_sync
from exactrl.checks.weight_sync import (
    Digesting,
    SyncCheck,
    WeightsDigest,
    WeightsState,
    WeightSyncError,
    digest_of,
    probe_ids,
)
from exactrl.config import SFTConfig, load_config
from exactrl.distributed.engine import build_engine
from exactrl.rollout.generator import SamplingParams
from exactrl.rollout.hf import HFEngine
from exactrl.tasks.tiny_model import build_tiny_model
from exactrl.workers.worker import Worker

SMALL = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64)


def model(tok, seed, **over):
    return build_tiny_model(len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, seed=seed,
                            **(SMALL | over))


def policy(tok, seed=3, **over) -> Worker:
    m = model(tok, seed, **over)
    engine = build_engine(m, load_config(SFTConfig, None, []), total_steps=1)
    return Worker("policy", m, engine, pad_id=tok.pad_token_id)


def reference_digest(named) -> str:
    """The digest written out by hand: SHA-256 of each tensor's bytes through numpy (bf16 as int16),
    one line per tensor in sorted name order, SHA-256 of the lines (each cut to 32 hex digits)."""
    lines = []
    for name, t in sorted(named, key=lambda nt: nt[0]):
        raw = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).detach().contiguous().numpy().tobytes()
        dtype = str(t.dtype).split(".")[1]
        lines.append(f"{name}|{dtype}|{list(t.shape)}|{hashlib.sha256(raw).hexdigest()[:32]}\n")
    return hashlib.sha256("".join(lines).encode()).hexdigest()[:32]


def test_the_digest_is_the_hand_written_one_and_sees_every_change():
    g = torch.Generator().manual_seed(0)
    named = [("b.weight", torch.randn(3, 4, generator=g)), ("a.bias", torch.randn(5, generator=g)),
             ("c.half", torch.randn(2, 3, generator=g).bfloat16())]
    d = digest_of(named)
    assert d.value == reference_digest(named)
    assert digest_of(reversed(named)).value == d.value  # canonical order: the sender's order does not matter
    bumped = named[0][1].clone()
    bumped[2, 3] = torch.nextafter(bumped[2, 3], torch.tensor(1e9))  # one ulp of one element
    cases = {"one ulp": [("b.weight", bumped), *named[1:]],
             "dtype": [("b.weight", named[0][1].double()), *named[1:]],
             "shape, same bytes": [("b.weight", named[0][1].reshape(4, 3)), *named[1:]],
             "renamed": [("b.weights", named[0][1]), *named[1:]],
             "missing": named[1:]}
    found = {case: d.first_difference(digest_of(other)) for case, other in cases.items()}
    assert found == {"one ulp": "'b.weight' has other bytes loaded than sent",
                     "dtype": "'b.weight' is float32[3, 4] sent, float64[3, 4] loaded",
                     "shape, same bytes": "'b.weight' is float32[3, 4] sent, float32[4, 3] loaded",
                     "renamed": "'b.weight' was sent but is not loaded",
                     "missing": "'b.weight' was sent but is not loaded"}
    assert len({digest_of(other).value for other in cases.values()} | {d.value}) == 6
    assert d.num_bytes == (12 + 5) * 4 + 6 * 2


def test_digesting_a_tensor_leaves_its_storage_resizable():
    """FSDP2 frees an unsharded parameter by resizing its storage to 0; a digest that left a numpy
    view on it made every later backward of a two-rank FSDP2 RL run fail ("Trying to resize
    storage that is not resizable")."""
    for t in (torch.randn(4, 3), torch.randn(6).bfloat16(), torch.randn(3, 4).t()):
        value = weight_sync.tensor_bytes_digest(t)
        assert value == weight_sync.tensor_bytes_digest(t.clone())
        t.untyped_storage().resize_(0)  # raises if the digest pinned it


def test_digesting_digests_exactly_the_stream_and_refuses_a_name_twice():
    named = [("x", torch.ones(2)), ("y", torch.zeros(3))]
    stream = Digesting(iter(named))
    assert [n for n, _ in stream] == ["x", "y"] and stream.digest() == digest_of(named)
    with pytest.raises(WeightSyncError, match="'x' appears twice"):
        list(Digesting([("x", torch.ones(2)), ("x", torch.ones(2))]))


def test_a_generator_with_its_own_model_holds_and_computes_what_the_trainer_sent(tokenizer):
    trainer, gen = policy(tokenizer, 3), HFEngine(model(tokenizer, 11), tokenizer, batch_size=4)
    report = trainer.push_weights(gen)
    exported = list(trainer.export_weights())
    assert report.version == 1 and report.tensors == len(exported) == 11  # the tied head once
    assert report.digest == reference_digest(exported) == gen.weights_state.digest
    assert report.probe_error < 1e-5  # the same weights, the same kernels: eval mode against the training forward
    out = gen.generate([[5, 6, 7]], SamplingParams(n=2, max_new_tokens=4))
    assert {(g.weights_version, g.weights_digest) for g in out} == {(1, report.digest)}


def test_the_in_process_generator_shares_the_trainers_tensors_and_digests_them_once(tokenizer, monkeypatch):
    trainer = policy(tokenizer, 3)
    gen = HFEngine(trainer.model, tokenizer, batch_size=4)
    calls, real = [], weight_sync.tensor_bytes_digest

    def counting(t):
        calls.append(1)
        return real(t)

    monkeypatch.setattr(weight_sync, "tensor_bytes_digest", counting)
    report = trainer.push_weights(gen)
    params = list(trainer.model.named_parameters())
    assert len(calls) == len(params)  # hashed once: both sides hold the very same tensors
    assert report.digest == reference_digest(params) and report.probe_error < 1e-5


def test_the_probe_uses_a_fixed_sequence_of_ordinary_tokens(tokenizer):
    ids = probe_ids(len(tokenizer), avoid=(tokenizer.pad_token_id, tokenizer.eos_token_id))
    assert ids == probe_ids(len(tokenizer), avoid=(tokenizer.pad_token_id, tokenizer.eos_token_id))
    assert len(ids) == 16 and len(set(ids)) == 16 and not {tokenizer.pad_token_id, tokenizer.eos_token_id} & set(ids)


class SkippingEngine(HFEngine):
    """An engine that silently keeps its old copy of some tensors while taking the version (the
    pattern of a sync that skips a parameter, or TRL PR #6344's LoRA sync skipped while the
    version moved)."""

    def __init__(self, *args, skip, **kwargs):
        super().__init__(*args, **kwargs)
        self.skip = skip

    def load_weights(self, named):
        own = dict(self.model.named_parameters())
        return super().load_weights((n, own[n] if self.skip(n) else t) for n, t in named)


def test_a_parameter_the_engine_skipped_is_named(tokenizer):
    trainer = policy(tokenizer, 3)
    skipped = "model.layers.0.mlp.up_proj.weight"
    gen = SkippingEngine(model(tokenizer, 11), tokenizer, batch_size=4, skip=lambda n: n == skipped)
    with pytest.raises(WeightSyncError, match=r"weight sync to hf \(in-process\), version 1: .*'model.layers.0.mlp."
                                              r"up_proj.weight' has other bytes loaded than sent \(11 tensors sent, 11 "
                                              r"loaded"):
        trainer.push_weights(gen)


def test_a_lora_sync_skipped_while_the_version_moves_is_caught(tokenizer):
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    m = get_peft_model(model(tokenizer, 3), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                                                       lora_dropout=0.0))
    for name, p in m.named_parameters():
        if "lora_B" in name:  # adapters that move the merged weights
            p.data.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
    trainer = Worker("policy", m, build_engine(m, load_config(SFTConfig, None, []), total_steps=1),
                     pad_id=tokenizer.pad_token_id)
    base = model(tokenizer, 3)  # the engine started from the base weights
    gen = SkippingEngine(base, tokenizer, batch_size=4, skip=lambda n: n.endswith(("q_proj.weight", "v_proj.weight")))
    with pytest.raises(WeightSyncError, match=r"version 1: .*'model.layers.0.self_attn.q_proj.weight' has other "
                                              r"bytes loaded than sent"):
        trainer.push_weights(gen)
    assert gen.weights_version == 1  # the engine took the version: only the digest saw it


class TwoEngines:
    """Two engines behind one generator, as Ray's EngineGroup: each loads what is sent, and each one's digest
    is handed to the check by its name (engine_digests)."""

    name = "the 2 engines"

    def __init__(self, *engines):
        self.engines, self.names = engines, [f"engine {j} of 2" for j in range(2)]

    def load_weights(self, named):
        named = list(named)
        versions = [e.load_weights(iter(named)) for e in self.engines]
        return versions[0]

    def engine_digests(self):
        return [(n, e.weights_digest()) for n, e in zip(self.names, self.engines)]

    def probe_logprobs(self, ids):
        return self.engines[0].probe_logprobs(ids)


def test_each_engine_of_a_group_is_checked_by_name_under_the_runs_sync_policy(tokenizer):
    """Engine 1 of 2 keeps a tensor: the error names it (engine 0 is right, and its probe passes), and
    rollout.sync_check=warn turns it into a warning as for one engine."""
    trainer, skipped = policy(tokenizer, 3), "model.layers.0.mlp.up_proj.weight"

    def group():
        return TwoEngines(HFEngine(model(tokenizer, 11), tokenizer, batch_size=4),
                          SkippingEngine(model(tokenizer, 11), tokenizer, batch_size=4, skip=lambda n: n == skipped))

    with pytest.raises(WeightSyncError, match=rf"weight sync to engine 1 of 2, version 1: .*'{skipped}' has other"):
        trainer.push_weights(group())
    with pytest.warns(UserWarning, match=r"weight sync to engine 1 of 2, version 1") as caught:
        report = trainer.push_weights(group(), SyncCheck("warn"))
    assert len(caught) == 1 and report.version == 1 and report.probe_error <= 1e-6


def test_right_bytes_read_wrongly_pass_the_digest_and_fail_the_probe(tokenizer):
    trainer = policy(tokenizer, 3)
    gen = HFEngine(model(tokenizer, 11, hidden_act="relu"), tokenizer, batch_size=4)  # an MLP read otherwise
    with pytest.raises(WeightSyncError, match=r"log-probs of the probe sequence differ from the trainer's by "
                                              r"[0-9.e-]+ > rollout.probe_tol=0.001 \(fp32; worst at token"):
        trainer.push_weights(gen)
    assert gen.weights_digest().value == digest_of(trainer.export_weights()).value  # the bytes were right
    with pytest.warns(UserWarning, match="differ from the trainer's"):
        report = trainer.push_weights(gen, SyncCheck("warn"))
    assert report.version == 2 and report.probe_error > 1e-3


def test_the_weights_state_refuses_a_base_reload_after_a_sync():
    state = WeightsState("engine 0")
    state.reload_base("load_model")  # before any sync: the base weights are what it holds anyway
    state.synced(1, "d1")
    with pytest.raises(WeightSyncError, match=r"engine 0: reload_weights would load the base weights over the synced "
                                              r"weights of version 1 .*TRL issue #5312"):
        state.reload_base("reload_weights")
    with pytest.raises(WeightSyncError, match="a sync to version 3 after version 1"):
        state.synced(3, "d3")
    state.dropped("sleep(level=2)")
    with pytest.raises(WeightSyncError, match=r"generate with its weights released .*dropped\(sleep\(level=2\)\)"):
        state.require_usable("generate")
    state.synced(2, "d2")
    state.require_usable("generate")
    assert state.history == ["reload(load_model)", "synced(1)", "dropped(sleep(level=2))", "synced(2)"]


def test_the_weights_state_of_a_sleeping_engine():
    """Level 1 keeps the weights: a wake-up must give back what slept (its resident digest); level 2 drops
    them: only a sync brings them back. Nothing is served or synced while asleep."""
    state = WeightsState("engine 0")
    state.synced(1, "d1", resident="r1")
    state.slept(1)
    for what in (lambda: state.require_usable("a rollout"), lambda: state.synced(2, "d2")):
        with pytest.raises(WeightSyncError, match=r"engine 0: (a rollout|a sync to version 2) while asleep "
                                                  r"\(level 1\)"):
            what()
    state.woke("r1")
    state.require_usable("a rollout")
    state.slept(1)
    with pytest.raises(WeightSyncError, match=r"after waking from sleep it holds other weights than the synced weights "
                                              r"of version 1 it went to sleep with \(resident digest rbase, was r1; "
                                              r"TRL issue #5312\)"):
        state.woke("rbase")
    with pytest.raises(WeightSyncError, match="with its weights released"):
        state.require_usable("a rollout")
    state.synced(2, "d2", resident="r2")
    state.slept(2)
    state.woke(None)  # dropped: nothing to compare, the next sync replaces them
    with pytest.raises(WeightSyncError, match="with its weights released"):
        state.require_usable("a rollout")
    state.synced(3, "d3")
    state.require_usable("a rollout")
    with pytest.raises(ValueError, match="sleep level 3"):
        state.slept(3)


def test_a_digest_survives_a_round_trip_as_plain_data():
    """An engine's records come back through its RPC serialisation, tuples as lists."""
    d = digest_of([("w", torch.arange(6.0).reshape(2, 3))])
    again = WeightsDigest({k: [v[0], list(v[1]), v[2]] for k, v in d.tensors.items()})
    assert again.value == d.value and again.first_difference(d) is None and again == d
