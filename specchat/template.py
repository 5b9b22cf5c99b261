"""Chat messages -> the exact token ids the target evaluates, as llama.cpp would make them.

llama.cpp is the reference: a conversation becomes the prompt llama-server would evaluate for the same
model (--jinja, POST /apply-template). The template is, first found first: --chat-template /
--chat-template-file, the model's `chat_template` / `chat_template_file` in models.toml, the GGUF's own
(`tokenizer.chat_template`). jinja_chat.py renders a Jinja template with llama.cpp's inputs, polyfills and
fallbacks; a name from llama.cpp's built-in list (`chatml`, `llama3`, `gemma`, ...) is rendered by
llama.cpp itself (llama_chat_apply_template). --chat-template-kwargs and models.toml's
`chat_template_kwargs` go to the template as variables (`{"enable_thinking": false}` turns thinking off).

Base models (gemma-3-270m) have no template: they get FALLBACK, a plain "User:/Assistant:" transcript that
a base model continues naturally, stopped at the next "\\nUser:". (llama-server would use ChatML there; a
base model knows no ChatML, and a transcript is what it continues well.)

A backend's template choice is its `chat_format` attribute (a ChatFormat, set by the loader); a backend
without one (the tests' fakes) uses its GGUF template and no kwargs.
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .backend import Backend
from .errors import SpecchatError, UserError
from .jinja_chat import CHATML_TEMPLATE, TemplateRenderError, compile_template, render_chat


class TemplateError(SpecchatError):
    """The chat template rejected the messages (one line, for the user)."""


FALLBACK_STOP = ["\nUser:", "\nAssistant:"]


@dataclass(frozen=True)
class ChatFormat:
    """How a target's conversations become text: a Jinja template, or one of llama.cpp's built-in ones by
    name, or neither (the fallback transcript), with the variables the template gets."""

    source: str | None = None  # Jinja text
    builtin: str | None = None  # a llama.cpp built-in template's name (rendered by llama.cpp)
    kwargs: Mapping[str, Any] = field(default_factory=dict)  # --chat-template-kwargs, parsed
    origin: str = "the model's GGUF"  # where the template came from, for messages

    @property
    def templated(self) -> bool:
        return bool(self.source or self.builtin)


@dataclass(frozen=True)
class Rendered:
    token_ids: list[int]
    stop: list[str]  # stop strings that go with this format
    templated: bool  # False = the fallback transcript format
    text: str = ""  # the prompt as text (a reasoning model's markers are read from its end)


# -- the user's choice: flags and models.toml --------------------------------------------------------------

def builtin_names() -> list[str]:
    """llama.cpp's built-in template names (llama_chat_builtin_templates), as `--chat-template` takes them."""
    import llama_cpp  # start-up: llama_cpp takes 0.4 s to import

    n = llama_cpp.llama_chat_builtin_templates(None, 0)
    names = (ctypes.c_char_p * max(n, 1))()
    n = llama_cpp.llama_chat_builtin_templates(names, n)
    return sorted(names[i].decode() for i in range(n))


def looks_like_jinja(text: str) -> bool:
    return "{{" in text or "{%" in text


def parse_kwargs(text: str, what: str = "--chat-template-kwargs") -> dict[str, Any]:
    """A JSON object, as llama.cpp's --chat-template-kwargs takes it."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{what}: not valid JSON ({e.msg} at character {e.pos + 1}); "
                        "give an object such as '{\"enable_thinking\": false}'") from None
    if not isinstance(value, dict):
        raise UserError(f"{what}: give a JSON object such as '{{\"enable_thinking\": false}}', not {text.strip()!r}")
    check_kwargs(value, what)
    return value


def check_kwargs(kwargs: Mapping[str, Any], what: str) -> None:
    # llama-server refuses a string enable_thinking ("expected boolean"): so does specchat, before loading
    if "enable_thinking" in kwargs and not isinstance(kwargs["enable_thinking"], bool):
        raise UserError(f"{what}: enable_thinking must be true or false, not {json.dumps(kwargs['enable_thinking'])}")


def template_from_text(text: str, what: str = "--chat-template") -> ChatFormat:
    """--chat-template: a llama.cpp built-in name, or Jinja text (checked for syntax here)."""
    name = text.strip()
    if not looks_like_jinja(text):
        if name == "chatml":  # llama-server --jinja renders `chatml` from its own Jinja source
            return ChatFormat(source=CHATML_TEMPLATE, origin=f"{what} chatml")
        known = builtin_names()
        if name not in known:
            raise UserError(f"{what} {name!r}: not one of llama.cpp's built-in templates ({', '.join(known)}) "
                            "and no Jinja ({{ }} / {% %}); give a name, Jinja text, or --chat-template-file")
        return ChatFormat(builtin=name, origin=f"{what} {name}")
    check_syntax(text, what)
    return ChatFormat(source=text, origin=what)


def template_from_file(path: str | Path, what: str = "--chat-template-file") -> ChatFormat:
    """--chat-template-file: a Jinja file, read whole, as llama.cpp reads it."""
    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{what} {path}: no such file") from None
    except IsADirectoryError:
        raise UserError(f"{what} {path}: a folder, not a template file") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{what} {path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at byte {e.start + 1})") from None
    except OSError as e:
        raise UserError(f"{what} {path}: cannot read it ({e.strerror})") from None
    if not text.strip():
        raise UserError(f"{what} {path}: the file is empty")
    check_syntax(text, f"{what} {path}")
    return ChatFormat(source=text, origin=f"{what} {path}")


def check_syntax(text: str, what: str) -> None:
    try:
        compile_template(text)
    except TemplateRenderError as e:
        raise UserError(f"{what}: not a valid Jinja template ({e})") from None


def choose_format(gguf_template: str | None, *, chosen: ChatFormat | None = None,
                  configured: ChatFormat | None = None, kwargs: Mapping[str, Any] | None = None,
                  configured_kwargs: Mapping[str, Any] | None = None) -> ChatFormat:
    """The flags' template, else models.toml's, else the GGUF's; models.toml's kwargs under the flag's."""
    base = chosen or configured or ChatFormat(source=gguf_template or None)
    merged = {**(configured_kwargs or {}), **(kwargs or {})}
    return ChatFormat(base.source, base.builtin, merged, base.origin)


