"""exactrl's dependencies at the lowest versions pyproject.toml admits, as requirement lines for pip.

    python scripts/lower_bounds.py --extras deepspeed,lora > lower.txt

`make lower-bounds` installs them into .venv-lower (beside the Makefile's torch) and runs a fast exactness subset of the
suite there, so a lower bound that the code has outgrown fails there, not on a user's machine. torch is left out: its
lower bound is stated from the code (docs/gpus.md, "Installing into your own environment") and only the torch on this
machine's disk is installed; every other build is a multi-GB CUDA download.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
# A lower bound that pip cannot install here (the reason is printed in the file pip reads).
UNTESTED = {"torch": "the lower bound is stated from the code; the Makefile's TORCH is installed instead",
            "flash-attn": "CUDA only"}
SPEC = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*([^;]*)")


def dependencies(extras: list[str], pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """The runtime dependencies, then those of each named extra (extras naming exactrl itself are skipped)."""
    project = tomllib.loads(pyproject.read_text())["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise SystemExit(f"pyproject.toml has no extra {unknown[0]!r} (extras: {', '.join(sorted(optional))})")
    found = list(project["dependencies"])
    for extra in extras:
        found += [d for d in optional[extra] if not d.startswith(project["name"])]
    return found


def lowest(spec: str) -> tuple[str, str]:
    """(name, lowest admitted version) of one requirement: its '>=' bound, or its '==' pin ('==2.60.*' -> '2.60.0')."""
    m = SPEC.match(spec)
    name, ranges = m.group(1).lower().replace("_", "-"), [r.strip() for r in m.group(2).split(",") if r.strip()]
    for r in ranges:
        if r.startswith(">="):
            return name, r[2:].strip()
        if r.startswith("==") and not r.startswith("==="):
            return name, r[2:].strip().removesuffix(".*") + (".0" if r.endswith(".*") else "")
    raise ValueError(f"pyproject.toml: {spec!r} has no lower bound: give it '>=' the oldest version the code runs on")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--extras", default="", help="comma-separated extras whose dependencies to include")
    args = ap.parse_args(argv)
    seen: dict[str, str] = {}
    for spec in dependencies([e for e in args.extras.split(",") if e]):
        name, version = lowest(spec)
        if seen.setdefault(name, version) != version:
            raise SystemExit(f"pyproject.toml: {name} has two lower bounds, {seen[name]} and {version}: make them one")
    for name, version in seen.items():
        print(f"# {name}>={version}: not installed ({UNTESTED[name]})" if name in UNTESTED else f"{name}=={version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
