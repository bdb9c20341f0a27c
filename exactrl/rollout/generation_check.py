"""The generation self-check: before the first rollout (in sft, before training, for the
evaluations), the run's generator decodes a few prompts and must agree with the model:

* greedy: the generator picks, on a left-padded batch whose rows stop at different steps (so
  finished rows leave the batch and the cache shrinks, as in a rollout; in the static step they
  stay in their slots, fed pad), the tokens Hugging
  Face's ``generate`` picks on the prompts without padding (those of each length together);
* sampled: the log-prob the generator records for each sampled token equals the log-prob the
  training forward (the path training takes: packed or padded rows, the trainer's mode, fp32)
  computes for it when the whole sequence is fed at once.

It is what catches the cache layout nobody tested: a hybrid model's linear-attention or SSM
state, MLA's latent cache, a model that wants its own cache argument, a position-dependent
mechanism that left padding moves. Where the generator disagrees it steps down, one rung at a
time (train.generation_check=fallback, with a notice; error: the run stops): exactrl's static-shape
step (rollout.decode: exactrl/rollout/static_decode.py, replayed from CUDA graphs; a model it
cannot run or gets wrong steps down to the eager loop with a notice under either policy, since
the loop below it is the same maths), exactrl's decode loop, ``generate``, ``generate`` on the
prompts of each length apart without left padding (exactrl/rollout/unpadded.py). Where no
rung's log-probs match the training forward, rollouts would not be on-policy: the run stops,
unless it corrects the rollout-trainer gap (algo.rollout_correction), which it then measures
every rollout (exactrl/checks/rollout_gap.py); it goes on with the decoder of least gap, and
says so. Costs a few short decodes and forwards.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch

from exactrl.checks import one_line
from exactrl.device import device_of
from exactrl.losses.token_losses import token_logprobs
from exactrl.models import packing
from exactrl.rollout import unpadded
from exactrl.rollout.generator import prompt_seeds
from exactrl.rollout.hf import (
    decodes_unpadded,
    decodes_with_generate,
    sample,
    sample_with_generate,
    use_generate,
    use_unpadded,
)
from exactrl.rollout.static_decode import decodes_static, use_static


class GenerationCheckError(RuntimeError):
    """No decoder reproduces the model, and the run does not correct the rollout-trainer gap."""


@dataclass
class GenerationReport:
    prompts: int
    new_tokens: int
    decoder: str  # what the run decodes with: one of RUNGS
    greedy_mismatch: str | None  # where the decoder's greedy tokens first left generate's; None: the same
    logprob_error: float | None  # max |generator's - training forward's| log-prob of a sampled token; None: not run
    seconds: float
    notice: str | None = None
    reasons: dict = field(default_factory=dict)  # decoder -> why the check stepped down from it
    gap_corrected: str | None = None  # the algo.rollout_correction a run goes on under despite a gap; None: no gap

    def as_dict(self) -> dict:
        return asdict(self)


# The decoders, fastest first; each rung down leaves out what the one above may get wrong.
STATIC, LOOP, GENERATE, UNPADDED = "exactrl static loop", "exactrl loop", "generate", "generate, unpadded"
RUNGS = (STATIC, LOOP, GENERATE, UNPADDED)
_SAYS = {LOOP: "exactrl's eager decode loop", GENERATE: "generate",
         UNPADDED: "generate on the prompts of each length apart (no left padding)"}
# With a gap the run corrects, the fastest decoder whose gap is within this factor of the least.
_NEAR_LEAST = 1.1


def _use(model, decoder: str, why: str | None) -> None:
    use_static(model, decoder == STATIC)
    use_generate(model, why if decoder not in (STATIC, LOOP) else None)
    use_unpadded(model, why if decoder == UNPADDED else None)


def _decoder(model) -> str:
    if decodes_unpadded(model):
        return UNPADDED
    return STATIC if decodes_static(model) else GENERATE if decodes_with_generate(model) else LOOP


@contextmanager
def _eval(model):
    """Decoding runs in eval mode, as the generator runs it (HFEngine.generate)."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _prompts(vocab_size: int, pad: int, eos: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Four random prompts of 2 to 9 tokens (never pad or EOS), left-padded."""
    g = torch.Generator().manual_seed(2)
    ids = [t for t in torch.randperm(vocab_size, generator=g).tolist() if t not in (pad, eos)]
    prompts = [ids[i * 9 : i * 9 + n] for i, n in enumerate((5, 9, 2, 7))]
    width = max(map(len, prompts))
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return input_ids, attention


