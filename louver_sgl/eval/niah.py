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
