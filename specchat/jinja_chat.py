"""Chat templates rendered as llama.cpp renders them (llama-server --jinja, POST /apply-template).

llama.cpp is the reference: a GGUF's template was written for Python's Jinja, but what a model served by
llama.cpp sees is what llama.cpp's own engine (common/jinja) makes of it, with the inputs and workarounds
of common/chat.cpp. This module gives a template exactly those inputs, in Python's Jinja:

- the variables: `messages`, `bos_token` / `eos_token` (the model's token texts), `enable_thinking`
  (always set), `add_generation_prompt` (set only when true: absent otherwise, as llama.cpp leaves it),
  `datetime` ("%b %d %Y") and `date_string` ("%d %b %Y"), then the chat-template kwargs over all of them
  (`preserve_reasoning` true unless they say otherwise, as llama.cpp's --reasoning-preserve default: it
  also sets preserve_thinking, and clear_thinking / truncate_history_thinking / drop_thinking false);
  `tools` stays undefined when there are none, so a tool-use template loops over nothing;
- the functions and filters: `raise_exception`, `strftime_now` (local time, as llama.cpp's), `tojson`
  without HTML escaping, `{% generation %}` blocks as plain text;
- the message rewrites: content always a string ("" when empty) and, for a template that only reads
  typed content, a list of text parts; `reasoning_content` when the turn has a thought (gpt-oss and LFM2
  read it as `thinking`, Ministral 3 as a "thinking" part); a system message folded into the first user
  turn ("system\\nuser") where the template ignores the system role, dropped where it stands alone;
  StepFun's contents trimmed; the two source patches llama.cpp applies (gpt-oss, Mistral [TOOL_CALLS]);
- the output rules: a leading BOS cut when the model adds its own, a trailing EOS when it adds that;
  gpt-oss's last "<|return|>" made "<|end|>" when no generation prompt follows.

Which roles and content shapes a template reads is found the way llama.cpp finds it (common/jinja/caps.cpp):
render probe conversations and watch which fields the template reads. The thinking default is llama.cpp's
too: on where its dedicated handler says so, else where its template analysis finds reasoning markers
(simplified here; see supports_thinking).

Kept out (tested nowhere here, so not claimed): tool calls and tool results in the history, tool lists,
continuing a final assistant message, media parts.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

# llama.cpp's template when a model has none and `chatml` is asked for by name (common/chat.cpp)
CHATML_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "  {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "  {{- '<|im_start|>assistant\n' -}}\n"
    "{%- endif -%}"
)

# Source patches llama.cpp applies before parsing (common_chat_templates_init): each disables a check that
# refuses conversations llama.cpp sends.
_SOURCE_PATCHES = (
    ("<|channel|>", "in message.content or",
     "{%- if \"<|channel|>analysis<|message|>\" in message.content or "
     "\"<|channel|>final<|message|>\" in message.content %}",
     "{%- if false %}"),
    ("[TOOL_CALLS]", "if (message['content'] is none or",
     "{%- if (message['content'] is none or message['content'] == '' or "
     "message['content']|length == 0) and (message['tool_calls'] is not defined or "
     "message['tool_calls'] is none or message['tool_calls']|length == 0) %}",
     "{%- if false %}"),
)


class TemplateRenderError(Exception):
    """The template raised (raise_exception, a Jinja error); the message is llama.cpp-like, one line."""


@dataclass(frozen=True)
class Caps:
    """What a template reads, found by probing it as llama.cpp does (common/jinja/caps.cpp)."""

    system_role: bool = True
    string_content: bool = True
    typed_content: bool = False


def patch_source(source: str) -> str:
    for marker, needle, old, new in _SOURCE_PATCHES:
        if marker in source and needle in source:
            source = source.replace(old, new)
    return source


# -- the Jinja environment ------------------------------------------------------------------------------

def _raise_exception(message: str):
    raise TemplateRenderError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, separators=None, sort_keys: bool = False):
    # llama.cpp's tojson: ", " between items without indent, "," with; ": " after keys; no HTML escaping
    item_sep = (separators[0] if separators else None) or ("," if indent is not None else ", ")
    key_sep = separators[1] if separators and len(separators) > 1 else ": "
    return json.dumps(_plain(value), indent=indent, ensure_ascii=ensure_ascii, separators=(item_sep, key_sep),
                      sort_keys=sort_keys)


def _plain(value: Any) -> Any:
    """The probes' watched values as plain ones, read without being recorded as read."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in dict.items(value)}
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, str):
        return str(value)
    return value


