"""Chat-formatted prompts: a checkpoint's own chat template, rendered and tokenized as transformers does.

    fmt = ChatFormat.load(checkpoint_dir)    # chat_template.jinja, else tokenizer_config.json's
    ids = fmt.encode([{"role": "user", "content": "Hi"}], reasoning_effort="high")
    fmt.eos_ids                              # generation_config.json's eos_token_id (gpt-oss: <|return|>, ...)

`render` is transformers' `apply_chat_template(conversation, tokenize=False)` and `encode` its
`tokenize=True`: the same jinja2 environment (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks,
loop controls, the `{% generation %}` tag; raise_exception, strftime_now, a JSON `tojson` without HTML
escaping, dict, a namespace refusing underscore names), the same variables (messages, tools,
documents, add_generation_prompt, the tokenizer's named special tokens from tokenizer_config.json:
bos_token, eos_token, ..., then the caller's keywords such as reasoning_effort), the same message
preparation (keys whose value is None dropped; a reasoning text under reasoning_content, thinking or
reasoning also given as thinking and reasoning_content, as gpt-oss templates read `thinking`); the
text is tokenized by tokenizer.json with special tokens matched as their ids and none added (templates
write their BOS themselves: no second one). Differences: `add_generation_prompt` defaults to True here
(prompts are for generating); messages are checked (`check_conversation`) and template errors raise
ValueError naming the template's source.

A conversation is a non-empty list of messages {"role": one of ROLES, "content": str or a list of
content parts, ...}; other keys (thinking, tool_calls, name, ...) pass to the template as they are.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Mapping
from datetime import datetime

from eagle3_jax.formats.tokenizer import load_tokenizer

ROLES = ("system", "developer", "user", "assistant", "tool")
TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
_RESERVED = ("messages", "tools", "documents", "add_generation_prompt")


def _environment():
    """The jinja2 environment transformers renders chat templates in (one per process)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if tuple(int(x) for x in jinja2.__version__.split(".")[:3] if x.isdigit()) < (3, 1, 6):
        raise ImportError(f"chat templates need jinja2 >= 3.1.6 (older versions have sandbox escapes), found "
                          f"{jinja2.__version__}: pip install -U jinja2")

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (marks assistant text for training masks): its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace.check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace.check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template may not store the underscore name {name!r} "
                                                      "on a namespace")

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                       namespace=TemplateNamespace)
    return env


_ENV = None


def environment():
    """The shared sandboxed environment (made on first use)."""
    global _ENV
    if _ENV is None:
        _ENV = _environment()
    return _ENV


@functools.lru_cache(maxsize=32)
def compile_template(template: str, source: str = "chat template"):
    """(jinja2 Template, frozenset of the variables it reads from outside) of `template`; a syntax error
    raises ValueError naming `source` and the line."""
    import jinja2
    import jinja2.meta

    env = environment()
    try:
        ast = env.parse(template)
        return env.from_string(template), frozenset(jinja2.meta.find_undeclared_variables(ast))
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"{source}: line {e.lineno}: {e.message}") from None


