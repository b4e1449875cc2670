"""Capture real attention inputs (post-RoPE queries, keys, values) from SmolLM2 on long texts.

The model runs with Hugging Face transformers in fp32 on CPU over the first ``L`` tokens of a text,
chunk by chunk with a ``DynamicCache``. A registered attention function (``louver_capture``) sees
exactly what the attention kernel sees: the post-RoPE queries of the current chunk and the full
post-RoPE key/value cache. The last ``num_queries`` tokens form the final chunk; their queries are
decode-like (query ``i`` at position ``p_i`` sees ``keys[:p_i + 1]``).

One file ``OUT/{text}_{L}.pt`` per length holds::

    {"keys":   {layer: fp16 [L, H_kv, D]},          # the KV cache content, post-RoPE
     "values": {layer: fp16 [L, H_kv, D]},
     "queries": {layer: fp32 [num_queries, H_q, D]},  # post-RoPE, positions L-num_queries .. L-1
     "outputs": {layer: fp32 [num_queries, H_q, D]},  # the model's own attention output (sdpa)
     "query_positions": int64 [num_queries],
     "meta": {...}}                                   # shapes, RoPE, softmax scale, dtypes, NLL

Beyond the model's 8192-token training length, YaRN RoPE scaling with ``factor = L / 8192`` is used
(static, so every chunk sees the same frequencies; HF's "dynamic" NTK would change the frequencies as
the cache grows). YaRN also multiplies cos/sin by an attention factor, which is baked into q and k.

Usage::

    python -m louver_eval.data.capture --model models/smollm2-135m --text bible \\
        --lengths 2048 8192 --layers 3 9 15 21 27 --num-queries 16 --out data/traces

``--text random`` captures uniformly random token ids, ``--text niah`` the main demo's request (its
needle prompt over the essays, then the answer); ``--rope-context N`` stretches RoPE to N tokens
instead of each length, as the main command's server does (YaRN to 32K whatever the prompt).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from louver_eval.data.fetch_model import DEFAULT_DIR as DEFAULT_MODEL_DIR, ensure_model
from louver_eval.data.texts import DEFAULT_DIR as DEFAULT_TEXT_DIR, TEXT_NAMES, load_text

ATTN_NAME = "louver_capture"
DEFAULT_OUT = Path("data/traces")
DEFAULT_LAYERS = (3, 9, 15, 21, 27)
CHUNK_SIZE = 1024


class AttentionRecorder:
    """Stores, while ``recording``, the attention inputs and outputs of the chosen layers."""

    def __init__(self, layers: list[int], num_queries: int,
                 kv_dtype: torch.dtype = torch.float16) -> None:
        self.layers = set(layers)
        self.num_queries = num_queries
        self.kv_dtype = kv_dtype
        self.recording = False
        self.store: dict[str, dict[int, torch.Tensor]] = {
            "keys": {}, "values": {}, "queries": {}, "outputs": {}}

    def record(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               out: torch.Tensor) -> None:
        """query/key/value: [1, heads, positions, D], key/value being the whole cache;
        out: [1, positions, H_q, D]."""
        if not self.recording or layer not in self.layers:
            return
        n = self.num_queries
        self.store["keys"][layer] = key[0].transpose(0, 1).to(self.kv_dtype).contiguous()
        self.store["values"][layer] = value[0].transpose(0, 1).to(self.kv_dtype).contiguous()
        self.store["queries"][layer] = query[0, :, -n:].transpose(0, 1).float().contiguous()
        self.store["outputs"][layer] = out[0, -n:].float().contiguous()


def recording_attention(module, query, key, value, attention_mask, **kwargs):
    """sdpa attention that also hands its tensors to ``module.louver_recorder`` when one is set."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    recorder = getattr(module, "louver_recorder", None)
    if recorder is not None:
        recorder.record(module.layer_idx, query, key, value, out)
    return out, weights