@lru_cache(maxsize=1)
def _environment():
    import jinja2  # start-up: jinja2 and its sandbox take 0.1 s to import; only a template render needs them
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import SandboxedEnvironment

    class GenerationBlocks(Extension):
        """`{% generation %}...{% endgeneration %}` (HF's mask for training) renders its body, as in llama.cpp."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    class LlamaUndefined(jinja2.ChainableUndefined):
        """llama.cpp's undefined: a member or item of it is undefined again, and it joins a string as ""."""

    class LlamaEnvironment(SandboxedEnvironment):  # lists may grow (append, pop), as in llama.cpp
        intercepted_binops = frozenset({"+"})

        def call_binop(self, context, operator, left, right):
            # llama.cpp: a string + none / undefined (either side) is the string (workaround_concat_null_with_str)
            if operator == "+":
                if isinstance(left, str) and (right is None or isinstance(right, jinja2.Undefined)):
                    return left
                if isinstance(right, str) and (left is None or isinstance(left, jinja2.Undefined)):
                    return right
            return super().call_binop(context, operator, left, right)

    env = LlamaEnvironment(
        loader=jinja2.BaseLoader(), trim_blocks=True, lstrip_blocks=True, undefined=LlamaUndefined,
        extensions=["jinja2.ext.loopcontrols", "jinja2.ext.do", GenerationBlocks],
    )
    env.globals["raise_exception"] = _raise_exception
    env.filters["tojson"] = _tojson
    # the probes' watched contents record a type test and a selectattr, as llama.cpp's stats do
    is_string = env.tests["string"]
    selectattr = env.filters["selectattr"]

    def watched_is_string(value):
        if isinstance(value, (_WatchedStr, _WatchedList)):
            value.ops.add("test_is_string")
        return is_string(value)

    @jinja2.pass_context
    def watched_selectattr(context, value, *args, **kwargs):
        if isinstance(value, (_WatchedStr, _WatchedList)):
            value.ops.add("selectattr")
        return selectattr(context, value, *args, **kwargs)

    env.tests["string"] = watched_is_string
    env.filters["selectattr"] = watched_selectattr
    return env


@lru_cache(maxsize=64)
def _compile(source: str):
    return _environment().from_string(source)


def compile_template(source: str):
    """The parsed template; a syntax error becomes TemplateRenderError."""
    import jinja2  # start-up: see _environment

    try:
        return _compile(patch_source(source))
    except jinja2.TemplateSyntaxError as e:
        raise TemplateRenderError(f"line {e.lineno}: {e.message}") from None


def _execute(source: str, variables: Mapping[str, Any], now: _dt.datetime) -> str:
    import jinja2  # start-up: see _environment

    template = compile_template(source)
    variables = dict(variables)
    variables.setdefault("strftime_now", lambda fmt: now.strftime(fmt))
    try:
        return template.render(**variables)
    except TemplateRenderError:
        raise
    except jinja2.TemplateError as e:
        raise TemplateRenderError(str(e)) from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError) as e:
        raise TemplateRenderError(f"{type(e).__name__}: {e}") from None


# -- capability probes (common/jinja/caps.cpp) -----------------------------------------------------------

class _WatchedDict(dict):
    """A message that records which of its fields the template reads."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.read: set[str] = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)


class _WatchedStr(str):
    """A string content that records being indexed or iterated as a list would be. Iterating fails, as
    llama.cpp's `for` over a string does."""

    def __new__(cls, text: str):
        watched = super().__new__(cls, text)
        watched.ops = set()
        return watched

    def __getitem__(self, index):
        if isinstance(index, (int, bool)):
            self.ops.add("array_access")
        return str.__getitem__(self, index)

    def __iter__(self):
        self.ops.add("array_access")
        raise TypeError("Expected iterable or object type in for loop: got String")


class _WatchedList(list):
    """A list content that records being indexed or iterated."""

    def __init__(self, *args):
        super().__init__(*args)
        self.ops: set[str] = set()

    def __getitem__(self, index):
        self.ops.add("array_access")
        return list.__getitem__(self, index)

    def __iter__(self):
        self.ops.add("array_access")
        return list.__iter__(self)


