"""Prompts exactly as llama.cpp renders them (issue 53), and the chat-template flags.

tests/reference/llamacpp_prompts.MODEL.json hold what llama-server answered (POST /apply-template) for
every template the vendored llama.cpp ships, issue 53's three conversations, one of awkward text and an
ended history without a generation prompt (what resuming a transcript renders),
thinking on / off / left to llama.cpp,
with two models' BOS/EOS texts (SmolLM2: BOS not added by the tokenizer; Gemma 3: added, so llama.cpp cuts
a template's leading BOS). tests/reference/record_templates.py wrote them and reruns against a llama-server
build. Here specchat renders the same inputs (the same BOS/EOS texts, the same date) and must give the same
prompt, with no llama.cpp running. Where llama.cpp itself refuses a conversation, specchat is only asked
not to crash.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest
from fakes import FakeBackend, assert_user_error

from specchat.jinja_chat import TemplateRenderError, render_chat, supports_thinking, template_caps
from specchat.template import ChatFormat, render_text

REFERENCE = Path(__file__).resolve().parent / "reference"
RECORDINGS = {data["model"]: data for data in (json.loads(p.read_text(encoding="utf-8"))
                                                 for p in sorted(REFERENCE.glob("llamacpp_prompts.*.json")))}

# Cases where specchat's prompt differs from llama.cpp's, each with why. Keep this short.
EXCEPTIONS: dict[str, str] = {}


def template(name: str) -> str:
    return (REFERENCE / "templates" / f"{name}.jinja").read_text(encoding="utf-8")


def render_like_recording(model: str, name: str, case: str) -> str:
    data = RECORDINGS[model]
    conversation, mode = case.split("/")
    recorded_on = datetime.datetime.combine(datetime.date.fromisoformat(data["date"]), datetime.time(12))
    return render_chat(template(name), data["conversations"][conversation], bos_token=data["bos_token"],
                       eos_token=data["eos_token"], kwargs=data["thinking"][mode], add_bos=data["add_bos"],
                       add_eos=data["add_eos"], now=recorded_on,
                       add_generation_prompt=conversation not in data["no_generation_prompt"])


CASES = [(model, name, case) for model, data in RECORDINGS.items()
         for name, per_template in sorted(data["results"].items()) for case in per_template]


def test_every_vendored_template_was_recorded():
    names = {p.stem for p in (REFERENCE / "templates").glob("*.jinja")}
    assert len(names) >= 70 and {"smollm2-135m", "gemma-3-270m"} <= set(RECORDINGS)
    assert RECORDINGS["gemma-3-270m"]["add_bos"] and not RECORDINGS["smollm2-135m"]["add_bos"]
    # llama-server's split of given replies into reasoning_content / content, kept for parsing thoughts later
    assert set(RECORDINGS["smollm2-135m"]["reasoning_split"]) == names
    for data in RECORDINGS.values():
        assert set(data["results"]) == names
        assert all("server_error" not in answers for answers in data["results"].values())


@pytest.mark.parametrize(("model", "name", "case"), CASES, ids=[f"{m}:{n}:{c}" for m, n, c in CASES])
def test_prompt_equals_llamacpp(model, name, case):
    answer = RECORDINGS[model]["results"][name][case]
    if "error" in answer:  # llama.cpp refuses this one; specchat may render it or refuse it, cleanly
        try:
            render_like_recording(model, name, case)
        except TemplateRenderError:
            pass
        return
    why = EXCEPTIONS.get(f"{name}:{case}") or EXCEPTIONS.get(name)
    if why:
        pytest.skip(why)
    assert render_like_recording(model, name, case) == answer["prompt"]


def test_no_template_llamacpp_renders_is_refused():
    refused = []
    for model, name, case in CASES:
        if "prompt" in RECORDINGS[model]["results"][name][case]:
            try:
                render_like_recording(model, name, case)
            except TemplateRenderError as e:
                refused.append(f"{model}:{name}:{case}: {e}")
    assert refused == []


def test_tool_use_templates_render_without_tools():
    """Hermes 2 Pro's tool-use template loops over `tools`: llama.cpp leaves it undefined when there are
    none (llama-cpp-python's formatter passed None, and the template failed on it)."""
    text = render_chat(template("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use"), [{"role": "user", "content": "hi"}],
                       bos_token="<s>", eos_token="</s>")
    assert text.endswith("<|im_start|>assistant\n") and "hi" in text


def test_a_system_message_folds_into_the_first_user_turn_where_the_template_refuses_it():
    gemma2 = template("google-gemma-2-2b-it")
    assert not template_caps(gemma2).system_role
    text = render_chat(gemma2, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                       bos_token="<bos>", eos_token="<eos>")
    assert "<start_of_turn>user\nBe brief.\nHi<end_of_turn>" in text


def test_thinking_default_is_on_where_the_template_has_it():
    assert supports_thinking(template("Qwen-Qwen3-0.6B"))
    assert not supports_thinking(template("Qwen-Qwen2.5-7B-Instruct"))


def test_kwargs_reach_the_template_and_enable_thinking_among_them_wins():
    qwen3 = template("Qwen-Qwen3-0.6B")
    messages = [{"role": "user", "content": "hi"}]
    off = render_chat(qwen3, messages, kwargs={"enable_thinking": False})
    assert off.endswith("<think>\n\n</think>\n\n")
    assert render_chat(qwen3, messages, enable_thinking=True, kwargs={"enable_thinking": False}) == off
    assert render_chat("{{ greeting }}", messages, kwargs={"greeting": "hello"}) == "hello"


def test_a_backend_renders_with_its_chosen_format():
    target = FakeBackend(lambda ids: None, 8, chat_template="{{ 'gguf' }}")
    target.bos_text = target.eos_text = ""
    assert render_text(target, [{"role": "user", "content": "x"}]) == "gguf"
    target.chat_format = ChatFormat(source="{{ messages[0].content }}{{ suffix }}", kwargs={"suffix": "!"})
    assert render_text(target, [{"role": "user", "content": "x"}]) == "x!"


# --- the flags: a mistake is one line, exit code 2 -----------------------------------------------------------


def test_bad_json_in_chat_template_kwargs(cli, tmp_path):
    assert_user_error(cli("prompt", "hi", "--chat-template-kwargs", "{enable_thinking: false}", home=tmp_path),
                      "--chat-template-kwargs", "not valid JSON")


def test_chat_template_kwargs_must_be_an_object(cli, tmp_path):
    assert_user_error(cli("prompt", "hi", "--chat-template-kwargs", "[1, 2]", home=tmp_path),
                      "--chat-template-kwargs", "JSON object")


def test_enable_thinking_must_be_a_boolean(cli, tmp_path):
    assert_user_error(cli("prompt", "hi", "--chat-template-kwargs", '{"enable_thinking": "no"}', home=tmp_path),
                      "enable_thinking must be true or false")


def test_missing_chat_template_file(cli, tmp_path):
    assert_user_error(cli("prompt", "hi", "--chat-template-file", str(tmp_path / "nope.jinja"), home=tmp_path),
                      "--chat-template-file", "nope.jinja", "no such file")


def test_unknown_built_in_template_name(cli, tmp_path):
    assert_user_error(cli("prompt", "hi", "--chat-template", "no-such-template", home=tmp_path),
                      "--chat-template", "no-such-template", "chatml")


def test_broken_jinja_in_chat_template(cli, tmp_path):
    assert_user_error(cli("prompt", "hi", "--chat-template", "{% for m in messages %}", home=tmp_path),
                      "--chat-template", "not a valid Jinja template")


def test_template_and_template_file_together(cli, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ 'x' }}")
    assert_user_error(cli("prompt", "hi", "--chat-template", "chatml", "--chat-template-file", str(path), home=tmp_path),
                      "not both")


