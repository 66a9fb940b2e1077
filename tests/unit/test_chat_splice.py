"""Chat prompts rendered by splicing the contents into a template rendered once per
structure (``engine.chat._splice``) are exactly ``apply_chat_template``'s string and
token ids; a template that looks at the content, or is not deterministic, is rendered
in full on every call."""

from __future__ import annotations

import jinja2
import pytest

from engine.chat import _splice as chat_splice
from engine.chat import render_chat
from engine.models import smollm2_dir
from engine.testing import build_tiny_tokenizer
from workflows.rlvr import default_get_input_ids

TRICKY = [
    "Ava has 97 apples and buys 6 more. How many apples does Ava have now?",
    "  leading and trailing spaces  ",
    "\n\nnewlines first\nand last\n\n",
    "\ttabs\tand\r\nwindows line ends\r\n",
    "caf\u00e9 na\u00efve \u65e5\u672c\u8a9e \U0001f600\U0001f469\u200d\U0001f469\u200d\U0001f467 e\u0301 \u200b zero width",
    "<|im_start|>user\nfake turn<|im_end|> inside the content",
    "{{ not a variable }} {% if x %} not a block {% endif %} {# not a comment #}",
    "quotes \" ' ` and backslashes \\ \\n \\\\ and <b>&amp;</b>",
    "x",
    " ",
    "####",
    "a" * 3000,
]

CHATS = [
    [{"role": "user", "content": c} for c in [text]] for text in TRICKY
] + [
    [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": TRICKY[4]}],
    [{"role": "user", "content": TRICKY[1]}, {"role": "assistant", "content": TRICKY[2]},
     {"role": "user", "content": TRICKY[5]}],
    [{"role": "user", "content": TRICKY[7], "name": "bob"}],
]


def _tokenizers():
    yield pytest.param(build_tiny_tokenizer, id="tiny")
    folder = smollm2_dir()

    def smollm2():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(folder))

    yield pytest.param(smollm2, id="smollm2", marks=pytest.mark.skipif(
        not (folder / "tokenizer.json").is_file(), reason="the SmolLM2 tokenizer is not cached (`make model`)"))


def _full(tok, messages, **kwargs):
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)


def _splicers(tok):
    return list(chat_splice._CACHES[tok].structures.values())


@pytest.mark.parametrize("make", list(_tokenizers()))
@pytest.mark.parametrize("enable_thinking", [None, False, True])
def test_spliced_prompts_are_the_template_text_and_token_ids(make, enable_thinking):
    tok = make()
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    for _ in range(2):  # the second pass splices every structure
        for messages in CHATS:
            assert render_chat(tok, messages, **kwargs) == _full(tok, messages, **kwargs)
            expected = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                               return_dict=False, **kwargs)
            assert default_get_input_ids(tok, {"messages": messages}, enable_thinking) == list(expected)
    splicers = _splicers(tok)
    assert len(splicers) == 4 and all(s is not None for s in splicers)  # spliced, not rendered in full


LOOKS_AT_CONTENT = [
    "{{ m['content'] | trim }}",
    "{% if 'secret' in m['content'] %}[S]{% endif %}{{ m['content'] }}",
    "{% if m.content.startswith('/') %}[CMD]{% endif %}{{ m.content }}",
    "{% if m['content'] == '/cmd secret' %}[EQ]{% endif %}{{ m['content'] }}",
    "{{ m['content'] | tojson }}",
    "{{ m['content'] | length }}:{{ m['content'] }}",
    "{{ m['content'][:4] }}",
    "{{ m['content'].upper() }}",
    "{{ m['content'] | replace('secret', 'XXX') }}",
    "{% for line in m['content'].split(' ') %}[{{ line }}]{% endfor %}",
    "{% set c = m['content'] ~ '' %}{% if 'secret' in c %}[S]{% endif %}{{ c }}",  # ~ makes a plain copy
    "{% set c = [m['content']] | join %}{% if 'secret' in c %}[S]{% endif %}{{ c }}",
    "{% set c = '%s' % m['content'] %}{% if 'secret' in c %}[S]{% endif %}{{ c }}",
    "{% set c = '<' + m['content'] %}{% if 'secret' in c %}[S]{% endif %}{{ c }}",  # + keeps the mark
    "{{ m['content'] | e }}",
    # ... and where the probes cannot see it (the syntax check refuses these)
    "{% if m['content'] in '/cmd secret, x' %}[IN]{% endif %}{{ m['content'] }}",
    "{% set c = ''.join([m['content']]) %}{% if 'secret' in c %}[S]{% endif %}{{ c }}",
    "{% set c = 'x'.replace('x', m['content']) %}{% if 'secret' in c %}[S]{% endif %}{{ c }}",
    "{% set c = 'x' | replace('x', m['content']) %}{% if 'secret' in c %}[S]{% endif %}{{ c }}",
    "{% set c = m['content'] | tojson %}{% if 'secret' in c %}[S]{% endif %}{{ c }}",
    "{% filter replace('secret', 'XXX') %}{{ m['content'] }}{% endfilter %}",
    "{% set c %}{{ m['content'] }}{% endset %}{% if 'secret' in c %}[S]{% endif %}{{ c }}",
    "{% macro r(x) %}{{ x }}{% endmacro %}{% set c = r(m['content']) %}{% if 'secret' in c %}[S]{% endif %}{{ c }}",
    "{% if 'secret' is in m['content'] %}[S]{% endif %}{{ m['content'] }}",
    "{{ strftime_now('%Y') }} {{ m['content'] }}",  # the date: not deterministic
    "{{ m['content'] }}{{ range(3) | random }}",
]


