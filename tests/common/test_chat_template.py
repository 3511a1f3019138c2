"""Chat templates rendered by us against transformers' own ``apply_chat_template``."""

from __future__ import annotations

import json

import pytest

from common.chat_template import (BUILTIN_TEMPLATE, ChatTemplate, ChatTemplateError,
                                  load_chat_template)
from common.tokenizer import ByteTokenizer, HFTokenizer

# Exercises what real templates use: namespace, loop controls, raise_exception, tojson of tools,
# a {% generation %} block, whitespace control (trim_blocks / lstrip_blocks), the special tokens.
TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(system=false, last_query=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- if message['content'] is string and message['content'].startswith('the ') %}
        {%- set ns.last_query = (messages|length - 1) - loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- if tools %}
<|im_start|>system
Tools: {{ tools | tojson }}<|im_end|>
{% endif %}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role: ' + message['role']) }}
    {% endif %}
    {% if message['role'] == 'system' %}{% set ns.system = true %}{% endif %}
    {% if message['content'] == 'SKIP' %}{% continue %}{% endif %}
<|im_start|>{{ message['role'] }}
    {% if message['role'] == 'assistant' %}
{% generation %}{{ message['content'] | trim }}{% endgeneration %}<|im_end|>
    {% else %}
{{ message['content'] }}<|im_end|>
    {% endif %}
{% endfor %}
{{- 'last query ' ~ ns.last_query ~ ': ' ~ messages[ns.last_query]['content'].split(' ')[0] }}
{% if add_generation_prompt %}
<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}
{% endif %}
{{- eos_token if not ns.system else '' -}}"""

CONVERSATIONS = [
    [{"role": "user", "content": "hello world"}],
    [{"role": "system", "content": "Be brief <b>&</b>."},
     {"role": "user", "content": "the quick brown fox"},
     {"role": "assistant", "content": "  jumps  "},
     {"role": "user", "content": "SKIP"},
     {"role": "user", "content": "héllo 😀", "name": None}],
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tokenizer directory with chat tokens, a BOS and the template in tokenizer_config.json."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"])
    raw.train_from_iterator(["hello world", "the quick brown fox", "user assistant"] * 10,
                            trainer)
    d = tmp_path_factory.mktemp("chat")
    raw.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": {"__type": "AddedToken", "content": "<s>", "special": True},
        "chat_template": TEMPLATE}))
    return d


def ours(directory, messages, **kwargs):
    template = load_chat_template(str(directory))
    text = template.render(messages, **kwargs)
    return text, HFTokenizer(directory).encode(text, add_special_tokens=False)


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("kwargs", [{"add_generation_prompt": True},
                                    {"add_generation_prompt": False},
                                    {"add_generation_prompt": True, "enable_thinking": False},
                                    {"add_generation_prompt": True,
                                     "tools": [{"type": "function",
                                                "function": {"name": "f<x>"}}]}])
def test_rendering_and_ids_equal_transformers(checkpoint, conversation, kwargs):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(checkpoint))
    messages = CONVERSATIONS[conversation]
    text, ids = ours(checkpoint, messages, **kwargs)
    assert text == hf.apply_chat_template(messages, tokenize=False, **kwargs)
    assert ids == hf.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
    assert text.startswith("<s>")


def test_raise_exception_becomes_a_chat_template_error(checkpoint):
    with pytest.raises(ChatTemplateError, match="unknown role: robot"):
        ours(checkpoint, [{"role": "robot", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="empty"):
        ours(checkpoint, [])


def test_jinja_file_wins_and_named_templates(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "E", "chat_template": [{"name": "tool_use", "template": "T"},
                                            {"name": "default", "template": "D{{ eos_token }}"}]}))
    assert load_chat_template(str(tmp_path)).render([{"role": "user", "content": ""}]) == "DE"
    (tmp_path / "chat_template.jinja").write_text("J{{ messages[0].content }}")
    assert load_chat_template(str(tmp_path)).render([{"role": "user", "content": "x"}]) == "Jx"
    assert load_chat_template(str(tmp_path / "missing")) is None


def test_several_templates_without_default_is_an_error(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": [{"name": "a", "template": "A"}]}))
    with pytest.raises(ChatTemplateError, match="none is 'default'"):
        load_chat_template(str(tmp_path))


def test_no_template(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "E"}))
    assert load_chat_template(str(tmp_path)) is None


def test_sandbox_refuses_attribute_escapes():
    t = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(Exception) as info:
        t.render([{"role": "user", "content": "x"}])
    assert "unsafe" in str(info.value) or "access" in str(info.value)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}")


def test_builtin_template_of_the_tiny_model():
    t = load_chat_template("tiny")
    assert t.source == BUILTIN_TEMPLATE
    text = t.render([{"role": "system", "content": "Be nice."},
                     {"role": "user", "content": "Hi!"}])
    assert text == "<|bos|>system: Be nice.\nuser: Hi!\nassistant:"
    ids = ByteTokenizer().encode(text, add_special_tokens=False)
    assert ids[0] == ByteTokenizer.BOS_TOKEN_ID and bytes(ids[1:]).decode() == text[7:]
    assert t.render([{"role": "user", "content": "a"}], add_generation_prompt=False) == \
        "<|bos|>user: a\n"