def test_models_toml_chat_template_keys(tmp_path):
    from specchat.config import load_config

    (tmp_path / "t.jinja").write_text("{{ 'x' }}")
    toml = tmp_path / "m.toml"
    toml.write_text('[models.mine]\npath = "a.gguf"\nchat_template_file = "t.jinja"\n'
                    'chat_template_kwargs = { enable_thinking = false }\n')
    spec = load_config(toml).model("mine")
    assert spec.chat_template_file == str(tmp_path / "t.jinja")
    assert spec.chat_template_kwargs == {"enable_thinking": False}


def test_models_toml_bad_chat_template_kwargs(cli, tmp_path):
    toml = tmp_path / "bad.toml"
    toml.write_text('[models.mine]\npath = "a.gguf"\nchat_template_kwargs = "{nope"\n')
    assert_user_error(cli("prompt", "hi", home=tmp_path, env={"SPECCHAT_CONFIG": str(toml)}),
                      "bad.toml:3", "chat_template_kwargs", "not valid JSON")


def test_models_toml_template_and_template_file_together_is_an_error(tmp_path):
    from specchat.config import ConfigError, load_config

    toml = tmp_path / "m.toml"
    toml.write_text('[models.mine]\npath = "a.gguf"\nchat_template = "chatml"\nchat_template_file = "t.jinja"\n')
    with pytest.raises(ConfigError, match="m.toml:4: .*not both"):
        load_config(toml)


def test_the_flags_win_over_models_toml_which_wins_over_the_gguf(tmp_path):
    from specchat.config import ModelSpec
    from specchat.loader import LoadOptions, target_format
    from specchat.template import template_from_text

    target = FakeBackend(lambda ids: None, 8, chat_template="{{ 'gguf' }}")
    spec = ModelSpec("m", "path", "m.gguf", chat_template="{{ 'toml' }}", chat_template_kwargs={"a": 1, "b": 1})
    assert target_format(target, ModelSpec("m", "path", "m.gguf"), LoadOptions()).source == "{{ 'gguf' }}"
    assert target_format(target, spec, LoadOptions()).source == "{{ 'toml' }}"
    chosen = target_format(target, spec, LoadOptions(chat_template=template_from_text("{{ 'flag' }}"),
                                                     chat_template_kwargs={"b": 2}))
    assert chosen.source == "{{ 'flag' }}" and chosen.kwargs == {"a": 1, "b": 2}


def test_a_built_in_name_is_rendered_by_llamacpp():
    from specchat.template import render_builtin, template_from_text

    assert template_from_text("llama3").builtin == "llama3"
    assert template_from_text("chatml").source  # llama-server --jinja's own ChatML source
    text = render_builtin("llama3", [{"role": "user", "content": "hi"}])
    assert text == "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
