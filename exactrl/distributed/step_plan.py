"""The step plan: every micro-batch of one optimizer step, the rank that runs it, and the
step-wide counts every normaliser is built from.

The global batch of an optimizer step is drawn first (by the sampler, independent of the
micro-batch size); the plan then splits it. So runs that differ only in layout see the
same samples per step and, by the aggregation rule, apply the same gradient. The plan covers
every rank (a controller holding no rank can build it and hand each rank ``for_rank(r)``),
and it splits in *units* (a sample, a preference pair: ``unit`` consecutive samples) that
never straddle two micro-batches. It counts loss tokens, sequences and units per ``source``
and per origin of the tokens (who wrote them: data/batch.py ORIGINS), so each term of an
objective can be normalised over exactly the samples and tokens it applies to.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from exactrl.data.batch import SOURCE_ORIGIN
from exactrl.losses.aggregation import UNIT_MEAN, StepNormalizer, UnitNormalizer


@dataclass(frozen=True)
class SourceCount:
    """The step's rows of one ``source`` whose loss tokens come from the same origins."""

    source: str
    tokens: int  # loss tokens
    seqs: int
    units: int  # units whose first sample is one of these rows
    # (origin, its loss tokens) of these rows; every row has at least one token of each, none of any other
    origins: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class RankPlan:
    """One rank's part of a step: what its engine is told and checks."""

    micro_batches: tuple[tuple[int, ...], ...]

    @property
    def num_samples(self) -> int:
        return sum(len(mb) for mb in self.micro_batches)


@dataclass(frozen=True)
class StepPlan:
    micro_batches: tuple[tuple[int, ...], ...]  # every micro-batch of the step: positions in the global batch
    world_size: int  # micro-batch c runs on rank c % world_size
    counts: tuple[SourceCount, ...]  # per source and origins of the loss tokens, over the whole step
    normalizer: StepNormalizer  # the step's default: every source, the plan's aggregation mode
    # each micro-batch normalised by its own counts, averaged over the step's micro-batches (every rank's): the
    # mean of micro-batch means, kept for what reproduces it on purpose (ReLIFT's code, algo.relift.mean_of_means;
    # fault.mean_of_means sets it through the engine); losses/aggregation.py micro_batch_normalizer
    micro_means: bool = False
    unit: int = 1  # samples per unit (2: a preference pair), which no micro-batch, rank or packed row may split

    def __post_init__(self):
        check_units(self.micro_batches, self.unit)

    @property
    def num_samples(self) -> int:
        return sum(len(mb) for mb in self.micro_batches)

    def mean_of(self) -> int | None:
        """With micro_means, the number of micro-batches each one's own normalisers are averaged over."""
        return len(self.micro_batches) if self.micro_means else None

    def for_rank(self, rank: int) -> RankPlan:
        return RankPlan(self.micro_batches[rank :: self.world_size])

    def count(self, sources: Iterable[str] | None = None, origins: Iterable[str] | None = None) -> tuple[int, int]:
        """(loss tokens, sequences having at least one) of the step's samples from ``sources`` (None: all).
        With ``origins``: their loss tokens of those origins, and the sequences having at least one."""
        chosen = [c for c in self.counts if sources is None or c.source in sources]
        if origins is None:  # a row without loss tokens (an episode its environment ended at reset) is no sequence
            return sum(c.tokens for c in chosen), sum(c.seqs for c in chosen if c.tokens)
        origins = set(origins)
        scoped = [(sum(n for o, n in c.origins if o in origins), c.seqs) for c in chosen]
        return sum(t for t, _ in scoped), sum(s for t, s in scoped if t)

    def units(self, sources: Iterable[str] | None = None) -> int:
        """The step's units (preference pairs with ``unit=2``) whose first sample is from ``sources`` (None: all)."""
        return sum(c.units for c in self.counts if sources is None or c.source in sources)

    def normalizer_for(self, mode: str, norm_len: float | None, sources: Iterable[str] | None = None,
                       origins: Iterable[str] | None = None) -> StepNormalizer | UnitNormalizer:
        """The step-wide normaliser of a loss term over the samples of ``sources``, their tokens of ``origins``;
        a loss per unit (UNIT_MEAN, a pair loss) is normalised by the units of ``sources`` in the step."""
        if mode == UNIT_MEAN:
            return UnitNormalizer(self.units(sources))
        tokens, seqs = self.count(sources, origins)
        return StepNormalizer(mode=mode, num_tokens=tokens, num_seqs=seqs, norm_len=norm_len)


