"""The generation self-check: before the first rollout (in sft, before training, for the
evaluations), the run's generator decodes a few prompts and must agree with Hugging Face:

* greedy: exactrl's decode loop (exactrl/rollout/hf.py) picks the tokens ``generate`` picks, on
  a left-padded batch whose rows stop at different steps (so finished rows leave the batch and
  the cache shrinks, as in a rollout);
* sampled: the log-prob the generator records for each sampled token equals the log-prob the
  training forward (the path training takes: packed or padded rows, the trainer's mode, fp32)
  computes for it when the whole sequence is fed at once.

It is what catches the cache layout nobody tested: a hybrid model's linear-attention or SSM
state, MLA's latent cache, a model that wants its own cache argument, a position-dependent
mechanism that left padding moves. Where the loop disagrees the model decodes through
``generate`` from then on (train.generation_check=fallback, with a notice) or the run stops
(error); where even ``generate``'s log-probs disagree with the training forward the run stops:
rollouts would not be on-policy. Costs a few short decodes and one forward.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch

from exactrl.checks import one_line
from exactrl.device import device_of
from exactrl.losses.token_losses import token_logprobs
from exactrl.models import packing
from exactrl.rollout.generator import prompt_seeds
from exactrl.rollout.hf import decodes_with_generate, sample, sample_with_generate, use_generate


class GenerationCheckError(RuntimeError):
    """Neither the decode loop nor (under fallback) ``generate`` reproduces the model."""


@dataclass
class GenerationReport:
    prompts: int
    new_tokens: int
    decoder: str  # what the run decodes with: "exactrl loop" or "generate"
    greedy_mismatch: str | None  # where the loop's greedy tokens first left generate's; None: the same
    logprob_error: float | None  # max |generator's - training forward's| log-prob of a sampled token; None: not run
    seconds: float
    notice: str | None = None
    reasons: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


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


def _greedy_mismatch(model, input_ids, attention, new: int, pad: int, eos: int, synced: bool) -> str | None:
    """The loop against generate, greedy. The loop stops at a token generate picked early in one
    row (so rows finish at different steps and the loop shrinks its batch and cache); each row
    is compared up to that token or generate's EOS, whichever comes first (greedy rows are
    independent of when the others stop)."""
    with _eval(model):
        ref, _ = sample_with_generate(model, input_ids, attention, max_new_tokens=new, eos=eos, pad=pad, greedy=True,
                                      synced=synced)
        ref = ref.tolist()
        stop = max(ref, key=lambda r: r.index(eos) if eos in r else new)[min(2, new - 1)]
        got, _ = sample(model, input_ids, attention, max_new_tokens=new, eos=stop, pad=pad, greedy=True, synced=synced)
    for r, (want, have) in enumerate(zip(ref, got.tolist())):
        end = min([want.index(t) + 1 for t in (stop, eos) if t in want] + [new])
        for t in range(end):
            if have[t] != want[t]:
                return f"row {r}, token {t}: {have[t]} instead of generate's {want[t]}"
    return None


def _logprob_error(model, input_ids, attention, new: int, pad: int, eos: int, temperature: float, top_p: float,
                   top_k: int, synced: bool) -> float:
    """Responses sampled by the generator (loop or generate, as the model is set), then the
    training forward teacher-forced on prompt + response: the largest log-prob difference."""
    draw = sample_with_generate if decodes_with_generate(model) else sample
    reps = input_ids.repeat_interleave(2, 0), attention.repeat_interleave(2, 0)
    with _eval(model):  # keyed draws: the run's random stream is not touched
        tokens, logprobs = draw(model, *reps, max_new_tokens=new, eos=eos, pad=pad, temperature=temperature,
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
                     synced: bool = False,
                     what: str = "the model") -> GenerationReport:
    """Run the check on ``model`` (the generator's model, in the mode training leaves it).
    ``sampled``: also compare sampled log-probs (rl); greedy only for sft's evaluations.
    Every rank runs it together (``synced``: the parameters are sharded) and decides alike.
    Raises GenerationCheckError."""
    t0 = time.perf_counter()
    device = device_of(model)
    new = max(2, min(16, max_new_tokens))
    prompts = _prompts(vocab_size, pad, eos, device)
    where = f"{what} ({type(packing._hf_model(model)).__name__}; {len(prompts[0])} prompts, {new} new tokens)"
    decoder = "generate" if decodes_with_generate(model) else "exactrl loop"
    report = GenerationReport(len(prompts[0]), new, decoder, None, None, 0.0)

    def sampled_error() -> float | None:
        if not sampled:
            return None
        try:
            error = _logprob_error(model, *prompts, new, pad, eos, temperature, top_p, top_k, synced)
        except Exception as e:
            error, report.reasons["error"] = float("inf"), one_line(e)
        return _max_over_ranks(error, device)

    if report.decoder == "exactrl loop":
        try:
            report.greedy_mismatch = _greedy_mismatch(model, *prompts, new, pad, eos, synced)
        except Exception as e:
            report.greedy_mismatch = f"the loop fails: {one_line(e)}"
        mismatch = _max_over_ranks(float(report.greedy_mismatch is not None), device) > 0
        report.logprob_error = sampled_error()
        if mismatch or (report.logprob_error is not None and report.logprob_error > tol):
            why = (f"greedy tokens differ from generate's at {report.greedy_mismatch}" if report.greedy_mismatch else
                   f"sampled log-probs differ from the training forward's by {report.logprob_error:.3g}"
                   + (f" ({report.reasons.pop('error')})" if "error" in report.reasons else ""))
            report.reasons["loop"] = why
            if policy == "error":
                raise GenerationCheckError(f"generation self-check failed for {where}: exactrl's decode loop: {why} "
                                           f"(train.generation_check_tol={tol:g}); train.generation_check=fallback "
                                           "decodes through generate")
            use_generate(model, why)
            report.decoder = "generate"
            report.notice = (f"generation self-check: {where}: exactrl's decode loop: {why}; decoding through generate "
                             "instead")
            report.logprob_error = sampled_error()
    else:
        report.logprob_error = sampled_error()
    if report.logprob_error is not None and report.logprob_error > tol:
        cause = f": {report.reasons['error']}" if "error" in report.reasons else ""
        raise GenerationCheckError(f"generation self-check failed for {where}: log-probs sampled through "
                                   f"{report.decoder} differ from the training forward's by {report.logprob_error:.3g} "
                                   f"(train.generation_check_tol={tol:g}){cause}; rollouts would not be on-policy")
    report.seconds = time.perf_counter() - t0
    return report
