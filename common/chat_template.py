"""Chat templates: a checkpoint's Jinja template, rendered the way transformers renders it.

Where the template comes from (``load_chat_template``), in transformers' order of precedence:
``chat_template.jinja`` beside the checkpoint, else ``chat_template`` in ``tokenizer_config.json``
(a string, or a list of ``{"name", "template"}`` of which "default" is used). The built-in model
has ``BUILTIN_TEMPLATE``.

Rendering follows ``transformers.utils.chat_template_utils.render_jinja_template`` and
``apply_chat_template``: an immutable sandboxed Jinja environment with ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension and a ``{% generation %}`` block (rendered as its
body); ``raise_exception``, ``strftime_now``, a ``tojson`` that does not escape HTML, ``dict`` and
``namespace`` as globals; the special tokens of ``tokenizer_config.json`` (``bos_token``,
``eos_token``, ...) as variables; message keys whose value is None dropped. The rendered text
already holds the template's special tokens, so it is tokenized without adding any.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from types import MappingProxyType
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

from common.model.registry import resolve_model
from common.tokenizer import token_content

__all__ = ["BUILTIN_TEMPLATE", "ChatTemplate", "ChatTemplateError", "load_chat_template"]

# The built-in model's template: a role-prefixed transcript. Its tokenizer has no chat tokens,
# so plain text marks the turns.
BUILTIN_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
_BUILTIN_SPECIAL_TOKENS = MappingProxyType({
    "bos_token": "<|bos|>", "eos_token": "<|endoftext|>", "pad_token": "<|pad|>",
    "mask_token": "<|mask|>"})
# The named special tokens transformers passes to every template (``special_tokens_map``).
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The template cannot be compiled, or refused the conversation (``raise_exception``)."""


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers uses it to find assistant tokens
    for training masks; rendering for inference outputs the body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body) \
            .set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore attributes, as in transformers."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature trick: self in args
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes ({name!r})")


class _TemplateDict:
    """``dict(...)`` inside a template, without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, > and & for HTML, which would change the prompt.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       dict=_TemplateDict(), namespace=_Namespace)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(f"the chat template does not compile: {exc}") from None


def _plain(value: Any) -> Any:
    """Messages rebuilt from JSON types only, so the sandbox sees nothing with methods of its
    own (transformers does the same), and with None-valued keys dropped."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    raise ChatTemplateError(f"chat messages must hold JSON values, got {type(value).__name__}")


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template and the special tokens it is rendered with."""

    source: str
    special_tokens: Mapping[str, str] = field(default_factory=dict)
    _compiled: jinja2.Template = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_compiled", _compile(self.source))

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               **variables: Any) -> str:
        """The prompt text of ``messages`` (each a dict with at least ``role``).

        ``variables`` are passed to the template as well (e.g. ``enable_thinking``, ``tools``);
        they override special tokens of the same name. ChatTemplateError when the template
        refuses the conversation, with the template's own message.
        """
        if not messages:
            raise ChatTemplateError("the conversation is empty")
        chat = _plain(list(messages))
        for m in chat:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ChatTemplateError(f"each message must be an object with a role, got {m!r}")
        context = {**self.special_tokens, **_plain(dict(variables))}
        context.setdefault("tools", None)
        context.setdefault("documents", None)
        try:
            return self._compiled.render(messages=chat,
                                         add_generation_prompt=add_generation_prompt, **context)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"the chat template refused the messages: {exc}") from None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ChatTemplateError(f"cannot read {path}: {exc}") from None
    return data if isinstance(data, dict) else {}


def _template_source(directory: Path, tok_cfg: dict) -> str | None:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    value = tok_cfg.get("chat_template")
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise ChatTemplateError(f"{directory / 'tokenizer_config.json'} has several chat "
                                f"templates ({sorted(map(str, named))}) and none is 'default'")
    return None


def load_chat_template(model_path_or_name: str) -> ChatTemplate | None:
    """The model's chat template: built in for "tiny", the checkpoint's own for a directory,
    None when the checkpoint has none."""
    if model_path_or_name == "tiny":
        return ChatTemplate(BUILTIN_TEMPLATE, dict(_BUILTIN_SPECIAL_TOKENS))
    directory = Path(resolve_model(model_path_or_name))
    if not directory.is_dir():
        return None
    tok_cfg = _read_json(directory / "tokenizer_config.json")
    source = _template_source(directory, tok_cfg)
    if source is None:
        return None
    legacy = _read_json(directory / "special_tokens_map.json")
    special: dict[str, str] = {}
    for key in _SPECIAL_TOKEN_KEYS:
        content = token_content(tok_cfg.get(key)) or token_content(legacy.get(key))
        if content is not None:
            special[key] = content
    return ChatTemplate(source, special)
