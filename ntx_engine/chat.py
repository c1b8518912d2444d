"""Chat templates stored in GGUF (`tokenizer.chat_template`), rendered like HF transformers.

The template is untrusted code from the model file, so it runs in jinja2's immutable sandbox.
The environment mirrors `transformers`' `apply_chat_template`: `trim_blocks`/`lstrip_blocks`,
loop controls, a `tojson` that keeps non-ASCII text, `raise_exception`, `strftime_now`, the
`{% generation %}` block tag, and the `bos_token`/`eos_token` strings.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import TYPE_CHECKING, Any, Mapping

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ntx_common.errors import TokenizerError

if TYPE_CHECKING:
    from ntx_engine.tokenizer import Tokenizer

TEMPLATE_KEY = "tokenizer.chat_template"


class ChatTemplate:
    """One compiled chat template; `render` turns a message list into the prompt text."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        env = _environment()
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"{TEMPLATE_KEY} does not compile ({exc}); fix or drop the template") from exc

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any], tokenizer: Tokenizer) -> ChatTemplate | None:
        """The file's default template, or None when it has none."""
        source = md.get(TEMPLATE_KEY)
        if source is None:
            return None
        if isinstance(source, (bytes, bytearray)):
            source = bytes(source).decode("utf-8", errors="replace")
        if not isinstance(source, str) or not source.strip():
            return None
        return cls(source, bos_token=_token_text(tokenizer, tokenizer.bos_id),
                   eos_token=_token_text(tokenizer, tokenizer.eos_id))

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True, **extra: Any) -> str:
        """Prompt text for `messages` (each a dict with at least `role`); `extra` variables
        (e.g. `tools`) are passed to the template as transformers does."""
        _check_messages(messages)
        context = {"bos_token": self.bos_token, "eos_token": self.eos_token, **extra}
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **context)
        except _TemplateRaised as exc:
            raise TokenizerError(f"the chat template refused the conversation: {exc}") from exc
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
            raise TokenizerError(f"rendering {TEMPLATE_KEY} failed: {type(exc).__name__}: {exc}") from exc


class _TemplateRaised(Exception):
    """`raise_exception(...)` called by the template itself (it rejects the input)."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes HTML and sorts keys; templates expect plain json.dumps.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training; it renders
    its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list):
        raise TokenizerError(f"chat messages must be a list of dicts, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m:
            raise TokenizerError(f"chat message {i} must be a dict with a 'role' (and usually 'content'), got {m!r}")


def _token_text(tokenizer: Tokenizer, tid: int | None) -> str:
    return "" if tid is None else tokenizer.token_text(tid)
