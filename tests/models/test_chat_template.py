"""render_chat against transformers' apply_chat_template(..., tokenize=False), the renderer it
reproduces: SmolLM2-135M-Instruct's published ChatML template, and a template that uses every
thing transformers adds to jinja (loop controls, its tojson, raise_exception, strftime_now,
{% generation %}, bos/eos tokens, tools, documents, content parts, tool calls, reasoning).
transformers runs offline on a tokenizer built in memory; nothing needs the network."""
from __future__ import annotations

import functools
import os
from datetime import datetime

import pytest

from kvjax.models import tokenizer as tokmod
from kvjax.models.tokenizer import ChatTemplateError, render_chat

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# SmolLM2-135M-Instruct's chat template, as published (the GGUF's tokenizer.chat_template).
SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
           "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
           "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
           "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
           "{% endif %}")

# Block tags on their own indented lines, so trim_blocks and lstrip_blocks decide the whitespace.
FEATURES = """{{ bos_token }}{% if tools %}
<tools>
{% for tool in tools %}
{{ tool | tojson(indent=2, sort_keys=true) }}
{% endfor %}
</tools>
{% endif %}
{% if documents %}
    {% for d in documents %}
<doc title={{ d.title | tojson }}>{{ d.text }}</doc>
    {% endfor %}
{% endif %}
Today: {{ strftime_now("%d %B %Y") }} {{ mode | default("plain") }}
{% for message in messages %}
    {% if message.role not in ['system', 'user', 'assistant', 'tool'] %}
        {{ raise_exception("Unknown role: " + message.role) }}
    {% endif %}
    {% if message.role == 'system' and not loop.first %}
        {% continue %}
    {% endif %}
<|{{ message.role }}|>
    {% if message.content is string %}
{{ message.content }}
    {% elif message.content is defined %}
        {% for part in message.content %}
            {% if part.type != 'text' %}{% continue %}{% endif %}
{{ part.text }}
        {% endfor %}
    {% endif %}
    {% if message.thinking is defined %}
<think>{{ message.thinking }}</think>
    {% endif %}
    {% for call in message.tool_calls | default([]) %}
<call>{{ call.function | tojson(separators=(',', ':')) }}</call>
    {% endfor %}
    {% if message.role == 'assistant' %}
{% generation %}{{ eos_token }}{% endgeneration %}

    {% endif %}
    {% if message.stop is defined %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}"""

TOKENS = dict(bos_token="<s>", eos_token="</s>")

SMOLLM2_CHATS = {
    "system+user": [{"role": "system", "content": "You answer in one word."},
                    {"role": "user", "content": "Name a primary color."}],
    "user only": [{"role": "user", "content": "What is the capital of France?"}],
    "multi-turn": [{"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": "Hello! How can I help?"},
                   {"role": "user", "content": "Tell me a joke."},
                   {"role": "assistant", "content": "Why did the GPU cross the bus?"},
                   {"role": "user", "content": "Why?"}],
    "non-ascii and quotes": [{"role": "system", "content": "Réponds en français, s'il te plaît."},
                             {"role": "user", "content": 'Say "naïve" — and \'café\', 東京, 🙂 <b>&amp;</b>'}],
    "ends with assistant": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
    "whitespace kept": [{"role": "user", "content": "  line one\n\n\tline two  \n"}],
}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Température en °C, \"now\" <b>",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

