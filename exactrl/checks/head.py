"""The head self-check: before the first step, the chunked output head (exactrl/models/head.py)
must compute what the model's own logits give, on this very model.

The chunked head applies the model's head Linear and the post-head ops it knows (softcap,
logit scaling) itself; a model that does anything else to its logits -- a vocabulary cut to
its unpadded size, a multiplier under another name, a head that is not a Linear -- would train
on other log-probs, silently. So a few short sequences run through the model's plain forward
(log-probs and entropies from its full logits, as token_losses computes them) and through the
chunked head split into chunks of a few tokens; where they disagree the run keeps the plain
head, with a notice saying why. A few forwards of a dozen tokens, in eval mode, without a graph.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from exactrl.checks import one_line
from exactrl.device import device_of
from exactrl.losses.token_losses import token_entropy, token_logprobs
from exactrl.models import head, packing

PROBE_LENGTHS, PROBE_CHUNK = (11, 7, 4), 5  # rows over several chunks, one chunk ending mid-row


@dataclass
class HeadReport:
    chunked: bool  # whether the run's per-token fields come from the chunked head
    error: float | None  # max |chunked - plain| / max(1, max |plain|) over log-probs and entropies; None: not run
    ops: list[str]  # the post-head ops folded into the chunked head
    seconds: float
    notice: str | None = None  # why the plain head is kept

    def as_dict(self) -> dict:
        return asdict(self)


def check_head(model, vocab: int, tol: float, what: str = "the model") -> HeadReport:
    """Compare the chunked head with ``model``'s plain logits; turn it off (head.disable) where they differ."""
    t0 = time.perf_counter()
    ops = [f"{op} {value:g} ({name})" for _, name, op, _, value in head.post_ops(head.base_model(model))]
    if head.output_head(model) is None:
        found = head.base_model(model).get_output_embeddings()
        head.disable(model)
        return HeadReport(False, None, ops, time.perf_counter() - t0, None if found is None else (
            f"{what}'s output head is a {type(found).__name__}, not a Linear: its full logits are computed"))
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROBE_LENGTHS]
    batch = packing.model_batch(model, seqs, 0, packed=False)
    ids = batch.inputs["input_ids"].to(device_of(model))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(**batch.inputs).logits
            plain = torch.stack([token_logprobs(logits, ids), token_entropy(logits)], -1)
            with head.per_token_head(model, ids, (), ("logprobs", "entropy"), chunk=PROBE_CHUNK):
                chunked = model(**batch.inputs).logits
        mask = batch.inputs["attention_mask"][:, 1:].bool()[..., None].expand_as(plain)
        error = ((chunked - plain).abs()[mask].max() / plain[mask].abs().max().clamp(min=1)).item()
        reason = None if error <= tol else f"differs from its logits by {error:.2e} (> {tol:g})"
    except Exception as e:  # anything going wrong in the chunked forward is a "no"
        error, reason = None, one_line(e)
    finally:
        model.train(was_training)
    if reason is None:
        return HeadReport(True, error, ops, time.perf_counter() - t0)
    head.disable(model)
    return HeadReport(False, error, ops, time.perf_counter() - t0,
                      f"the chunked output head on {what} ({type(head.base_model(model)).__name__}) {reason}: its full "
                      "logits are computed instead (train.logprob_chunk_size tokens at a time for the log-softmax)")
