"""`tokenizer.json`, the Hugging Face tokenizers file a checkpoint or data folder carries."""

from __future__ import annotations

import os

from tokenizers import Tokenizer


def load_tokenizer(path: str | os.PathLike, split_special_tokens: bool = True):
    """The `tokenizers.Tokenizer` of `path/tokenizer.json` (ValueError naming the file if it is missing).

    split_special_tokens (transformers' name for it; `encode_special_tokens` in tokenizers, a setting
    tokenizer.json does not store): True (the default here) encodes the text of a special token such
    as `<|endoftext|>` as ordinary text, so no text a user writes turns into a control id; False
    matches it as its one id, as transformers' tokenizers do by default and as chat-formatted text
    needs (`formats.chat`). Added tokens that are not special always match as their ids."""
    file = os.path.join(os.fspath(path), "tokenizer.json")
    if not os.path.isfile(file):
        raise ValueError(f"{file}: not found (a folder with a tokenizer.json was expected)")
    tok = Tokenizer.from_file(file)
    tok.encode_special_tokens = bool(split_special_tokens)
    return tok