def chat_format(backend: Backend) -> ChatFormat:
    """The backend's template choice (the loader sets it), or its GGUF's template."""
    chosen = getattr(backend, "chat_format", None)
    return chosen if chosen is not None else ChatFormat(source=backend.chat_template or None)


def has_template(backend: Backend) -> bool:
    return chat_format(backend).templated


# -- rendering ----------------------------------------------------------------------------------------------

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


def render_builtin(name: str, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
    """A llama.cpp built-in template, rendered by llama.cpp (llama_chat_apply_template)."""
    import llama_cpp  # start-up: llama_cpp takes 0.4 s to import

    keep = [(m["role"].encode("utf-8"), (m.get("content") or "").encode("utf-8")) for m in messages]
    chat = (llama_cpp.llama_chat_message * max(len(keep), 1))()
    for i, (role, content) in enumerate(keep):
        chat[i].role, chat[i].content = role, content
    size = 256 + 2 * sum(len(r) + len(c) for r, c in keep)
    for _ in range(2):
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_chat_apply_template(name.encode(), chat, len(keep), add_generation_prompt, buf, size)
        if n < 0:
            raise TemplateError(f"llama.cpp's built-in template {name!r} refused this conversation")
        if n <= size:
            return buf.raw[:n].decode("utf-8", "replace")
        size = n
    raise TemplateError(f"llama.cpp's built-in template {name!r} gave no text")


def render_text(backend: Backend, messages: Sequence[dict], add_generation_prompt: bool = True, *,
                enable_thinking: bool | None = None) -> str:
    """The conversation as text: the prompt llama.cpp renders for it, or the fallback transcript.
    `enable_thinking` None: llama.cpp's default (on where the template has thinking), unless the
    chat-template kwargs set it."""
    fmt = chat_format(backend)
    if fmt.builtin:
        return render_builtin(fmt.builtin, messages, add_generation_prompt)
    if not fmt.source:
        return render_fallback(messages, add_generation_prompt)
    vocab = backend.vocab
    try:
        return render_chat(fmt.source, messages, bos_token=backend.bos_text, eos_token=backend.eos_text,
                           add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking,
                           kwargs=fmt.kwargs, add_bos=vocab.add_bos, add_eos=vocab.add_eos)
    except TemplateRenderError as e:  # a template's raise_exception ("roles must alternate"), a Jinja error
        whose = "the model's chat template" if fmt.origin == "the model's GGUF" else f"the chat template ({fmt.origin})"
        raise TemplateError(f"{whose} refused this conversation: {e}") from None


def tokenize_rendered(backend: Backend, text: str) -> list[int]:
    """The ids of a whole rendered conversation. A template writes its special tokens as text, so they are
    parsed; the tokenizer adds BOS where the model wants one, as llama-server's does (the template's own
    leading BOS was cut from the text then). The fallback format is plain text and gets the tokenizer's BOS."""
    if has_template(backend):
        return backend.tokenize(text, add_special=True, parse_special=True)
    return backend.tokenize(text, add_special=True)


def render(backend: Backend, messages: Sequence[dict], add_generation_prompt: bool = True) -> Rendered:
    text = render_text(backend, messages, add_generation_prompt)
    templated = has_template(backend)
    return Rendered(tokenize_rendered(backend, text), [] if templated else list(FALLBACK_STOP), templated, text)