def _greedy_reference(model, input_ids, attention, new: int, pad: int, eos: int, synced: bool) -> list[list[int]]:
    """What the model decodes greedily from each prompt: ``generate`` without padding."""
    with _eval(model):
        tokens, _ = unpadded.by_prompt_length(sample_with_generate, model, input_ids, attention, max_new_tokens=new,
                                              eos=eos, pad=pad, greedy=True, synced=synced)
    return tokens.tolist()


def _greedy_mismatch(model, input_ids, attention, ref: list[list[int]], new: int, pad: int, eos: int,
                     synced: bool) -> str | None:
    """The decoder against the reference, greedy. The decoder stops at a token the reference
    picked early in one row (so rows finish at different steps and the loop shrinks its batch
    and cache); each row is compared up to that token or the reference's EOS, whichever comes
    first (greedy rows are independent of when the others stop)."""
    stop = max(ref, key=lambda r: r.index(eos) if eos in r else new)[min(2, new - 1)]
    with _eval(model):
        got, _ = sample(model, input_ids, attention, max_new_tokens=new, eos=stop, pad=pad, greedy=True, synced=synced)
    for r, (want, have) in enumerate(zip(ref, got.tolist())):
        end = min([want.index(t) + 1 for t in (stop, eos) if t in want] + [new])
        for t in range(end):
            if have[t] != want[t]:
                return f"row {r}, token {t}: {have[t]} instead of {want[t]}"
    return None


def _logprob_error(model, input_ids, attention, new: int, pad: int, eos: int, temperature: float, top_p: float,
                   top_k: int, synced: bool) -> float:
    """Responses sampled by the generator (as the model is set to decode), then the
    training forward teacher-forced on prompt + response: the largest log-prob difference."""
    reps = input_ids.repeat_interleave(2, 0), attention.repeat_interleave(2, 0)
    with _eval(model):  # keyed draws: the run's random stream is not touched
        tokens, logprobs = sample(model, *reps, max_new_tokens=new, eos=eos, pad=pad, temperature=temperature,
                                  top_p=top_p, top_k=top_k, seeds=prompt_seeds("check", positions=range(len(reps[0]))),
                                  synced=synced)
    seqs, spans = [], []
    for ids, mask, row in zip(reps[0].tolist(), reps[1].tolist(), tokens.tolist()):
        prompt = [t for t, m in zip(ids, mask) if m]
        response = row[: row.index(eos) + 1] if eos in row else row
        seqs.append(prompt + response)
        spans.append((len(prompt) - 1, len(response)))
    mb = packing.model_batch(model, seqs, pad, packed=True)  # packed or padded, as training runs
    trained = mb.repad(token_logprobs(model(**mb.inputs).logits.float(), mb.inputs["input_ids"], temperature))
    return max((trained[i, s : s + n].cpu() - logprobs[i, :n].cpu()).abs().max().item()
               for i, (s, n) in enumerate(spans))


def _max_over_ranks(value: float, device) -> float:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return t.item()