def _probe(source: str, messages: list) -> tuple[bool, str]:
    variables = {"messages": messages, "tools": [], "bos_token": "", "eos_token": "", "add_generation_prompt": True}
    try:
        return True, _execute(source, variables, _dt.datetime.now())
    except TemplateRenderError:
        return False, ""


@lru_cache(maxsize=64)
def template_caps(source: str) -> Caps:
    """System role and content shapes as llama.cpp's caps_get finds them."""
    string_content, typed_content = True, False
    marker = _WatchedStr("STRING_MARKER")
    ok, out = _probe(source, [_WatchedDict(role="user", content=marker)])
    checks_for_string = "test_is_string" in marker.ops
    as_array = bool(marker.ops & {"selectattr", "array_access"})
    if as_array:
        typed_content = True
    if not ok or (as_array and "STRING_MARKER" not in out):
        string_content = False
    if checks_for_string:
        parts = _WatchedList()
        ok, _ = _probe(source, [_WatchedDict(role="user", content=parts)])
        if ok and parts.ops & {"selectattr", "array_access"}:
            typed_content = True

    system = _WatchedDict(role="system", content="System message")
    _probe(source, [system, _WatchedDict(role="user", content="User message")])
    return Caps(system_role="content" in system.read, string_content=string_content, typed_content=typed_content)


# -- messages as llama.cpp hands them over ----------------------------------------------------------------

def oaicompat_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    """specchat's messages as common_chat_msg::to_json_oaicompat writes them: role, content ("" when
    empty), reasoning_content only when there is a thought."""
    out = []
    for m in messages:
        msg = {"role": m["role"], "content": m.get("content") or ""}
        if m.get("reasoning_content"):
            msg["reasoning_content"] = m["reasoning_content"]
        out.append(msg)
    return out


def _normalize_content(messages: list[dict], caps: Caps) -> list[dict]:
    if caps.typed_content and not caps.string_content:
        return [{**m, "content": [{"type": "text", "text": m["content"]}]} if isinstance(m.get("content"), str) else m
                for m in messages]
    return messages


def _fold_system(messages: list[dict]) -> list[dict]:
    """llama.cpp's system_message_not_supported: the system text joins the next message with a newline."""
    if messages and messages[0]["role"] == "system":
        if len(messages) > 1:
            second = dict(messages[1])
            second["content"] = f"{messages[0]['content']}\n{second['content']}"
            return [second, *messages[2:]]
        return messages[1:]
    return messages


def specialized_handler(source: str) -> str | None:
    """Which of llama.cpp's dedicated template handlers takes this template, tested in its order
    (common_chat_try_specialized_template); None: its generic analysis does."""
    def has(*needles: str) -> bool:
        return all(n in source for n in needles)

    if has("[SYSTEM_PROMPT]", "[TOOL_CALLS]", "[ARGS]") and "[CALL_ID]" not in source:
        return "ministral3"
    if has("<|channel|>"):
        return "gpt-oss"
    if has("<atem:function_calls>", "<|eom|>"):
        return "muse-glimmer"
    if has(">>>all", ">>>${recipient}"):
        return "functionary-v3.2"
    if has("<|tool_calls_section_begin|>", "<|tool_call_begin|>"):
        return "kimi-k2"
    if has("<|open|>", "<|close|>", "<|end_of_msg|>"):
        return "kimi-k3"
    if has("<role>ASSISTANT</role>", "<arg_key>"):
        return "ling3"
    if has("<|START_TEXT|>", "<|START_ACTION|>"):
        return "cohere2moe"
    if has("<|tool_list_start|>", "<|tool_list_end|>"):
        return "lfm2"
    if has("List of tools: [") and "<|tool_list_start|>" not in source:
        return "lfm2.5"
    if has("<|role_sep|>", "<|message_sep|>") and "<|function_call|>" not in source:
        return "gigachat-v3"
    if has("]<]minimax[>[", "<tool_call>", "<invoke name="):
        return "minimax-m3"
    if has("dsml_token", "DSML") and ("function_calls" in source or "tool_calls" in source):
        return "deepseek-v3.2"
    if has("'<|tool_call>call:'"):
        return "gemma4"
    if has("Tool usage guidelines:", '<function name="', '<param name="'):
        return "minicpm5"
    if has("<tool_call>", "<function=", "<parameter=") and "'<tool_call><function=' ~ tool_call.name ~ '>'" not in source:
        return "qwen3-coder"
    return None


