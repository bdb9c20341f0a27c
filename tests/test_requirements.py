"""pyproject.toml's ranges, requirements.txt's runtime pins and requirements-test.txt's tool pins agree: each dependency
has a lower bound (`make lower-bounds` installs them), every pin lies inside its range, and the tools stay out of what
`pip install exactrl[...]` brings into a user's environment."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import lower_bounds  # noqa: E402

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRAS = PROJECT["optional-dependencies"]
TOOLS = {"pytest", "pytest-xdist", "ruff"}


def pins(name: str) -> dict[str, str]:
    found = {}
    for n, line in enumerate((ROOT / name).read_text().splitlines(), 1):
        line = line.split("#")[0].strip()
        if line:
            m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line)
            assert m, f"{name}:{n}: {line!r} is not an exact pin (name==version)"
            found[canonicalize_name(m.group(1))] = m.group(2)
    return found


RUNTIME, TEST = pins("requirements.txt"), pins("requirements-test.txt")
SPECS = [*PROJECT["dependencies"], *(d for e, ds in EXTRAS.items() if e != "test" for d in ds)]


@pytest.mark.parametrize("spec", SPECS)
def test_every_dependency_has_a_lower_bound_and_the_pin_lies_in_its_range(spec):
    name, lowest = lower_bounds.lowest(spec)
    req = Requirement(spec)
    assert lowest in req.specifier, f"{spec}: its lower bound {lowest} is outside its own range"
    if name in ("torch", "flash-attn"):  # torch is installed apart (the Makefile's TORCH); flash-attn is CUDA-only
        return
    assert name in RUNTIME, f"{spec}: requirements.txt pins no {name}"
    assert RUNTIME[name] in req.specifier, f"requirements.txt pins {name}=={RUNTIME[name]}, outside pyproject's {spec}"


def test_the_tools_are_pinned_apart_and_no_extra_but_test_brings_them():
    assert TOOLS <= set(TEST), "requirements-test.txt must pin pytest, pytest-xdist and ruff"
    assert not set(TEST) & set(RUNTIME), f"pinned twice: {sorted(set(TEST) & set(RUNTIME))}"
    for extra, deps in EXTRAS.items():
        names = {canonicalize_name(Requirement(d).name) for d in deps}
        assert extra == "test" or not names & TOOLS, f"the {extra} extra brings test tools: {sorted(names & TOOLS)}"
    runtime = {canonicalize_name(Requirement(d).name) for d in PROJECT["dependencies"]}
    assert not runtime & (TOOLS | {"wandb", "mlflow-skinny", "tensorboard", "deepspeed", "ray"})
    for tool in TOOLS:
        assert any(Requirement(d).name == tool and TEST[tool] in Requirement(d).specifier for d in EXTRAS["test"])


def test_lower_bounds_lists_each_dependency_once_at_its_lowest_version(capsys):
    assert lower_bounds.main(["--extras", "deepspeed,lora"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "transformers==5.23" in out and "deepspeed==0.19.8" in out and "peft==0.18" in out
    assert [line for line in out if line.startswith("# torch>=")], out  # stated, not installed
    names = [line.split("==")[0] for line in out if not line.startswith("#")]
    assert len(names) == len(set(names)) == len(PROJECT["dependencies"]) - 1 + 2
    with pytest.raises(SystemExit, match="no extra 'nope'"):
        lower_bounds.main(["--extras", "nope"])
    with pytest.raises(ValueError, match="'numpy' has no lower bound"):
        lower_bounds.lowest("numpy")
    assert lower_bounds.lowest("ray==2.60.*") == ("ray", "2.60.0")
