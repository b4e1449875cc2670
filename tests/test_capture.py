"""Checks that attention traces captured from SmolLM2 hold what the model's attention really used.

Needs the converted checkpoint in models/smollm2-135m (``python -m louver_eval.data.fetch_model``)
and data/texts (``python -m louver_eval.data.texts``); skipped otherwise. Runs a 256-token capture
in small chunks so the cached (chunked) attention path is exercised.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "models" / "smollm2-135m"
TEXT_DIR = ROOT / "data" / "texts"
LENGTH, NUM_QUERIES, CHUNK, LAYERS = 256, 16, 64, [0, 3, 27]

from conftest import skip_or_fail  # noqa: E402

if not (MODEL_DIR / "model.safetensors").is_file() or not (TEXT_DIR / "bible.txt").is_file():
    skip_or_fail("models/smollm2-135m or data/texts/bible.txt absent (run louver_eval.data.fetch_model "
                 "and louver_eval.data.texts)", module=True)

from louver_eval.data.capture import capture_trace, first_tokens, load_trace  # noqa: E402
from louver_eval.data.texts import load_text  # noqa: E402


@pytest.fixture(scope="module", params=[torch.float32, torch.float16], ids=["fp32", "fp16"])
def trace(request, tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("traces") / f"bible_{LENGTH}_{request.param}.pt"
    capture_trace(MODEL_DIR, "bible", LENGTH, LAYERS, NUM_QUERIES, path, TEXT_DIR,
                  chunk_size=CHUNK, kv_dtype=request.param)
    return load_trace(path)


def dense_decode(trace: dict, layer: int) -> torch.Tensor:
    """softmax(q K^T * scale) V for every saved query over its visible keys[:pos + 1]."""
    meta = trace["meta"]
    group = meta["num_heads"] // meta["num_kv_heads"]
    keys = trace["keys"][layer].float().repeat_interleave(group, dim=1)  # [L, H_q, D]
    values = trace["values"][layer].float().repeat_interleave(group, dim=1)
    outs = []
    for q, pos in zip(trace["queries"][layer], trace["query_positions"].tolist()):
        scores = torch.einsum("hd,nhd->hn", q, keys[:pos + 1]) * meta["softmax_scale"]
        outs.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), values[:pos + 1]))
    return torch.stack(outs)


def test_layout(trace):
    meta = trace["meta"]
    h_q, h_kv, d = meta["num_heads"], meta["num_kv_heads"], meta["head_dim"]
    assert trace["query_positions"].tolist() == list(range(LENGTH - NUM_QUERIES, LENGTH))
    assert meta["rope_scaling"] is None and meta["softmax_scale"] == pytest.approx(d ** -0.5)
    for layer in LAYERS:
        assert trace["keys"][layer].shape == trace["values"][layer].shape == (LENGTH, h_kv, d)
        assert trace["queries"][layer].shape == (NUM_QUERIES, h_q, d)
        assert trace["queries"][layer].dtype == torch.float32


def assert_dense_matches_model(trace: dict) -> None:
    """Dense attention over the saved keys and values reproduces the model's saved outputs: to 1e-3
    with fp32 storage; fp16 keys/values add their rounding error."""
    tol = 1e-3 if trace["keys"][LAYERS[0]].dtype == torch.float32 else 3e-2
    for layer in LAYERS:
        err = (dense_decode(trace, layer) - trace["outputs"][layer]).abs().max().item()
        assert err < tol, f"layer {layer}: max abs error {err:.2e}"


def test_dense_attention_matches_model(trace):
    assert_dense_matches_model(trace)


def test_keys_equal_plain_kv_cache(trace):
    """Keys/values equal the KV cache of an ordinary one-shot forward (no hook, no chunking)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    ids = first_tokens(AutoTokenizer.from_pretrained(MODEL_DIR), load_text("bible", TEXT_DIR), LENGTH)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[None], past_key_values=cache, use_cache=True)
    fp16 = trace["keys"][LAYERS[0]].dtype == torch.float16
    for layer in LAYERS:
        for name, ref in (("keys", cache.layers[layer].keys), ("values", cache.layers[layer].values)):
            ref = ref[0].transpose(0, 1)
            # Chunked vs one-shot fp32 differ by ~1e-5; fp16 storage adds up to half an ulp.
            tol = 1e-4 + (2.0 ** -11 * ref.abs().max().item() if fp16 else 0.0)
            err = (trace[name][layer].float() - ref).abs().max().item()
            assert err < tol, f"{name} layer {layer}: max abs error {err:.2e} > {tol:.2e}"