# whether each dedicated handler says the template thinks (data.supports_thinking in common/parsers/*.cpp)
_HANDLER_THINKS = {"ministral3": True, "gpt-oss": True, "muse-glimmer": True, "functionary-v3.2": False,
                   "kimi-k2": True, "kimi-k3": True, "ling3": True, "cohere2moe": True, "lfm2": True, "lfm2.5": True,
                   "gigachat-v3": False, "minimax-m3": True, "deepseek-v3.2": True, "gemma4": True, "minicpm5": True}


def _is_gpt_oss(source: str) -> bool:
    return "<|channel|>" in source


def _is_stepfun(source: str) -> bool:
    return "You have access to the following functions in JSONSchema format" in source


def _messages_override(source: str, messages: list[dict]) -> list[dict] | None:
    """The specialised handlers that hand the template their own messages (common/parsers/*.cpp)."""
    handler = specialized_handler(source)
    if handler == "ministral3":
        out = []
        for m in messages:
            if m["role"] not in ("system", "assistant"):
                out.append(m)
                continue
            content = []
            if isinstance(m.get("reasoning_content"), str):
                content.append({"type": "thinking", "thinking": m["reasoning_content"]})
            if isinstance(m.get("content"), str):
                content.append({"type": "text", "text": m["content"]})
            elif isinstance(m.get("content"), list):
                content.extend(m["content"])
            adjusted = {k: v for k, v in m.items() if k != "reasoning_content"}
            adjusted["content"] = content
            out.append(adjusted)
        return out
    if handler in ("gpt-oss", "lfm2", "lfm2.5"):
        return [{**m, "thinking": m["reasoning_content"]} if isinstance(m.get("reasoning_content"), str) else m
                for m in messages]
    return None


# -- rendering --------------------------------------------------------------------------------------------

def _variables(messages: list, *, bos_token: str, eos_token: str, enable_thinking: bool, add_generation_prompt: bool,
               kwargs: Mapping[str, Any], now: _dt.datetime) -> dict:
    variables: dict[str, Any] = {"messages": messages, "bos_token": bos_token, "eos_token": eos_token,
                                 "enable_thinking": enable_thinking,
                                 "datetime": now.strftime("%b %d %Y"), "date_string": now.strftime("%d %b %Y")}
    variables.update(kwargs)
    if add_generation_prompt:
        variables["add_generation_prompt"] = True
    if isinstance(variables.get("preserve_reasoning"), bool):
        keep = variables["preserve_reasoning"]
        variables.update(preserve_thinking=keep, clear_thinking=not keep, truncate_history_thinking=not keep,
                         drop_thinking=not keep)
    if isinstance(variables.get("reasoning_effort"), str) and variables["reasoning_effort"]:
        variables["reasoning_strength"] = variables["reasoning_effort"]
    return variables


def render_chat(source: str, messages: Sequence[Mapping[str, Any]], *, bos_token: str = "", eos_token: str = "",
                add_generation_prompt: bool = True, enable_thinking: bool | None = None,
                kwargs: Mapping[str, Any] | None = None, add_bos: bool = False, add_eos: bool = False,
                now: _dt.datetime | None = None) -> str:
    """The prompt llama.cpp renders for `messages` with this template source.

    `enable_thinking` None is llama.cpp's default (on where the template supports thinking); `kwargs` are
    --chat-template-kwargs, already parsed (an `enable_thinking` among them wins, as in llama-server);
    `add_bos` / `add_eos`: whether the model's tokenizer adds them itself (then llama.cpp cuts the
    template's own copy from the text)."""
    # llama.cpp keeps earlier turns' thoughts unless told not to (--reasoning-preserve is on by default:
    # preserve_reasoning true, and so clear_thinking / drop_thinking false)
    kwargs = {"preserve_reasoning": True, **(kwargs or {})}
    if isinstance(kwargs.get("enable_thinking"), bool):
        enable_thinking = kwargs["enable_thinking"]
    if enable_thinking is None:
        enable_thinking = supports_thinking(source, bos_token, eos_token)
    now = now or _dt.datetime.now()
    source = patch_source(source)
    caps = template_caps(source)
    msgs = oaicompat_messages(messages)
    if _is_stepfun(source):
        msgs = [{**m, "content": m["content"].strip(), **({"reasoning_content": m["reasoning_content"].strip()}
                                                          if "reasoning_content" in m else {})} for m in msgs]
    if not _is_gpt_oss(source):
        msgs = [{**m, "role": "system"} if m["role"] == "developer" else m for m in msgs]
    msgs = _normalize_content(msgs, caps)
    if not caps.system_role:
        msgs = _fold_system(msgs)
    override = _messages_override(source, msgs)
    variables = _variables(override if override is not None else msgs, bos_token=bos_token, eos_token=eos_token,
                           enable_thinking=enable_thinking, add_generation_prompt=add_generation_prompt,
                           kwargs=kwargs, now=now)
    text = _execute(source, variables, now)
    if add_bos and bos_token and text.startswith(bos_token):
        text = text[len(bos_token):]
    if add_eos and eos_token and text.endswith(eos_token):
        text = text[: -len(eos_token)]
    if _is_gpt_oss(source) and not add_generation_prompt:
        at = text.rfind("<|return|>")
        if at >= 0:
            text = text[:at] + "<|end|>" + text[at + len("<|return|>"):]
    return text


