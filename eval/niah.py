"""Needle-in-a-haystack prompts over the Paul Graham essays (the standard NIAH haystack).

A needle sentence is inserted at a relative depth of a haystack cut to a token budget, followed by
a question whose answer is only in the needle. Prompts use the model's chat template.
"""

from __future__ import annotations

from dataclasses import dataclass

NEEDLE = "The secret passphrase for the vault is 'violet harbor 7319'."
QUESTION = "What is the secret passphrase for the vault? Answer with the passphrase only."
ANSWER = "violet harbor 7319"


@dataclass(frozen=True)
class NeedlePrompt:
    """One NIAH prompt: chat-formatted ``text``, haystack ``tokens`` and the needle ``depth``."""

    text: str
    tokens: int
    depth: float
    answer: str


def build_prompt(tokenizer, haystack: str, tokens: int, depth: float, needle: str = NEEDLE,
                 question: str = QUESTION, answer: str = ANSWER) -> NeedlePrompt:
    """Haystack cut to ``tokens`` tokens with ``needle`` inserted at ``depth`` (0 = start, 1 = end),
    snapped to a sentence boundary so the needle is not spliced into a word."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must lie in [0, 1], got {depth}")
    ids = tokenizer(haystack, add_special_tokens=False)["input_ids"][:tokens]
    context = tokenizer.decode(ids)
    cut = int(len(context) * depth)
    boundary = context.rfind(". ", 0, cut)
    cut = boundary + 2 if boundary >= 0 and depth > 0 else cut
    document = context[:cut] + " " + needle + " " + context[cut:]
    messages = [{"role": "user", "content": f"{document}\n\n{question}"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return NeedlePrompt(text, len(ids), depth, answer)


def found(answer: str, response: str) -> bool:
    """Whether the response contains the answer (case- and space-insensitive)."""
    norm = lambda s: " ".join(s.lower().replace("'", " ").replace('"', " ").split())  # noqa: E731
    return norm(answer) in norm(response)


MULTI_KEYS = ("amber falcon", "quiet lantern", "copper meadow", "silver orchard")
MULTI_VALUES = ("4821", "7390", "1568", "9047")


def _insert_needles(tokenizer, haystack: str, tokens: int, needles: list[tuple[float, str]]) -> tuple[str, int]:
    """Haystack cut to ``tokens`` tokens with each (depth, sentence) inserted at a sentence boundary."""
    ids = tokenizer(haystack, add_special_tokens=False)["input_ids"][:tokens]
    context = tokenizer.decode(ids)
    cuts = []
    for depth, sentence in needles:
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth must lie in [0, 1], got {depth}")
        boundary = context.rfind(". ", 0, int(len(context) * depth))
        cuts.append((boundary + 2 if boundary >= 0 and depth > 0 else 0, sentence))
    for cut, sentence in sorted(cuts, reverse=True):  # from the back: earlier cuts stay valid
        context = context[:cut] + " " + sentence + " " + context[cut:]
    return context, len(ids)


def _chat(tokenizer, document: str, question: str) -> str:
    messages = [{"role": "user", "content": f"{document}\n\n{question}"}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def build_multikey_prompt(tokenizer, haystack: str, tokens: int, target: int = 2) -> NeedlePrompt:
    """RULER-style multi-key NIAH: four "magic number" needles with different keys, spread over
    depths 0.2..0.8; the question asks for the number of key ``target`` only (``depth`` = its depth)."""
    depths = (0.2, 0.4, 0.6, 0.8)
    needles = [(d, f"The special magic number for {k} is {v}.") for d, k, v in zip(depths, MULTI_KEYS, MULTI_VALUES)]
    document, count = _insert_needles(tokenizer, haystack, tokens, needles)
    question = f"What is the special magic number for {MULTI_KEYS[target]}? Answer with the number only."
    return NeedlePrompt(_chat(tokenizer, document, question), count, depths[target], MULTI_VALUES[target])


def build_multivalue_prompt(tokenizer, haystack: str, tokens: int) -> NeedlePrompt:
    """RULER-style multi-value NIAH: one key with four values at depths 0.2..0.8; every value must
    appear in the answer (``answer`` holds them space-separated; score with ``found_all``)."""
    depths = (0.2, 0.4, 0.6, 0.8)
    key = MULTI_KEYS[0]
    needles = [(d, f"One of the special magic numbers for {key} is {v}.") for d, v in zip(depths, MULTI_VALUES)]
    document, count = _insert_needles(tokenizer, haystack, tokens, needles)
    question = f"What are all the special magic numbers for {key}? List every one of them."
    return NeedlePrompt(_chat(tokenizer, document, question), count, 0.5, " ".join(MULTI_VALUES))


def found_all(answer: str, response: str) -> float:
    """Share of the space-separated values of ``answer`` that appear in ``response``."""
    values = answer.split()
    return sum(found(v, response) for v in values) / len(values)
