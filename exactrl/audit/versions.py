"""Which package versions a run's evidence admits: exact pins, ranges (pip, conda,
requirements.txt) and their intersection, tested on a grid of versions around every version
that matters, so a rule can say AFFECTED / NOT AFFECTED for a range when all of it agrees."""

from __future__ import annotations

from collections.abc import Iterable

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from exactrl.audit.evidence import Reading


def _version(text: str) -> Version | None:
    try:
        return Version(text)
    except InvalidVersion:
        return None


def exact_version(spec: str) -> Version | None:
    body = spec.lstrip("=") if spec.startswith("==") else ""
    return None if "," in body or "*" in body else _version(body)


def _grid(anchors: Iterable[Version]) -> set[Version]:
    """Versions around every anchor: enough to tell whether a range admits both verdicts."""
    out = {Version("0.0.1")}
    for a in anchors:
        major, minor, micro = (a.release + (0, 0, 0))[:3]
        for m in {max(minor - 1, 0), minor, minor + 1}:
            out |= {Version(f"{major}.{m}.{p}") for p in (*range(micro + 3), 99)}
        out |= {a, Version(f"{major + 1}.0.0"), Version(f"{max(major - 1, 0)}.99.0")}
    return out


def version_candidates(readings: list[Reading], boundaries: Iterable[Version] = ()) -> tuple[list[Version], bool]:
    """Versions every reading admits (ranges intersect, an exact pin wins); on disagreement the
    union of what each admits, and True. ``boundaries``: the versions where a bug's verdict
    changes, so the candidates include one on each side of them."""
    specs, exact = [], {exact_version(r.value) for r in readings} - {None}
    for r in readings:
        try:
            specs.append(SpecifierSet(r.value))
        except InvalidSpecifier:  # an unparsable pin says no more than "installed"
            specs.append(SpecifierSet(""))
    anchors = {_version(s.version.removesuffix(".*")) for spec in specs for s in spec}
    grid = sorted(_grid(set(boundaries) | exact | anchors - {None}) | exact)
    both = [v for v in grid if all(s.contains(v, prereleases=True) for s in specs)]
    if both:  # an exact pin admits only itself (and its local variants), so it wins over ranges
        return both, False
    return sorted({v for v in grid for s in specs if s.contains(v, prereleases=True)}), True