def rope_for_length(config, length: int) -> dict[str, Any] | None:
    """YaRN parameters stretching the trained context to ``length``, or None when it fits."""
    trained = config.max_position_embeddings
    if length <= trained:
        return None
    return {"rope_type": "yarn", "rope_theta": config.rope_parameters["rope_theta"],
            "factor": length / trained, "original_max_position_embeddings": trained}


def load_model(model_dir: Path, length: int, recorder: AttentionRecorder):
    """Load the model in fp32 with the recording attention and the RoPE scaling ``length`` needs."""
    from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTN_NAME, recording_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, sdpa_mask)  # causal masks as for sdpa
    config = AutoConfig.from_pretrained(model_dir)
    rope = rope_for_length(config, length)
    if rope is not None:
        config.rope_parameters = rope
        config.max_position_embeddings = length
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, config=config, dtype=torch.float32, attn_implementation=ATTN_NAME).eval()
    check_rope(model, rope)
    for layer in model.model.layers:
        layer.self_attn.louver_recorder = recorder
    return model, rope


def check_rope(model, rope: dict[str, Any] | None) -> None:
    """Raise unless the model's rotary embedding really uses ``rope`` (None: the default RoPE)."""
    rotary = model.model.rotary_emb
    expected = "default" if rope is None else rope["rope_type"]
    default_inv_freq, _ = rotary.compute_default_rope_parameters(model.config)
    changed = not torch.allclose(rotary.inv_freq, default_inv_freq)
    if rotary.rope_type != expected or changed != (rope is not None):
        raise RuntimeError(f"RoPE scaling {rope} did not take effect (rope_type={rotary.rope_type})")
    if rope is not None:
        print(f"[capture] RoPE scaling for {model.config.max_position_embeddings} tokens: {rope}, "
              f"attention factor {rotary.attention_scaling:.4f} (applied to q and k)")


# Not a text: uniformly random token ids (seeded), the serving grid's random prompts. Their attention
# is flat, the case the a-posteriori rule's check is hardest on (docs/design-notes.md, "Flat attention").
RANDOM_TEXT = "random"


# Not a text either: the main demo's request (eval/demo_client.py), a needle-in-a-haystack prompt over
# the Paul Graham essays with its question after the document, followed by the answer the model is
# asked for, so that the recorded queries are the question's last tokens and the answer's.
NIAH_TEXT = "niah"


def niah_tokens(tokenizer, length: int, text_dir: Path = DEFAULT_TEXT_DIR) -> torch.Tensor:
    """At most ``length`` token ids of the demo's needle prompt (needle at depth 0.5) and its
    answer: the haystack is cut until the chat-formatted prompt and the answer fit ``length``."""
    from louver_eval.niah import ANSWER, build_prompt

    haystack, budget = load_text("paul_graham", text_dir), length
    for _ in range(8):
        prompt = build_prompt(tokenizer, haystack, budget, 0.5)
        ids = tokenizer(prompt.text + ANSWER, add_special_tokens=False)["input_ids"]
        if len(ids) <= length:
            return torch.tensor(ids)
        budget -= len(ids) - length
    raise ValueError(f"the needle prompt does not fit {length} tokens")


def random_tokens(vocab_size: int, length: int, seed: int = 0) -> torch.Tensor:
    """``length`` uniformly random token ids in [0, vocab_size) as a LongTensor."""
    return torch.randint(0, vocab_size, (length,), generator=torch.Generator().manual_seed(seed))


def first_tokens(tokenizer, text: str, length: int) -> torch.Tensor:
    """The first ``length`` token ids of ``text`` as a LongTensor, tokenizing only a prefix."""
    chars = 8 * length
    while True:
        ids = tokenizer(text[:chars])["input_ids"]
        if len(ids) > length or chars >= len(text):
            break
        chars *= 2
    if len(ids) < length:
        raise ValueError(f"text has only {len(ids)} tokens, fewer than the requested {length}")
    return torch.tensor(ids[:length])


