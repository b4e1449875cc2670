"""Build a tiny random Llama checkpoint offline, for fast end-to-end tests.

The tokenizer is a byte-level BPE (vocab 2048) trained locally with ``tokenizers`` on the Paul Graham
essays (see ``louver_eval.data.texts``) or, when those cannot be fetched, on Python stdlib sources.
The model (2 layers, hidden 128, 4 query / 2 KV heads, head_dim 32) is random with a fixed seed,
so the same inputs give the same checkpoint. Saved in fp32 as a regular Hugging Face checkpoint.

Usage: ``python -m louver_eval.data.tiny_model [OUT_DIR]`` (default ``models/tiny-llama``).
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

from louver_eval.data.fetch_model import is_checkpoint, require_empty, save_atomic
from louver_eval.data.texts import DEFAULT_DIR as DEFAULT_TEXT_DIR, load_text

DEFAULT_DIR = Path("models/tiny-llama")
VOCAB_SIZE = 2048
BOS, EOS = "<s>", "</s>"
SEED = 0


def training_text(text_dir: Path) -> tuple[str, str]:
    """Return ``(source, text)``: the Paul Graham essays, or stdlib sources if they are unavailable."""
    try:
        return "paul_graham", load_text("paul_graham", text_dir)
    except (OSError, RuntimeError) as exc:
        print(f"[tiny_model] essays unavailable ({exc}); training the tokenizer on stdlib sources")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))
    return "stdlib", "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files)


def train_tokenizer(text: str):
    """Train a byte-level BPE on ``text``; return it wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(text.splitlines(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS)


def build_model(tokenizer):
    """A random fp32 ``LlamaForCausalLM`` sized for tests, seeded for determinism."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=32768,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False, dtype="float32")
    torch.manual_seed(SEED)
    return LlamaForCausalLM(config).eval()


def make_tiny_llama(out_dir: str | Path = DEFAULT_DIR, text_dir: str | Path = DEFAULT_TEXT_DIR) -> Path:
    """Build the tiny checkpoint in ``out_dir`` unless one is already there; return ``out_dir``."""
    out_dir = Path(out_dir)
    if is_checkpoint(out_dir):
        print(f"[tiny_model] {out_dir} already holds a checkpoint; nothing to do")
        return out_dir
    require_empty(out_dir)
    source, text = training_text(Path(text_dir))
    tokenizer = train_tokenizer(text)
    model = build_model(tokenizer)
    save_atomic([model, tokenizer], out_dir)
    params = sum(p.numel() for p in model.parameters())
    print(f"[tiny_model] saved {out_dir}: {params:,} params, vocab {len(tokenizer)} (BPE on {source})")
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--texts", type=Path, default=DEFAULT_TEXT_DIR, help="folder of the long texts")
    args = parser.parse_args()
    make_tiny_llama(args.out_dir, args.texts)


if __name__ == "__main__":
    main()
