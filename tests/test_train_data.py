"""eagle3_jax.train.data on a small synthetic source tree: files, split, tokenizer, arrays, sampling."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from eagle3_jax.train import data

TEXTS = {
    "a.py": "def f(x):\n\treturn x + 1  # tab-indented\n",
    "pkg/__init__.py": '"""Paquet: déjà vu, 日本語, emoji \U0001f600."""\n',
    "pkg/mod.py": "class A:\n    def g(self):\n        if True:\n            return [1,  2,\t3]\r\n\n\n",
    "pkg/sub/deep.py": "import os\n\n\nprint(os.sep)   \n" * 5,
    "b.py": "x = '<|endoftext|>'  # the eos text, as ordinary source\n",
    "c.py": "for i in range(10):\n    print(i ** 2)\n" * 3,
    "d.py": "# comment only\n",
    "e.py": "",
}
EVAL_FRACTION = 0.5


@pytest.fixture
def root(tmp_path):
    r = tmp_path / "lib"
    for rel, text in TEXTS.items():
        (r / rel).parent.mkdir(parents=True, exist_ok=True)
        (r / rel).write_bytes(text.encode("utf-8"))
    (r / "latin1.py").write_bytes("s = 'caf\xe9'\n".encode("latin-1"))  # not UTF-8: skipped
    (r / "notes.txt").write_text("not python\n")
    for excluded in ("site-packages/x", "dist-packages"):
        (r / excluded).mkdir(parents=True)
        (r / excluded / "skip.py").write_text("skipped = True\n")
    return r


def test_stdlib_files_reads_sorted_utf8_py_only(root):
    files = data.stdlib_files(root)
    assert [p for p, _ in files] == sorted(TEXTS)
    assert dict(files) == TEXTS  # exact text: tabs, \r\n, trailing spaces, non-ASCII


def test_stdlib_files_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        data.stdlib_files(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "x.txt").write_text("x")
    with pytest.raises(ValueError, match="no UTF-8"):
        data.stdlib_files(tmp_path / "empty")


def test_default_root_is_the_stdlib():
    paths = {p for p, _ in data.stdlib_files()}
    assert {"os.py", "json/__init__.py"} <= paths
    assert not any("site-packages" in p or "dist-packages" in p for p in paths)


def test_split_is_deterministic_and_balanced():
    names = [f"pkg{i % 7}/mod_{i}.py" for i in range(2000)]
    first = [data.split_of(n) for n in names]
    assert first == [data.split_of(n) for n in names]
    assert 15 <= first.count("eval") <= 70  # about 2% of 2000
    # Fixed by sha256 of the path: the same on every machine and Python version.
    assert [data.split_of(n, 0.5) for n in ("os.py", "json/__init__.py", "a.py", "b.py")] == \
        ["train", "train", "train", "eval"]
    assert data.split_of("os.py", 0.0) == "train" and data.split_of("os.py", 1.0) == "eval"
    with pytest.raises(ValueError, match="eval_fraction"):
        data.split_of("os.py", 1.5)


def test_tokenizer_round_trip_eos_and_determinism():
    pytest.importorskip("tokenizers")
    texts = list(TEXTS.values())
    tok = data.train_tokenizer(texts, vocab_size=320)
    assert tok.token_to_id(data.EOS_TOKEN) == data.EOS_ID == 0 and tok.get_vocab_size() <= 320
    assert data.train_tokenizer(texts, vocab_size=320).to_str() == tok.to_str()
    unseen = " \t\n  leading spaces\r\n\ttabs ÿ \x00 中文 \U0001f680 trailing  \n\n"
    for t in texts + [unseen]:
        assert tok.decode(tok.encode(t).ids) == t
    ids = data.encode_docs(tok, texts + [unseen])
    assert ids.dtype == np.uint16
    docs = np.split(ids, np.flatnonzero(ids == 0) + 1)
    assert docs[-1].size == 0 and len(docs) == len(texts) + 2  # one eos per document, "<|endoftext|>" in b.py is text
    assert [tok.decode(d[:-1].tolist()) for d in docs[:-1]] == texts + [unseen]
    tok.encode_special_tokens = False
    np.testing.assert_array_equal(data.encode_docs(tok, texts + [unseen]), ids)
    assert not tok.encode_special_tokens  # restored


def test_build_dataset_and_load(root, tmp_path):
    pytest.importorskip("tokenizers")
    out = tmp_path / "out"
    meta = data.build_dataset(out, vocab_size=300, eval_fraction=EVAL_FRACTION, root=root)
    assert sorted(p.name for p in out.iterdir()) == ["eval.npy", "meta.json", "tokenizer.json", "train.npy"]
    assert json.loads((out / "meta.json").read_text()) == meta
    assert meta["eval_files"] == [p for p in sorted(TEXTS) if data.split_of(p, EVAL_FRACTION) == "eval"]
    assert meta["skipped_non_utf8"] == ["latin1.py"] and meta["eos_id"] == 0
    s = meta["splits"]
    assert s["train"]["files"] + s["eval"]["files"] == len(TEXTS) and s["eval"]["files"] == len(meta["eval_files"])
    tok = data.load_tokenizer(out)
    assert tok.encode_special_tokens and tok.decode(tok.encode(TEXTS["b.py"]).ids) == TEXTS["b.py"]
    for split in data.SPLITS:
        ids = data.load_split(out, split)
        assert isinstance(ids, np.memmap) and ids.size == s[split]["tokens"]
        assert int((ids == 0).sum()) == s[split]["files"] and ids[-1] == 0
        texts = [TEXTS[p] for p in sorted(TEXTS) if data.split_of(p, EVAL_FRACTION) == split]
        np.testing.assert_array_equal(ids, data.encode_docs(tok, texts))
        assert sum(len(t.encode()) for t in texts) == s[split]["bytes"]
    again = data.build_dataset(tmp_path / "again", vocab_size=300, eval_fraction=EVAL_FRACTION, root=root)
    assert again == meta
    for name in ("tokenizer.json", "train.npy", "eval.npy"):
        assert (tmp_path / "again" / name).read_bytes() == (out / name).read_bytes()
    with pytest.raises(FileNotFoundError, match="missing.*train.npy"):
        data.load_split(tmp_path / "missing", "train")
    with pytest.raises(ValueError, match="split must be"):
        data.load_split(out, "test")
    with pytest.raises(ValueError, match="eval split is empty"):
        data.build_dataset(tmp_path / "none", vocab_size=300, eval_fraction=0.0, root=root)


def test_sample_windows():
    tokens = np.arange(100, dtype=np.uint16)
    rng = np.random.default_rng(0)
    w = data.sample_windows(tokens, rng, batch=64, length=10)
    assert w.shape == (64, 10) and w.dtype == np.int32
    assert (np.diff(w, axis=1) == 1).all() and w.min() >= 0 and w.max() <= 99  # contiguous, in bounds
    assert data.sample_windows(tokens, rng, 3, 100).tolist() == [list(range(100))] * 3
    np.testing.assert_array_equal(data.sample_windows(tokens, np.random.default_rng(1), 4, 5),
                                  data.sample_windows(tokens, np.random.default_rng(1), 4, 5))
    with pytest.raises(ValueError, match="fewer than the window length"):
        data.sample_windows(tokens, rng, 1, 101)


def test_eval_prompts():
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 50, size=500).astype(np.uint16)
    tokens[rng.choice(500, size=40, replace=False)] = 0
    prompts = data.eval_prompts(tokens, n=20, prompt_len=4, seed=3)
    assert prompts == data.eval_prompts(tokens, n=20, prompt_len=4, seed=3)
    assert len(prompts) == 20 and all(len(p) == 4 and 0 not in p for p in prompts)
    assert len({tuple(p) for p in prompts}) > 1
    text = tokens.tolist()
    assert all(any(text[i:i + 4] == p for i in range(497)) for p in prompts)  # contiguous windows
    with pytest.raises(ValueError, match="eos-free windows"):
        data.eval_prompts(np.array([1, 2, 0, 3, 4, 0], np.uint16), n=1, prompt_len=3)
    with pytest.raises(ValueError, match="fewer than the prompt length"):
        data.eval_prompts(np.array([1, 2], np.uint16), n=1, prompt_len=3)


def test_make_data_script(root, tmp_path):
    pytest.importorskip("tokenizers")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, os.path.join(repo, "experiments", "make_data.py"), "--out_dir", str(out),
                        "--vocab_size", "300", "--eval_fraction", str(EVAL_FRACTION), "--root", str(root)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "bytes/token" in r.stdout and "1 non-UTF-8 files skipped" in r.stdout
    assert json.loads((out / "meta.json").read_text())["splits"]["eval"]["files"] == 5


def test_sampling_rejects_2d_tokens():
    # a [docs, len] array used to give 3-D "windows" (sample_windows) or a broadcast error (eval_prompts)
    tokens = np.ones((4, 10), np.uint16)
    with pytest.raises(ValueError, match=r"tokens: expected a 1-D token array, got shape \[4, 10\]"):
        data.sample_windows(tokens, np.random.default_rng(0), 2, 3)
    with pytest.raises(ValueError, match=r"tokens: expected a 1-D token array, got shape \[4, 10\]"):
        data.eval_prompts(tokens, 1, 2)