def chunk_bounds(length: int, num_queries: int, chunk_size: int) -> list[tuple[int, int]]:
    """Chunks covering ``[0, length)``; the last one is exactly the final ``num_queries`` tokens."""
    prefix = length - num_queries
    bounds = [(s, min(s + chunk_size, prefix)) for s in range(0, prefix, chunk_size)]
    return bounds + [(prefix, length)]


@torch.no_grad()
def run_chunks(model, ids: torch.Tensor, recorder: AttentionRecorder, chunk_size: int) -> list[float]:
    """Feed ``ids`` through the model chunk by chunk; record the last chunk; return per-chunk NLLs."""
    from tqdm import tqdm
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    bounds = chunk_bounds(len(ids), recorder.num_queries, chunk_size)
    nlls = []
    for start, end in tqdm(bounds, desc=f"{len(ids)} tokens", unit="chunk"):
        recorder.recording = end == len(ids)
        logits = model(ids[None, start:end], past_key_values=cache, use_cache=True).logits[0]
        targets = ids[start + 1:end + 1]
        nlls.append(torch.nn.functional.cross_entropy(logits[:len(targets)], targets).item())
    recorder.recording = False
    return nlls


def trace_meta(model, model_dir: Path, text: str, length: int, layers: list[int],
               rope: dict[str, Any] | None, kv_dtype: torch.dtype) -> dict[str, Any]:
    """Everything needed to interpret a trace without loading the model."""
    cfg, attn = model.config, model.model.layers[0].self_attn
    return {
        "model": str(model_dir), "text": text, "length": length, "layers": list(layers),
        "num_heads": cfg.num_attention_heads, "num_kv_heads": cfg.num_key_value_heads,
        "head_dim": attn.head_dim, "rope_theta": cfg.rope_parameters["rope_theta"],
        "rope_scaling": rope, "rope_attention_factor": float(model.model.rotary_emb.attention_scaling),
        "softmax_scale": attn.scaling,
        "dtypes": {"compute": "float32", "keys": _dtype_name(kv_dtype), "values": _dtype_name(kv_dtype),
                   "queries": "float32", "outputs": "float32"},
    }


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def capture_trace(model_dir: Path, text: str, length: int, layers: list[int], num_queries: int,
                  out_path: Path, text_dir: Path = DEFAULT_TEXT_DIR, chunk_size: int = CHUNK_SIZE,
                  kv_dtype: torch.dtype = torch.float16, rope_context: int | None = None) -> Path:
    """Run the model over the first ``length`` tokens of ``text`` and save the trace to ``out_path``.

    ``kv_dtype`` is the storage dtype of keys and values (fp16 halves the files; fp32 is exact).
    ``rope_context``: the context YaRN stretches RoPE to (default ``length``; scripts/run.sh's
    server stretches it to 32768 whatever the prompt's length, which sharpens attention).
    """
    from transformers import AutoTokenizer

    if not 0 < num_queries < length:
        raise ValueError(f"num_queries must be in [1, {length - 1}], got {num_queries}")
    if rope_context is not None and rope_context < length:
        raise ValueError(f"rope_context {rope_context} is shorter than the trace's {length} tokens")
    recorder = AttentionRecorder(layers, num_queries, kv_dtype)
    model, rope = load_model(model_dir, rope_context or length, recorder)
    bad = [l for l in layers if not 0 <= l < model.config.num_hidden_layers]
    if bad:
        raise ValueError(f"layers {bad} out of range for {model.config.num_hidden_layers} layers")
    if text == RANDOM_TEXT:
        ids = random_tokens(model.config.vocab_size, length)
    elif text == NIAH_TEXT:
        ids = niah_tokens(AutoTokenizer.from_pretrained(model_dir), length, text_dir)
        length = len(ids)  # the prompt's own length, a few tokens short of the request at most
    else:
        ids = first_tokens(AutoTokenizer.from_pretrained(model_dir), load_text(text, text_dir), length)
    start = time.perf_counter()
    nlls = run_chunks(model, ids, recorder, chunk_size)
    meta = trace_meta(model, model_dir, text, length, layers, rope, kv_dtype)
    meta.update(chunk_size=chunk_size, chunk_nll=nlls, seconds=round(time.perf_counter() - start, 1))
    trace = {**recorder.store, "query_positions": torch.arange(length - num_queries, length),
             "meta": meta}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(trace, out_path.with_suffix(".tmp"))
    out_path.with_suffix(".tmp").replace(out_path)
    size = out_path.stat().st_size / 2**20
    print(f"[capture] wrote {out_path} ({size:.1f} MiB) in {meta['seconds']} s; "
          f"mean NLL of the first / last prefix chunk {nlls[0]:.2f} / {nlls[-2]:.2f}")
    return out_path