@torch.no_grad()
def check_generation(model, vocab_size: int, *, eos: int, pad: int, policy: str, tol: float, temperature: float = 1.0,
                     top_p: float = 1.0, top_k: int = 0, max_new_tokens: int = 16, sampled: bool = True,
                     synced: bool = False, correction: str = "none", what: str = "the model") -> GenerationReport:
    """Run the check on ``model`` (the generator's model, in the mode training leaves it) and
    set it to decode with the first rung that agrees. ``sampled``: also compare sampled log-probs
    (rl); greedy only for sft's evaluations. ``correction``: the run's algo.rollout_correction;
    other than 'none', a gap no rung closes is measured and corrected every rollout instead of
    stopping the run. Every rank runs it together (``synced``: the parameters are sharded) and
    decides alike. Raises GenerationCheckError."""
    t0 = time.perf_counter()
    device = device_of(model)
    new = max(2, min(16, max_new_tokens))
    prompts = _prompts(vocab_size, pad, eos, device)
    where = f"{what} ({type(packing._hf_model(model)).__name__}; {len(prompts[0])} prompts, {new} new tokens)"
    report = GenerationReport(len(prompts[0]), new, _decoder(model), None, None, 0.0)
    ref, errors, why = None, {}, None
    for i, decoder in enumerate(RUNGS[RUNGS.index(report.decoder):]):
        if i:  # a rung down, for the reason the one above gave
            _use(model, decoder, why)
        report.decoder, report.greedy_mismatch, why = decoder, None, None
        if decoder != UNPADDED:  # the reference is what that rung decodes
            ref = ref or _greedy_reference(model, *prompts, new, pad, eos, synced)
            try:
                report.greedy_mismatch = _greedy_mismatch(model, *prompts, ref, new, pad, eos, synced)
            except Exception as e:
                report.greedy_mismatch = why = f"it fails ({one_line(e)})"
            if _max_over_ranks(float(report.greedy_mismatch is not None), device) > 0:
                why = why or ("greedy tokens differ from generate's on the prompts without padding at "
                              f"{report.greedy_mismatch or 'another rank'}")
        if why is None and sampled:
            try:
                error = _logprob_error(model, *prompts, new, pad, eos, temperature, top_p, top_k, synced)
            except Exception as e:
                error, report.reasons["error"] = float("inf"), one_line(e)
            report.logprob_error = errors[decoder] = _max_over_ranks(error, device)
            if report.logprob_error > tol:
                cause = f" ({report.reasons.pop('error')})" if "error" in report.reasons else ""
                why = f"sampled log-probs differ from the training forward's by {report.logprob_error:.3g}{cause}"
        if why is None:
            break
        report.reasons[decoder] = why
        if policy == "error" and decoder not in (STATIC, UNPADDED):
            lower = RUNGS[RUNGS.index(decoder) + 1]
            raise GenerationCheckError(f"generation self-check failed for {where}: {decoder}: {why} "
                                       f"(train.generation_check_tol={tol:g}); train.generation_check=fallback decodes "
                                       f"through {_SAYS[lower]}")
    tried = "; ".join(f"{d}: {w}" for d, w in report.reasons.items())
    if why is not None:
        _no_decoder_agrees(model, report, errors, correction, f"{where}: {tried} (train.generation_check_tol={tol:g})")
    elif report.reasons:
        report.notice = f"generation self-check: {where}: {tried}; decoding through {_SAYS[report.decoder]} instead"
    report.seconds = time.perf_counter() - t0
    return report


def _no_decoder_agrees(model, report: GenerationReport, errors: dict, correction: str, what: str) -> None:
    """Every rung's sampled log-probs are off the training forward's: the run stops, or, correcting
    the gap, goes on with the fastest decoder of (near) least gap."""
    finite = {d: e for d, e in errors.items() if math.isfinite(e)}
    if correction == "none" or not finite:
        way = ("; set algo.rollout_correction (tis, icepop or seq_mask) to train on with the gap measured and "
               "corrected every rollout" if finite else "")
        raise GenerationCheckError(f"generation self-check failed for {what}; no decoder samples with the training "
                                   f"forward's log-probs, so rollouts would not be on-policy{way}")
    least = min(finite.values())
    report.decoder = next(d for d in RUNGS if d in finite and finite[d] <= _NEAR_LEAST * least)
    _use(model, report.decoder, report.reasons[report.decoder])
    report.logprob_error, report.gap_corrected = finite[report.decoder], correction
    report.notice = (f"generation self-check: {what}; decoding through {_SAYS.get(report.decoder, report.decoder)}, "
                     f"whose sampled log-probs are off the training forward's by {report.logprob_error:.3g}: the gap "
                     f"is measured every rollout (rollout_gap/*) and corrected by algo.rollout_correction={correction}")