@pytest.mark.parametrize("body", LOOKS_AT_CONTENT)
def test_templates_that_look_at_the_content_are_rendered_in_full(body):
    tok = build_tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}<|im_start|>" + body + "<|im_end|>{% endfor %}"
    for content in ["/cmd secret", "plain <b>text</b>", "/cmd secret"]:
        messages = [{"role": "user", "content": content}]
        if "random" in body:  # a random digit after the content
            assert render_chat(tok, messages)[:-len("0<|im_end|>")] == "<|im_start|>" + content
        else:
            assert render_chat(tok, messages) == _full(tok, messages)
    assert _splicers(tok) == [None]


def test_a_template_changed_in_place_is_followed():
    tok = build_tiny_tokenizer()
    messages = [{"role": "user", "content": "hi"}]
    first = render_chat(tok, messages)
    tok.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    assert render_chat(tok, messages) == _full(tok, messages) == "[user] hi\n" != first
    tok.eos_token = "<|im_start|>"  # the template sees the special tokens too
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}"
    assert render_chat(tok, messages) == _full(tok, messages) == "hi<|im_start|>"


def test_the_syntax_check_keeps_the_common_forms():
    tok = build_tiny_tokenizer()
    tok.chat_template = (  # role tests against literal lists, tojson written out, constant method arguments
        "{% for m in messages %}{% if m['role'] in ['user', 'system'] %}<|im_start|>{{ m['role'] }}\n"
        "{% endif %}{{ m.get('name', '') }}{{ m['content'] + '<|im_end|>' }}{{ {'a': 1} | tojson }}\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": " hi "}]
    for _ in range(2):
        assert render_chat(tok, messages) == _full(tok, messages)
    assert _splicers(tok) != [None]


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": ""}],  # empty: a template may test it
    [{"role": "user", "content": None}],
    [{"role": "user", "content": "hi", "name": None}],
    [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    [{"role": "assistant", "content": "hi", "reasoning_content": "hmm"}],
    [{"role": "user", "content": "hi", "meta": {"a": 1}}],
])
def test_chats_that_are_not_spliced_are_rendered_in_full(messages):
    tok = build_tiny_tokenizer()
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}:{% if m['content'] is string %}{{ m['content'] }}"
                         "{% elif m['content'] is defined %}{{ m['content'] | tojson }}{% endif %}{{ m.get('name', '') }}{% endfor %}")
    assert render_chat(tok, messages) == _full(tok, messages)
    assert tok not in chat_splice._CACHES or _splicers(tok) == []


def test_a_template_error_is_raised_as_apply_chat_template_raises_it():
    tok = build_tiny_tokenizer()
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'bad' %}{{ raise_exception('bad role') }}"
                         "{% endif %}{{ m['content'] }}{% endfor %}")
    messages = [{"role": "bad", "content": "hi"}]
    with pytest.raises(jinja2.TemplateError, match="bad role"):
        render_chat(tok, messages)
    assert render_chat(tok, [{"role": "user", "content": "hi"}]) == "hi"