_MARKER_RE = re.compile(r"<[^<>]*>|\[[^\[\]]*\]")


def _segments(text: str) -> list[str]:
    """Text cut into markers (<...>, [...]) and the text between them (chat-auto-parser-helpers.cpp)."""
    out, at = [], 0
    for m in _MARKER_RE.finditer(text):
        if m.start() > at:
            out.append(text[at:m.start()])
        out.append(m.group())
        at = m.end()
    if at < len(text):
        out.append(text[at:])
    return out


def _diff(a: str, b: str) -> tuple[str, str]:
    """What differs between two renderings once their common leading and trailing segments are cut."""
    sa, sb = _segments(a), _segments(b)
    i = 0
    while i < min(len(sa), len(sb)) and sa[i] == sb[i]:
        i += 1
    j = 0
    while j < min(len(sa), len(sb)) - i and sa[-1 - j] == sb[-1 - j]:
        j += 1
    return "".join(sa[i:len(sa) - j]), "".join(sb[i:len(sb) - j])


@lru_cache(maxsize=64)
def supports_thinking(source: str, bos_token: str = "", eos_token: str = "") -> bool:
    """llama.cpp's default for enable_thinking: on where its template analysis finds reasoning markers
    (common/chat-diff-analyzer.cpp, simplified): a thought in the history rendered between markers, or
    thinking on / off changing the end of the generation prompt (a <think> opened, or closed at once)."""
    patched = patch_source(source)
    if ("content.split('</think>')" in patched and "reasoning_content" not in patched
            and "<SPECIAL_12>" not in patched):  # llama.cpp's patch for the old Qwen / DeepSeek templates
        return True
    handler = specialized_handler(patched)
    if handler in _HANDLER_THINKS:
        return _HANDLER_THINKS[handler]
    if handler == "qwen3-coder":
        return "<think>" in patched

    def text(messages, thinking, generation):
        return render_chat(source, messages, bos_token=bos_token, eos_token=eos_token, enable_thinking=thinking,
                           add_generation_prompt=generation, kwargs={"enable_thinking": thinking})

    user = {"role": "user", "content": "U_USER_MSG Hello END_U"}
    answer = {"role": "assistant", "content": "A_ASST_MSG I can help END_A"}
    thought = "REASON_PART I am thinking END_R"
    try:
        with_thought = text([user, {**answer, "reasoning_content": thought}], True, False)
        if thought in with_thought:
            after = with_thought[with_thought.index(thought) + len(thought):].lstrip()
            if _MARKER_RE.match(after):
                return True
        off, on = text([user], False, True), text([user], True, True)
    except TemplateRenderError:
        return False
    left, right = _diff(off, on)
    if not left.strip() and right.strip():
        return on.endswith(right.strip())
    if not right.strip() and left.strip():
        return off.endswith(left.strip())
    if left.strip() and right.strip():  # one generation prompt is the other's plus two markers
        for base, extended in ((on, off), (off, on)):
            anchor = base[-64:]
            at = extended.rfind(anchor)
            if at < 0 or at + len(anchor) >= len(extended):
                continue
            extra = [seg for seg in _segments(extended[at + len(anchor):].strip()) if seg.strip()]
            if len(extra) == 2 and all(_MARKER_RE.fullmatch(seg) for seg in extra):
                return True
    return False
