"""Offline training data: the Python standard library's source as a corpus, a byte-level BPE on it.

Every machine (and the GPU image) has the standard library, so the corpus needs no download:

  stdlib_files()  -> [(relpath, text)] of every *.py (site-packages / dist-packages excluded)
  split_of(path)  -> "train" | "eval", from a sha256 of the relative path (stable everywhere)
  train_tokenizer -> HF `tokenizers` byte-level BPE, `<|endoftext|>` = id 0
  build_dataset   -> out_dir/{tokenizer.json, train.npy, eval.npy, meta.json}

Token arrays are 1-D: each document's ids followed by the eos id 0. `sample_windows` draws training
windows from them, `eval_prompts` draws prompts that stay inside one document.
"""

import hashlib
import json
import os
import sys
import sysconfig
from pathlib import Path

import numpy as np

from eagle3_jax.formats import tokenizer as tokenizer_file

EOS_TOKEN = "<|endoftext|>"
EOS_ID = 0
SPLITS = ("train", "eval")
_EXCLUDED_DIRS = ("site-packages", "dist-packages")


def _corpus_root(root):
    """root as an absolute Path; None means the standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"] if root is None else root).resolve()


def _read_py_files(root):
    """(files, skipped): (relpath, text) of the valid-UTF-8 *.py under root, and the other relpaths."""
    if not root.is_dir():
        raise FileNotFoundError(f"corpus root {str(root)!r} is not a directory")
    files, skipped = [], []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        for name in filenames:
            if not name.endswith(".py"):
                continue
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            try:
                files.append((rel, path.read_bytes().decode("utf-8")))
            except UnicodeDecodeError:
                skipped.append(rel)
    if not files:
        raise ValueError(f"no UTF-8 *.py files under {str(root)!r} ({len(skipped)} not UTF-8)")
    return sorted(files), sorted(skipped)


def stdlib_files(root=None):
    """(relative posix path, text) of every *.py under root, sorted by path.

    root defaults to the standard library (`sysconfig.get_paths()["stdlib"]`); directories named
    site-packages / dist-packages are not entered; files that are not valid UTF-8 are skipped
    (`build_dataset` records them). Text is the file's exact content (no newline translation).
    """
    return _read_py_files(_corpus_root(root))[0]


def split_of(relpath, eval_fraction=0.02):
    """"eval" for about eval_fraction of paths, else "train": the first 8 bytes of sha256(relpath)."""
    if not 0.0 <= eval_fraction <= 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1], got {eval_fraction}")
    h = int.from_bytes(hashlib.sha256(relpath.encode("utf-8")).digest()[:8], "big")
    return "eval" if h < eval_fraction * 2.0**64 else "train"


def train_tokenizer(texts, vocab_size=4096):
    """Byte-level BPE (`tokenizers.Tokenizer`) trained on texts; `<|endoftext|>` has id 0.

    GPT-2 style: ByteLevel pre-tokenizer (no prefix space) and decoder, no normalizer, so
    decode(encode(text)) == text for any text. `encode_special_tokens` is set: a literal
    `<|endoftext|>` in text encodes as ordinary bytes, never as the eos id. The 256 byte symbols are
    always in the vocabulary; vocab_size counts them and the special token. Deterministic for the
    same texts.
    """
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as e:
        raise ImportError("train_tokenizer needs HF tokenizers: pip install tokenizers") from e
    if vocab_size < 257:
        raise ValueError(f"vocab_size must be at least 257 (256 bytes + eos), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    if tok.token_to_id(EOS_TOKEN) != EOS_ID:
        raise RuntimeError(f"{EOS_TOKEN} got id {tok.token_to_id(EOS_TOKEN)}, expected {EOS_ID}")
    tok.encode_special_tokens = True
    return tok


def encode_docs(tokenizer, texts):
    """All documents' ids concatenated, each followed by eos (id 0): uint16 [N] (int32 if vocab > 65536).

    A literal `<|endoftext|>` inside a text is encoded as ordinary bytes whatever the tokenizer's
    `encode_special_tokens`, so id 0 only separates documents.
    """
    dtype = np.uint16 if tokenizer.get_vocab_size() <= 1 << 16 else np.int32
    saved = tokenizer.encode_special_tokens
    tokenizer.encode_special_tokens = True
    try:
        encs = tokenizer.encode_batch(list(texts), add_special_tokens=False)
    finally:
        tokenizer.encode_special_tokens = saved
    out = np.empty(sum(len(e.ids) + 1 for e in encs), dtype)
    i = 0
    for e in encs:
        out[i:i + len(e.ids)] = e.ids
        out[i + len(e.ids)] = EOS_ID
        i += len(e.ids) + 1
    return out


def build_dataset(out_dir, vocab_size=4096, eval_fraction=0.02, root=None):
    """Write out_dir/{tokenizer.json, train.npy, eval.npy, meta.json}; return the meta dict.

    Files are split by `split_of`; the tokenizer is trained on the train split only. meta.json:
    vocab_size, eos_id, eos_token, dtype, per split {files, tokens, bytes (UTF-8)}, python
    version, stdlib root, eval file list, skipped (non-UTF-8) file list.
    """
    root = _corpus_root(root)
    files, skipped = _read_py_files(root)
    split = {p: split_of(p, eval_fraction) for p, _ in files}
    texts = {s: [t for p, t in files if split[p] == s] for s in SPLITS}
    for s in SPLITS:
        if not texts[s]:
            raise ValueError(f"the {s} split is empty ({len(files)} files, eval_fraction={eval_fraction})")
    tok = train_tokenizer(texts["train"], vocab_size)
    ids = {s: encode_docs(tok, texts[s]) for s in SPLITS}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    for s in SPLITS:
        np.save(out / f"{s}.npy", ids[s])
    meta = {"vocab_size": tok.get_vocab_size(), "eos_id": EOS_ID, "eos_token": EOS_TOKEN,
            "dtype": str(ids["train"].dtype), "eval_fraction": eval_fraction,
            "splits": {s: {"files": len(texts[s]), "tokens": int(ids[s].size),
                           "bytes": sum(len(t.encode("utf-8")) for t in texts[s])} for s in SPLITS},
            "python_version": sys.version.split()[0], "stdlib_root": str(root),
            "eval_files": [p for p, _ in files if split[p] == "eval"], "skipped_non_utf8": skipped}
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def load_tokenizer(data_dir):
    """The `tokenizers.Tokenizer` saved by `build_dataset` in data_dir (`formats.tokenizer.load_tokenizer`)."""
    path = Path(data_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run experiments/make_data.py --out_dir {data_dir}")
    return tokenizer_file.load_tokenizer(data_dir)


def load_split(data_dir, split):
    """The token array [N] (uint16 or int32, memory-mapped) of split "train" or "eval" in data_dir."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    path = Path(data_dir) / f"{split}.npy"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run experiments/make_data.py --out_dir {data_dir}")
    return np.load(path, mmap_mode="r")


