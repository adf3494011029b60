"""`tokenizer.json`, the Hugging Face tokenizers file a checkpoint or data folder carries."""

from __future__ import annotations

import os

from tokenizers import Tokenizer


def load_tokenizer(path: str | os.PathLike):
    """The `tokenizers.Tokenizer` of `path/tokenizer.json`, with special tokens such as `<|endoftext|>`
    encoded as themselves (`encode_special_tokens`, a setting tokenizer.json does not store)."""
    file = os.path.join(os.fspath(path), "tokenizer.json")
    if not os.path.isfile(file):
        raise ValueError(f"{file}: not found (a folder with a tokenizer.json was expected)")
    tok = Tokenizer.from_file(file)
    tok.encode_special_tokens = True
    return tok
