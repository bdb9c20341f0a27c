"""Known silent gradient bugs, reproduced on purpose (config section ``fault.*``), so a study can
show how far each one moves its results (arXiv 2604.23747 measured SFT at 48.3 with both bugs,
54.0 with neither). A run with a fault on says so in every output: a banner on the console when
each phase starts and ends, a ``faults_injected`` field in every metrics.jsonl record, the
manifest, the demo's summary.json and report.md, and ``exactrl audit run``'s verdicts.

- ``fault.dropped_micro_batches``: DeepSpeed 0.15.2-0.18.x with ZeRO-2 and ``offload_optimizer:
  cpu`` (PR #6550, fixed by PR #7967). Its ``async_accumulate_grad_in_cpu_via_gpu``
  (deepspeed/runtime/zero/stage_1_and_2.py) copies the first micro-batch's gradient to a CPU
  buffer and adds that buffer to each later micro-batch's gradient instead of accumulating, so the
  optimizer sees g_first + g_last (each already divided by K by DeepSpeed): the middle micro-batches
  of every step are lost, K = 1 and 2 are unharmed. Re-measured with DeepSpeed 0.18.5 (stage 2,
  offload, SGD, K = 3, 4, 5): the applied update equals the (g_first + g_last)/K update to 4e-7.
  exactrl drops the same micro-batches on every backend (their gradient is multiplied by 0 before
  backward, so every rank still runs every collective), after the canary's term is added, as the
  real bug drops the canary's gradient with the model's: the canary sees it (exactrl/checks/canary.py).
  What is kept is the first and last micro-batches' exact shares of the step loss: (g_first +
  g_last)/K when micro-batches hold equal tokens; with fault.mean_of_means too, exactly what a
  trainer averaging micro-batch means on the broken DeepSpeed applied (OpenRLHF, TRL).
- ``fault.mean_of_means``: OpenRLHF before commit df78645e (v0.10.3) and PR #1249 (v0.10.4)
  normalised each micro-batch's loss by its own tokens and averaged those means over the step's
  micro-batches of every rank: exactrl/losses/aggregation.py ``micro_batch_normalizer``. The
  canary does not see it: each micro-batch's gradient still reaches the optimizer exactly once; it
  is the loss that weighs tokens differently (docs/audit.md, "The bugs, made visible").
"""

from __future__ import annotations

FAULTS = {
    "dropped_micro_batches": "DeepSpeed ZeRO-2 CPU-offload bug (0.15.2-0.18.x, PR #6550 -> #7967): the optimizer "
                             "sees only the first and last micro-batch of each step",
    "mean_of_means": "OpenRLHF mean-of-means loss (<= 0.10.2, fixed by df78645e / PR #1249): each micro-batch "
                     "normalised by its own tokens, then the micro-batch means averaged",
}


def injected(fault) -> dict[str, str]:
    """``fault.<name>`` -> what it reproduces, for each fault a ``fault`` config section turns on."""
    return {f"fault.{name}": what for name, what in FAULTS.items() if fault is not None and getattr(fault, name)}


def banner(faults: dict[str, str], when: str) -> str:
    """The console line a run with ``faults`` prints when a phase starts and ends (``when``)."""
    listed = "; ".join(f"{key}: {what}" for key, what in faults.items())
    return (f"*** FAULT INJECTED ON PURPOSE ({when}) *** {listed}. This run reproduces a known bug: its results are "
            "not a clean measurement.")


def faults_record(fault) -> dict:
    """The manifest's record of the faults ``fault`` turns on ({} when none): `exactrl audit run` reads it."""
    on = injected(fault)
    return {"faults_injected": on} if on else {}