FEATURE_CHATS = {
    "tools and tool calls": dict(
        messages=[{"role": "user", "content": "Weather in Zürich?"},
                  {"role": "assistant", "content": None,
                   "tool_calls": [{"type": "function",
                                   "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
                  {"role": "tool", "content": '{"temp": 21, "unit": "°C"}'}],
        tools=[WEATHER]),
    "documents and content parts": dict(
        messages=[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Summarize: "},
                                               {"type": "text", "text": "the doc «A»"}]}],
        documents=[{"title": 'The "A" doc', "text": "Ünïcödé body"}]),
    "late system skipped, stop breaks": dict(
        messages=[{"role": "system", "content": "First."}, {"role": "user", "content": "a"},
                  {"role": "system", "content": "Ignored."}, {"role": "user", "content": "b", "stop": True},
                  {"role": "user", "content": "never rendered"}]),
    "reasoning aliased": dict(
        messages=[{"role": "user", "content": "Think."},
                  {"role": "assistant", "content": "Done.", "reasoning_content": "Let me see…"}]),
    "extra variable": dict(messages=[{"role": "user", "content": "x"}], mode="thinking"),
}


@functools.cache
def _hf_tokenizer():
    """The smallest transformers tokenizer (a word-level vocabulary of three tokens, built in
    memory): apply_chat_template needs one and fills bos_token/eos_token from it."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, **TOKENS)


def _transformers(template, messages, **kwargs):
    return _hf_tokenizer().apply_chat_template(messages, chat_template=template, tokenize=False, **kwargs)


@pytest.fixture
def fixed_clock(monkeypatch):
    """strftime_now reads the same instant in kvjax and in transformers (where installed)."""

    class Clock(datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime(2026, 12, 1, 9, 30)

    monkeypatch.setattr(tokmod, "datetime", Clock)
    try:
        import transformers.utils.chat_template_utils as hf_chat
    except ImportError:
        return
    monkeypatch.setattr(hf_chat, "datetime", Clock)


def test_smollm2_user_only_gets_the_default_system_prompt():
    assert render_chat(SMOLLM2, SMOLLM2_CHATS["user only"]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", list(SMOLLM2_CHATS))
def test_smollm2_matches_transformers(name, add_generation_prompt):
    messages = SMOLLM2_CHATS[name]
    want = _transformers(SMOLLM2, messages, add_generation_prompt=add_generation_prompt)
    assert render_chat(SMOLLM2, messages, add_generation_prompt=add_generation_prompt, **TOKENS) == want


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", list(FEATURE_CHATS))
def test_feature_template_matches_transformers(name, add_generation_prompt, fixed_clock):
    case = dict(FEATURE_CHATS[name])
    messages = case.pop("messages")
    want = _transformers(FEATURES, messages, add_generation_prompt=add_generation_prompt, **case)
    got = render_chat(FEATURES, messages, add_generation_prompt=add_generation_prompt, **case, **TOKENS)
    assert got == want
    assert "01 December 2026" in got


def test_tojson_keeps_non_ascii_and_html_characters(fixed_clock):
    got = render_chat(FEATURES, [{"role": "user", "content": "x"}], tools=[WEATHER], **TOKENS)
    assert '"description": "Température en °C, \\"now\\" <b>"' in got


@pytest.mark.parametrize("template,messages", [
    (SMOLLM2, SMOLLM2_CHATS["ends with assistant"]),
    (SMOLLM2, [{"role": "user", "content": "Start"}, {"role": "assistant", "content": "The answer is "}]),
    (FEATURES, [{"role": "user", "content": "Go"},
                {"role": "assistant", "content": [{"type": "text", "text": "Once upon"}, {"type": "image"}]}]),
    (FEATURES, [{"role": "user", "content": "Go"}, {"role": "assistant", "content": "trailing space "}]),
    # a template that trims the content trims the tag's space too: the text is cut and right-stripped
    ("{% for m in messages %}{{ m.role }}: {{ m.content | trim }}\n{% endfor %}",
     [{"role": "user", "content": "Go"}, {"role": "assistant", "content": "Once upon a "}]),
])
def test_continue_final_message_matches_transformers(template, messages, fixed_clock):
    want = _transformers(template, messages, continue_final_message=True)
    got = render_chat(template, messages, add_generation_prompt=False, continue_final_message=True, **TOKENS)
    assert got == want
    assert "CONTINUE_FINAL_MESSAGE_TAG" not in got and "<|im_end|>\n" not in got[-12:]


def test_rendering_leaves_the_callers_messages_alone():
    messages = [{"role": "user", "content": "Go"},
                {"role": "assistant", "content": [{"type": "text", "text": "Once"}], "tool_calls": None}]
    before = repr(messages)
    render_chat(FEATURES, messages, add_generation_prompt=False, continue_final_message=True, **TOKENS)
    assert repr(messages) == before


def test_continue_final_message_with_generation_prompt_is_refused():
    with pytest.raises(ChatTemplateError, match="add_generation_prompt=False"):
        render_chat(SMOLLM2, SMOLLM2_CHATS["ends with assistant"], continue_final_message=True)


def test_raise_exception_is_a_chat_template_error_with_the_templates_message():
    messages = [{"role": "robot", "content": "beep"}]
    with pytest.raises(ChatTemplateError, match="Unknown role: robot") as e:
        render_chat(FEATURES, messages, **TOKENS)
    assert "\n" not in str(e.value)
    pytest.importorskip("transformers")
    import jinja2

    with pytest.raises(jinja2.TemplateError, match="Unknown role: robot"):
        _transformers(FEATURES, messages)


@pytest.mark.parametrize("bad,named", [
    ("just text", "message 1 must be a dict with a string 'role', got 'just text'"),
    ({"content": "no role"}, "message 1 must be a dict with a string 'role'"),
    ({"role": 3, "content": "x"}, "message 1 must be a dict with a string 'role', got {'role': 3"),
    ({"role": "user", "content": 5}, "message 1's content must be a string, a list of parts or None, got 5"),
])
def test_a_bad_message_is_a_one_line_error_naming_it(bad, named):
    with pytest.raises(ChatTemplateError) as e:
        render_chat(SMOLLM2, [{"role": "user", "content": "ok"}, bad])
    assert named in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("template,messages,named", [
    (SMOLLM2, [], "messages is empty"),
    (SMOLLM2, {"role": "user", "content": "x"}, "messages must be a list"),
    ("{% for m in messages %}\n{{ m.content ", [{"role": "user", "content": "x"}], "not valid Jinja"),
    ("{{ messages[0].content + 1 }}", [{"role": "user", "content": "x"}], "does not render: TypeError"),
    # the sandbox is immutable: a template cannot edit the messages (nor reach CPython internals)
    ("{{ messages.append(1) }}", [{"role": "user", "content": "x"}], "does not render: SecurityError"),
])
def test_an_unrenderable_chat_is_a_one_line_error(template, messages, named):
    with pytest.raises(ChatTemplateError, match=named) as e:
        render_chat(template, messages)
    assert "\n" not in str(e.value)