def _plain(value, where: str):
    """A copy of value in JSON types (str, int, float, bool, None, lists, string-keyed dicts); else ValueError."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise ValueError(f"{where}: keys must be strings, found {bad[0]!r}")
        return {k: _plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise ValueError(f"{where}: expected JSON data (str, number, bool, None, list, dict), found {type(value).__name__}")


def check_conversation(conversation, where: str = "conversation") -> list[dict]:
    """The conversation as the template sees it: a list of message dicts in JSON types, keys whose value
    is None dropped, reasoning aliased (module docstring). Raises ValueError naming `where`, the message
    index and the key unless it is a non-empty list of dicts, each with "role" one of ROLES and
    "content" a str or a list (a message with "tool_calls" may leave content out)."""
    if not isinstance(conversation, (list, tuple)) or not conversation:
        found = "an empty list" if isinstance(conversation, (list, tuple)) else type(conversation).__name__
        raise ValueError(f"{where}: expected a non-empty list of messages ({{\"role\": ..., \"content\": ...}}), "
                         f"found {found}")
    out = []
    for i, m in enumerate(conversation):
        at = f"{where}[{i}]"
        if not isinstance(m, Mapping):
            raise ValueError(f"{at}: expected a message dict {{\"role\": ..., \"content\": ...}}, found "
                             f"{type(m).__name__} {m!r:.60}")
        m = {k: v for k, v in _plain(m, at).items() if v is not None}
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"{at}: \"role\" is {role!r}, expected one of {list(ROLES)}")
        if "content" not in m and "tool_calls" not in m:
            raise ValueError(f"{at}: no \"content\" (expected a string; only a message with \"tool_calls\" may "
                             f"leave it out); keys found: {sorted(m)}")
        if "content" in m and not isinstance(m["content"], (str, list)):
            raise ValueError(f"{at}: \"content\" is {type(m['content']).__name__}, expected a string (or a list of "
                             "content parts)")
        reasoning = next((m[k] for k in _REASONING_KEYS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def render(template: str, conversation, *, add_generation_prompt: bool = True,
           special_tokens: Mapping[str, str] | None = None, tools=None, documents=None,
           source: str = "chat template", **template_kwargs) -> str:
    """The text `template` makes of `conversation` (`check_conversation`), as transformers'
    apply_chat_template(tokenize=False) with the same arguments renders it: special_tokens (the
    tokenizer's named ones, e.g. {"bos_token": "<s>"}) and then template_kwargs (e.g. reasoning_effort)
    are the template's variables. A template error (raise_exception included) raises ValueError naming
    `source`."""
    import jinja2

    if not isinstance(add_generation_prompt, bool):
        raise ValueError(f"add_generation_prompt: expected a bool, found {add_generation_prompt!r}")
    messages = check_conversation(conversation)
    compiled, _ = compile_template(template, source)
    variables = {**(special_tokens or {}), **template_kwargs}
    clash = [k for k in _RESERVED if k in variables]
    if clash:
        raise ValueError(f"template variable {clash[0]!r}: set by render itself (pass it as its own argument)")
    variables = _plain(variables, "template variables")
    try:
        return compiled.render(messages=messages, tools=_plain(tools, "tools"),
                               documents=_plain(documents, "documents"), add_generation_prompt=add_generation_prompt,
                               **variables)
    except jinja2.TemplateError as e:
        raise ValueError(f"{source}: {type(e).__name__}: {e}") from None


def _read_json(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def load_template(path: str | os.PathLike) -> tuple[str, str]:
    """(template text, its source) of checkpoint folder `path`, as transformers finds it: the
    chat_template.jinja file, else tokenizer_config.json's "chat_template" (a string, or a list of
    {"name", "template"} of which "default" is taken). ValueError naming the files when there is none."""
    path = os.fspath(path)
    file = os.path.join(path, TEMPLATE_FILE)
    if os.path.isfile(file):
        with open(file, encoding="utf-8") as f:
            return f.read(), file
    config_file = os.path.join(path, "tokenizer_config.json")
    config = _read_json(config_file) or {}
    t = config.get("chat_template")
    if isinstance(t, list):
        named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
        if "default" not in named:
            raise ValueError(f"{config_file}: \"chat_template\" lists templates {sorted(map(str, named))} and none is "
                             "named 'default'")
        t = named["default"]
    if t is None:
        raise ValueError(f"{path}: no chat template (expected {TEMPLATE_FILE} or a \"chat_template\" in "
                         "tokenizer_config.json)")
    if not isinstance(t, str):
        raise ValueError(f"{config_file}: \"chat_template\" is {type(t).__name__}, expected a string")
    return t, f"{config_file} (chat_template)"


def has_template(path: str | os.PathLike) -> bool:
    """Whether checkpoint folder `path` has a chat template (`load_template` would find one)."""
    path = os.fspath(path)
    if os.path.isfile(os.path.join(path, TEMPLATE_FILE)):
        return True
    return (_read_json(os.path.join(path, "tokenizer_config.json")) or {}).get("chat_template") is not None


def special_tokens(path: str | os.PathLike) -> dict[str, str]:
    """The named special tokens (SPECIAL_TOKEN_NAMES) tokenizer_config.json in folder `path` gives, as
    strings (an AddedToken dict gives its "content"); those it leaves out or sets to null are absent."""
    file = os.path.join(os.fspath(path), "tokenizer_config.json")
    config = _read_json(file) or {}
    out = {}
    for name in SPECIAL_TOKEN_NAMES:
        v = config.get(name)
        if isinstance(v, Mapping):
            v = v.get("content")
        if v is None:
            continue
        if not isinstance(v, str):
            raise ValueError(f"{file}: {name!r} is {v!r}, expected a token string or {{\"content\": ...}}")
        out[name] = v
    return out


def stop_ids(path: str | os.PathLike, tokenizer=None) -> tuple[int, ...] | None:
    """The checkpoint's stop token ids: generation_config.json's eos_token_id (an id or a list of ids),
    else the id of tokenizer_config.json's eos_token in `tokenizer` where given; None when neither says."""
    path = os.fspath(path)
    file = os.path.join(path, "generation_config.json")
    config = _read_json(file)
    if config is not None and config.get("eos_token_id") is not None:
        eos = config["eos_token_id"]
        ids = [eos] if not isinstance(eos, list) else eos
        if not ids or any(type(i) is not int or i < 0 for i in ids):
            raise ValueError(f"{file}: \"eos_token_id\" is {eos!r}, expected a token id or a non-empty list of ids")
        return tuple(ids)
    name = special_tokens(path).get("eos_token")
    if tokenizer is not None and name is not None and tokenizer.token_to_id(name) is not None:
        return (tokenizer.token_to_id(name),)
    return None


