"""Prompts from the command line and from files, to token ids: what decode.py reads.

A prompt is one of: text (a str), token ids (a list of ints), or a conversation (a list of message
dicts {"role": ..., "content": ...}, eagle3_jax.formats.chat). Sources:

- `--prompt TEXT` (repeatable): backslash escapes are decoded (`unescape`) unless --noescapes.
- a file (`read_prompts`), by its name's ending:
  - `.jsonl`: one JSON value a line (blank lines skipped): a string, a list of ids, a conversation,
    or an object with "messages" (a conversation) or "prompt" (a string);
  - `.json`: a JSON list of such values;
  - anything else: text, one prompt a line (blank lines skipped; escapes decoded as for --prompt).

`encode` turns each into ids: ids pass as they are; text is tokenized as it is, or with `chat` first
made a one-turn conversation (`chat.conversation_of`, with the system message); a conversation is
rendered with the checkpoint's chat template (a conversation needs one; `system` is put in front only
where the conversation has no system or developer message of its own). Bad input raises ValueError
naming the file and line (or the --prompt), what was expected and what was found.
"""

from __future__ import annotations

import json
import os
import re

from eagle3_jax.formats import chat

ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}
_ESCAPE = re.compile(r"\\(.)", re.DOTALL)


def unescape(text: str) -> str:
    r"""`\n`, `\t`, `\r` and `\\` become a newline, a tab, a carriage return and one backslash; any other
    backslash (`\d`, `\x41`, a trailing one) stays as written. Left to right: `\\n` is a backslash and n."""
    return _ESCAPE.sub(lambda m: ESCAPES.get(m.group(1), m.group(0)), text)


def is_conversation(p) -> bool:
    """A list whose items are all dicts (a list of ids is not)."""
    return isinstance(p, list) and bool(p) and all(isinstance(m, dict) for m in p)


def _item(value, where: str):
    """A prompt value of a JSON file: text, ids or a conversation; else ValueError naming `where`."""
    if isinstance(value, dict):
        if "messages" in value:
            value = value["messages"]
            if not is_conversation(value):
                raise ValueError(f"{where}: \"messages\" is not a list of message objects (found "
                                 f"{type(value).__name__} {json.dumps(value)[:60]})")
        elif isinstance(value.get("prompt"), str):
            value = value["prompt"]
        else:
            raise ValueError(f"{where}: an object needs \"messages\" (a conversation) or \"prompt\" (a string); keys "
                             f"found: {sorted(value)}")
    if isinstance(value, str):
        if not value:
            raise ValueError(f"{where}: empty prompt")
        return value
    if is_conversation(value):
        chat.check_conversation(value, where)
        return value
    if isinstance(value, list) and value and all(type(t) is int for t in value):
        return value
    raise ValueError(f"{where}: expected a string, a non-empty list of token ids or a conversation (a list of "
                     f"{{\"role\", \"content\"}} objects), found {json.dumps(value)[:60]}")


def read_prompts(path: str, escapes: bool = True) -> list:
    """The prompts in file `path` (module docstring: .jsonl, .json, or text lines), each text, ids or a
    conversation, in file order. ValueError for an empty file or a bad entry (file and line named)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    out = []
    if path.endswith(".jsonl"):
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg} at column {e.colno}); a .jsonl file holds one "
                                 "JSON value a line") from None
            out.append(_item(value, f"{path}:{n}"))
    elif path.endswith(".json"):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(values, list) or is_conversation(values):
            raise ValueError(f"{path}: expected a JSON list of prompts (strings, id lists or conversations); for "
                             "one conversation write [[...]]")
        out = [_item(v, f"{path}[{i}]") for i, v in enumerate(values)]
    else:
        out = [unescape(line) if escapes else line for line in text.splitlines() if line.strip()]
    if not out:
        raise ValueError(f"{path}: no prompts in the file")
    return out


def parse_ids(text: str, where: str) -> list[int]:
    """'1,2,3' -> [1, 2, 3]; ValueError naming `where` otherwise."""
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        ids = []
    if not ids:
        raise ValueError(f"{where}: {text!r}: the target folder has no tokenizer.json; give comma-separated token ids")
    return ids


def encode(prompts, tokenizer, chat_format, *, chat_on: bool = False, system: str | None = None,
           template_kwargs: dict | None = None, where: str = "prompt") -> list[list[int]]:
    """Token ids of each prompt (module docstring). tokenizer: a tokenizers.Tokenizer or None (text then
    must be comma-separated ids); chat_format: a chat.ChatFormat or None (then neither `chat_on` nor a
    conversation can be used: ValueError)."""
    template_kwargs = template_kwargs or {}
    out = []
    for i, p in enumerate(prompts):
        at = f"{where} {i + 1}"
        if isinstance(p, list) and not is_conversation(p):
            out.append(list(p))
            continue
        if isinstance(p, str) and not chat_on:
            out.append(tokenizer.encode(p).ids if tokenizer is not None else parse_ids(p, at))
            continue
        if chat_format is None:
            what = "--chat renders text" if isinstance(p, str) else "a conversation is rendered"
            raise ValueError(f"{at}: {what} with a chat template, and the target folder has none "
                             f"({chat.TEMPLATE_FILE} or tokenizer_config.json's chat_template); give one with "
                             "--chat_template")
        if isinstance(p, str):
            conv = chat.conversation_of(p, system)
        else:
            keep = system is None or p[0].get("role") in ("system", "developer")
            conv = p if keep else [{"role": "system", "content": system}, *p]
        out.append(chat_format.encode(conv, **template_kwargs))
    return out


def token_ids(values, tokenizer, flag: str = "--eos") -> list[int]:
    """Each value an integer id or the text of one token of `tokenizer` (e.g. '<|call|>'), as ids;
    ValueError naming `flag` for a value that is neither."""
    out = []
    for v in values:
        v = v.strip()
        if re.fullmatch(r"\d+", v):
            out.append(int(v))
            continue
        tid = tokenizer.token_to_id(v) if tokenizer is not None else None
        if tid is None:
            where = "the tokenizer" if tokenizer is not None else "a target without a tokenizer.json"
            raise ValueError(f"{flag} {v!r}: not a token of {where} (expected a token id or the exact text of one "
                             "token, such as <|call|>)")
        out.append(tid)
    return out


def template_file_of(path: str | None) -> str | None:
    """`path` if given and a file; ValueError naming --chat_template otherwise."""
    if path is not None and not os.path.isfile(path):
        raise ValueError(f"--chat_template {path}: not a file (expected a jinja chat template file)")
    return path