def load_trace(path: str | Path) -> dict[str, Any]:
    """Load a trace written by :func:`capture_trace` (plain tensors and Python values only)."""
    return torch.load(path, map_location="cpu", weights_only=True)


def trace_path(out_dir: Path, text: str, length: int, rope_context: int | None = None) -> Path:
    """Where the trace of the first ``length`` tokens of ``text`` lives (``rope_context``: the
    context RoPE was stretched to, when not ``length``)."""
    stretch = f"_yarn{rope_context}" if rope_context and rope_context != length else ""
    return Path(out_dir) / f"{text}_{length}{stretch}.pt"


def ensure_traces(lengths: list[int], layers: list[int] = DEFAULT_LAYERS, text: str = "bible",
                  num_queries: int = 16, out_dir: str | Path = DEFAULT_OUT,
                  model_dir: str | Path = DEFAULT_MODEL_DIR, text_dir: str | Path = DEFAULT_TEXT_DIR,
                  force: bool = False, rope_context: int | None = None) -> list[Path]:
    """Return the trace paths for ``lengths``, fetching model/texts and capturing only what is missing.

    An existing file is reused as is: it is not checked against ``layers`` or ``num_queries``.
    """
    paths = [trace_path(Path(out_dir), text, n, rope_context) for n in lengths]
    missing = [(n, p) for n, p in zip(lengths, paths) if force or not p.exists()]
    for n, path in zip(lengths, paths):
        if (n, path) not in missing:
            print(f"[capture] {path} exists; skipping (use --force to recapture)")
    if missing:
        model_dir = ensure_model(model_dir)
        for n, path in missing:
            capture_trace(Path(model_dir), text, n, list(layers), num_queries, path, Path(text_dir),
                          rope_context=rope_context)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--text", choices=(*TEXT_NAMES, RANDOM_TEXT, NIAH_TEXT), default="bible",
                        help=f"{RANDOM_TEXT!r}: uniformly random token ids (flat attention); {NIAH_TEXT!r}: the "
                             "main demo's needle prompt over the essays and its answer")
    parser.add_argument("--texts-dir", type=Path, default=DEFAULT_TEXT_DIR)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--layers", type=int, nargs="+", default=list(DEFAULT_LAYERS))
    parser.add_argument("--num-queries", type=int, default=16)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--force", action="store_true", help="recapture existing files")
    parser.add_argument("--rope-context", type=int, default=None,
                        help="the context YaRN stretches RoPE to (default: each length; 32768 as the main "
                             "command's server, scripts/run.sh)")
    args = parser.parse_args()
    if args.rope_context is not None and args.rope_context < max(args.lengths):
        parser.error(f"--rope-context {args.rope_context} is shorter than the longest length {max(args.lengths)}")
    for path in ensure_traces(args.lengths, args.layers, args.text, args.num_queries, args.out,
                              args.model, args.texts_dir, args.force, args.rope_context):
        print(f"[capture] {path}: {path.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