@dataclasses.dataclass(frozen=True)
class ChatFormat:
    """A checkpoint's chat format: its template, named special tokens, tokenizer and stop ids.

    template / source: the template text and where it came from; special_tokens: as `special_tokens`;
    tokenizer: its tokenizer.json with special tokens matched as ids (None: `encode` unavailable);
    eos_ids: `stop_ids` (None when the checkpoint names none)."""

    template: str
    source: str
    special_tokens: Mapping[str, str]
    tokenizer: object = None
    eos_ids: tuple[int, ...] | None = None

    @classmethod
    def load(cls, path: str | os.PathLike, template_file: str | os.PathLike | None = None) -> ChatFormat:
        """The chat format of checkpoint folder `path` (`load_template`, or the jinja file `template_file`
        instead); its tokenizer.json where the folder has one."""
        path = os.fspath(path)
        if template_file is not None:
            with open(template_file, encoding="utf-8") as f:
                template, source = f.read(), os.fspath(template_file)
        else:
            template, source = load_template(path)
        compile_template(template, source)  # a syntax error shows now, naming the file
        has_tok = os.path.isfile(os.path.join(path, "tokenizer.json"))
        tok = load_tokenizer(path, split_special_tokens=False) if has_tok else None
        return cls(template, source, special_tokens(path), tok, stop_ids(path, tok))

    @property
    def variables(self) -> frozenset[str]:
        """Names the template reads from outside (messages, add_generation_prompt, reasoning_effort, ...)."""
        return compile_template(self.template, self.source)[1]

    def render(self, conversation, *, add_generation_prompt: bool = True, tools=None, documents=None,
               **template_kwargs) -> str:
        """The conversation's text (module function `render` with this template and special tokens)."""
        return render(self.template, conversation, add_generation_prompt=add_generation_prompt,
                      special_tokens=self.special_tokens, tools=tools, documents=documents, source=self.source,
                      **template_kwargs)

    def encode(self, conversation, *, add_generation_prompt: bool = True, tools=None, documents=None,
               **template_kwargs) -> list[int]:
        """The conversation's token ids: `render`, then the tokenizer with special tokens matched and none
        added, as apply_chat_template(tokenize=True)."""
        if self.tokenizer is None:
            raise ValueError(f"{self.source}: the checkpoint folder has no tokenizer.json to encode with")
        text = self.render(conversation, add_generation_prompt=add_generation_prompt, tools=tools,
                           documents=documents, **template_kwargs)
        return self.tokenizer.encode(text, add_special_tokens=False).ids


def conversation_of(text: str, system: str | None = None) -> list[dict]:
    """[{"role": "system", "content": system}?, {"role": "user", "content": text}]: a one-turn conversation."""
    if not isinstance(text, str) or (system is not None and not isinstance(system, str)):
        raise ValueError(f"conversation_of: expected strings, found {type(text).__name__} and {type(system).__name__}")
    return ([{"role": "system", "content": system}] if system is not None else []) + [{"role": "user", "content": text}]


__all__ = ["ROLES", "TEMPLATE_FILE", "SPECIAL_TOKEN_NAMES", "ChatFormat", "check_conversation", "compile_template",
           "conversation_of", "environment", "has_template", "load_template", "render", "special_tokens", "stop_ids"]