def sample_windows(tokens, rng, batch, length):
    """int32 [batch, length]: contiguous windows of the 1-D tokens, start uniform in [0, N - length]."""
    if np.ndim(tokens) != 1:
        raise ValueError(f"tokens: expected a 1-D token array, got shape {list(np.shape(tokens))}")
    n = len(tokens)
    if length < 1 or batch < 1:
        raise ValueError(f"batch and length must be positive, got batch={batch}, length={length}")
    if n < length:
        raise ValueError(f"{n} tokens are fewer than the window length {length}")
    starts = rng.integers(0, n - length + 1, size=batch)
    return np.asarray(tokens[starts[:, None] + np.arange(length)], np.int32)


def eval_prompts(tokens, n, prompt_len, eos_id=0, seed=0):
    """n prompts of prompt_len ids from the 1-D tokens, each inside one document (no eos).

    Starts are drawn without replacement, uniformly over every position whose window holds no eos,
    with np.random.default_rng(seed); prompts come in the order drawn. Windows may overlap.
    """
    if n < 1 or prompt_len < 1:
        raise ValueError(f"n and prompt_len must be positive, got n={n}, prompt_len={prompt_len}")
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"tokens: expected a 1-D token array, got shape {list(tokens.shape)}")
    if len(tokens) < prompt_len:
        raise ValueError(f"{len(tokens)} tokens are fewer than the prompt length {prompt_len}")
    eos_before = np.concatenate([[0], np.cumsum(tokens == eos_id)])  # eos count in tokens[:i]
    starts = np.flatnonzero(eos_before[prompt_len:] == eos_before[:len(tokens) - prompt_len + 1])
    if len(starts) < n:
        raise ValueError(f"only {len(starts)} eos-free windows of {prompt_len} tokens, {n} prompts asked")
    picked = np.random.default_rng(seed).choice(starts, size=n, replace=False)
    return [tokens[s:s + prompt_len].astype(np.int64).tolist() for s in picked]
