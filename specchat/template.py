"""Chat messages -> the exact token ids the target evaluates.

A model's own template comes from its GGUF metadata (`tokenizer.chat_template`) and is rendered with
llama-cpp-python's Jinja2ChatFormatter, the same code `Llama.create_chat_completion` uses. Base models
(gemma-3-270m) have none: they get FALLBACK, a plain "User:/Assistant:" transcript that a base model
continues naturally, stopped at the next "\nUser:".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .backend import Backend
from .errors import SpecchatError


class TemplateError(SpecchatError):
    """The chat template rejected the messages (one line, for the user)."""


FALLBACK_STOP = ["\nUser:", "\nAssistant:"]


@dataclass(frozen=True)
class Rendered:
    token_ids: list[int]
    stop: list[str]  # stop strings that go with this format
    templated: bool  # False = the fallback transcript format


def render_fallback(messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
    parts = []
    for m in messages:
        if m["role"] == "system":
            parts.append(f"{m['content']}\n\n")
        else:
            who = "User" if m["role"] == "user" else "Assistant"
            parts.append(f"{who}: {m['content']}\n")
    if add_generation_prompt:
        parts.append("Assistant:")
    return "".join(parts)


def render_text(backend: Backend, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
    """The conversation as text, in the target's template or the fallback."""
    template = backend.chat_template
    if not template:
        return render_fallback(messages, add_generation_prompt)
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    formatter = Jinja2ChatFormatter(
        template,
        eos_token=backend.eos_text,
        bos_token=backend.bos_text,
        add_generation_prompt=add_generation_prompt,
    )
    try:
        return formatter(messages=[{"role": m["role"], "content": m["content"]} for m in messages]).prompt
    except Exception as e:  # a template's raise_exception ("roles must alternate"), a Jinja error
        raise TemplateError(f"the model's chat template refused this conversation: {e}") from None


def tokenize_rendered(backend: Backend, text: str) -> list[int]:
    """The ids of a whole rendered conversation. A template writes BOS (and its other special tokens) as
    text where the model wants them, so the tokenizer adds none and parses them; the fallback format is
    plain text and gets the tokenizer's own BOS."""
    if backend.chat_template:
        return backend.tokenize(text, add_special=False, parse_special=True)
    return backend.tokenize(text, add_special=True)


def render(backend: Backend, messages: Sequence[dict], add_generation_prompt: bool = True) -> Rendered:
    text = render_text(backend, messages, add_generation_prompt)
    templated = bool(backend.chat_template)
    return Rendered(tokenize_rendered(backend, text), [] if templated else list(FALLBACK_STOP), templated)