def test_random_token_traces_are_seeded_and_hold_the_model_attention(tmp_path):
    """``--text random``: seeded uniformly random token ids (the same ids every capture), and the
    trace reproduces the model's attention as the text traces do."""
    from louver_eval.data.capture import RANDOM_TEXT, random_tokens

    ids = random_tokens(49152, LENGTH)
    assert torch.equal(ids, random_tokens(49152, LENGTH)) and 0 <= int(ids.min()) and int(ids.max()) < 49152
    assert not torch.equal(ids, random_tokens(49152, LENGTH, seed=1))
    path = tmp_path / f"{RANDOM_TEXT}_{LENGTH}.pt"
    capture_trace(MODEL_DIR, RANDOM_TEXT, LENGTH, LAYERS, NUM_QUERIES, path, TEXT_DIR, chunk_size=CHUNK,
                  kv_dtype=torch.float32)
    trace = load_trace(path)
    assert trace["meta"]["text"] == RANDOM_TEXT
    assert_dense_matches_model(trace)  # fp32 storage: to 1e-3


def test_needle_traces_end_with_the_demos_question_and_answer(tmp_path):
    """``--text niah``: the main demo's needle prompt cut to fit, its answer last; the trace's length
    is the prompt's own, and it reproduces the model's attention as the text traces do."""
    from transformers import AutoTokenizer

    from louver_eval.data.capture import NIAH_TEXT, niah_tokens
    from louver_eval.niah import ANSWER

    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    ids = niah_tokens(tokenizer, LENGTH, TEXT_DIR)
    assert LENGTH - 8 <= len(ids) <= LENGTH
    assert tokenizer.decode(ids[-NUM_QUERIES:]).endswith(ANSWER)
    assert "secret passphrase" in tokenizer.decode(ids)
    path = tmp_path / f"{NIAH_TEXT}_{LENGTH}.pt"
    capture_trace(MODEL_DIR, NIAH_TEXT, LENGTH, LAYERS, NUM_QUERIES, path, TEXT_DIR, chunk_size=CHUNK,
                  kv_dtype=torch.float32)
    trace = load_trace(path)
    n = len(ids)
    assert trace["meta"]["length"] == n and trace["query_positions"].tolist() == list(range(n - NUM_QUERIES, n))
    assert trace["keys"][LAYERS[0]].shape[0] == n
    assert_dense_matches_model(trace)


def test_rope_context_stretches_past_the_trace_length(tmp_path):
    """``rope_context``: YaRN to that context whatever the trace's length (the main command's server
    stretches to 32K), named apart from the unstretched trace; the attention still matches."""
    from louver_eval.data.capture import trace_path

    assert trace_path(tmp_path, "bible", LENGTH).name == f"bible_{LENGTH}.pt"
    assert trace_path(tmp_path, "bible", LENGTH, LENGTH).name == f"bible_{LENGTH}.pt"
    assert trace_path(tmp_path, "bible", LENGTH, 32768).name == f"bible_{LENGTH}_yarn32768.pt"
    with pytest.raises(ValueError, match="shorter than the trace"):
        capture_trace(MODEL_DIR, "bible", LENGTH, LAYERS, NUM_QUERIES, tmp_path / "short.pt", TEXT_DIR,
                      rope_context=LENGTH - 1)
    path = trace_path(tmp_path, "bible", LENGTH, 32768)
    capture_trace(MODEL_DIR, "bible", LENGTH, LAYERS, NUM_QUERIES, path, TEXT_DIR, chunk_size=CHUNK,
                  kv_dtype=torch.float32, rope_context=32768)
    trace = load_trace(path)
    rope = trace["meta"]["rope_scaling"]
    assert rope["rope_type"] == "yarn" and rope["factor"] == 32768 / 8192
    assert trace["meta"]["rope_attention_factor"] > 1.0
    assert_dense_matches_model(trace)