def check_units(micro_batches: Sequence[Sequence[int]], unit: int) -> None:
    """Refuse a layout that splits a unit: every sample of the step once, and each micro-batch whole units in order
    (samples u*unit .. u*unit + unit - 1 side by side). A micro-batch runs on one rank as one packed row (or one
    padded batch), so a unit kept in one micro-batch is kept on one rank and in one row: a pair loss then sees its
    chosen and rejected answers together (losses/pairs.py pair_rows). O(samples), checked wherever a plan is made."""
    flat = [i for mb in micro_batches for i in mb]
    if sorted(flat) != list(range(len(flat))):
        raise ValueError(f"a step plan must hold every sample of the step exactly once; its micro-batches hold "
                         f"{sorted(flat)[:12]}{'...' if len(flat) > 12 else ''}")
    for c, mb in enumerate(micro_batches):
        starts = mb[0::unit]
        if len(mb) % unit or any(s % unit or tuple(mb[k * unit : (k + 1) * unit]) != tuple(range(s, s + unit))
                                 for k, s in enumerate(starts)):
            raise ValueError(f"micro-batch {c} of the step plan, samples {list(mb)[:12]}, splits a unit of {unit} "
                             f"samples (a preference pair's chosen and rejected rows must share a micro-batch, rank "
                             f"and packed row, side by side): build the plan with plan_step(..., unit={unit})")


def plan_step(loss_tokens: Sequence[int], micro_batch_size: int, mode: str, norm_len: float | None = None,
              lengths: Sequence[int] | None = None, world_size: int = 1, sources: Sequence[str] | None = None,
              unit: int = 1, origins: Sequence[dict[str, int]] | None = None) -> StepPlan:
    """Plan one optimizer step over a global batch whose sample i has ``loss_tokens[i]`` tokens,
    ``origins[i]`` of them by origin (None: all of its source's origin, data/batch.py SOURCE_ORIGIN).

    The counts cover every sample of the step, on every rank, before any backward, so each
    micro-batch's loss is its exact share of the step loss whatever the split. Given the
    samples' padded ``lengths``, units of similar length share micro-batches (less padding to
    compute); the step's gradient is a sum over samples, so the grouping does not change it.
    A batch that does not fill micro-batches of ``micro_batch_size`` on every rank (a step of a
    mixed-policy method, whose demonstrations vary in number) is split into the fewest
    micro-batches of at most that size, the same number on every rank, their sizes as even as
    the units allow.
    """
    n = len(loss_tokens)
    if n % unit or micro_batch_size % unit:
        raise ValueError(f"units of {unit} samples do not fit a batch of {n} in micro-batches of {micro_batch_size}")
    units = [tuple(range(i, i + unit)) for i in range(0, n, unit)]
    count = -(-len(units) // (micro_batch_size // unit))  # the fewest micro-batches...
    count = -(-count // world_size) * world_size  # ...the same number on every rank
    if not units or count > len(units):
        raise ValueError(f"a global batch of {n} samples does not split into micro-batches of {micro_batch_size} "
                         f"on {world_size} rank(s): every micro-batch needs a sample")
    if lengths is not None:
        units.sort(key=lambda u: max(lengths[i] for i in u))
    size, extra = divmod(len(units), count)
    bounds = [c * size + min(c, extra) for c in range(count + 1)]
    micro = tuple(tuple(i for u in units[bounds[c] : bounds[c + 1]] for i in u) for c in range(count))
    sources = list(sources) if sources is not None else ["on_policy"] * n
    if origins is None:
        origins = [{SOURCE_ORIGIN[s]: t} if t else {} for s, t in zip(sources, loss_tokens)]
    rows: dict[tuple, list[int]] = {}  # (source, origins present) -> its samples
    for i, (src, by_origin) in enumerate(zip(sources, origins)):
        rows.setdefault((src, tuple(o for o, t in by_origin.items() if t)), []).append(i)
    first = {u[0] for u in units}
    counts = tuple(SourceCount(src, sum(loss_tokens[i] for i in group), len(group), len(first.intersection(group)),
                               tuple((o, sum(origins[i][o] for i in group)) for o in present))
                   for (src, present), group in rows.items())
    normalizer = StepNormalizer(mode=mode, num_tokens=int(sum(loss_tokens)), num_seqs=sum(t > 0 for t in loss_tokens),
                                norm_len=norm_len)
    return StepPlan(micro, world_size, counts, normalizer, unit=unit)


def plan_samples(samples: Sequence, micro_batch_size: int, mode: str, norm_len: float | None = None,
                 world_size: int = 1, sort: bool = False, unit: int = 1) -> StepPlan:
    """``plan_step`` over ``Sample`` rows: each counted by its one ``loss_mask`` (the one collate pads)
    and the origins of its tokens."""
    return plan_step([s.loss_tokens for s in samples], micro_batch_size, mode, norm_len,
                     [len(s.ids) for s in samples] if sort else None, world_size, [s.source for s in samples], unit,
                     [s.origin_tokens for s in samples])
