"""CPU smoke tests of experiments/eval_tau.py (acceptance on prompt sets: JSON, table, resumable rows) and
of decode.py's chat-formatted prompts, on the embedded pair. Every run here decodes one prompt at a
time (B=1) with short outputs, so they share one decode and one generate executable (the suite's
persistent compilation cache)."""

import json
import os
import sys

import pytest
from experiment_runner import fails, run

from eagle3_jax import assets
from eagle3_jax.formats import chat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLAIN_TEMPLATE = os.path.join(ROOT, "tests", "data", "chat", "plain_text.jinja")
sys.path.insert(0, os.path.join(ROOT, "experiments"))

HUMANEVAL = [{"task_id": f"Test/{i}", "prompt": p, "entry_point": "f"} for i, p in enumerate(
    ["def add(a, b):\n    \"\"\"Return a + b.\"\"\"\n", "import os\n\n\ndef listdir(path):\n",
     "class Stack:\n    def __init__(self):\n"])]
MTBENCH = [{"question_id": 81, "category": "writing", "turns": ["Write a function that sorts a list.", "Now test it."]},
           {"question_id": 101, "category": "coding", "turns": ["def parse(s):", "Explain."]}]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.slow
def test_eval_tau_writes_json_and_resumes(tmp_path):
    he, mt = write_jsonl(tmp_path / "he.jsonl", HUMANEVAL[:1]), write_jsonl(tmp_path / "q.jsonl", MTBENCH)
    out = tmp_path / "res" / "tau.json"
    rows_file = tmp_path / "res" / "tau.rows.jsonl"
    common = ["--dataset", f"humaneval={he}", "--dataset", f"mtbench={mt}", "--max_new_tokens", "8", "--out", str(out),
              "--noprogress"]
    text = run("eval_tau.py", *common)
    assert "HumanEval: 1 prompts from" in text and "prompts: raw text (no chat template)" in text
    assert f"{rows_file}: 0 rows done, 3 prompts to run" in text
    res = json.loads(out.read_text())
    by = {(r["dataset"], r["category"]): r for r in res["summary"]}
    assert list(by) == [("humaneval", None), ("mtbench", None), ("mtbench", "coding"), ("mtbench", "writing")]
    for r in res["summary"]:
        assert r["tau"] >= 1.0 and 0 <= r["accept_rate"] <= 1 and len(r["accept_rate_per_position"]) == 3
        assert r["decode_seconds"] > 0 and r["generate_seconds"] > 0 and r["speedup"] > 0
    assert by[("mtbench", None)]["prompts"] == 2 and by[("mtbench", "writing")]["prompts"] == 1
    assert by[("mtbench", None)]["identical_to_generate"] == 2  # float32 greedy: decode == generate
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    assert [(r["dataset"], r["id"]) for r in rows] == [("humaneval", "Test/0"), ("mtbench", "81"), ("mtbench", "101")]
    # pooled: committed tokens over decode steps of the set's rows; accept rates weighted by steps
    mt_rows = rows[1:]
    assert abs(by[("mtbench", None)]["tau"] - sum(r["committed"] for r in mt_rows)
               / sum(r["slot_steps"] for r in mt_rows)) < 1e-9
    assert by[("mtbench", "coding")]["tau"] == rows[2]["tau"] and by[("humaneval", None)]["tau"] == rows[0]["tau"]
    # the table has the published form: dataset -> tau, the categories under MT-Bench
    table = text[text.index("dataset "):]
    assert "\nHumanEval " in table and "\nMT-Bench " in table and "\n  coding " in table
    assert text.rstrip().splitlines()[-1] == (f"tau: HumanEval {by[('humaneval', None)]['tau']:.2f}, MT-Bench "
                                              f"{by[('mtbench', None)]['tau']:.2f}")
    # a rerun: a row cut short (a run killed while writing it) is dropped; every prompt done, the summary
    # again without loading a model
    with open(rows_file, "a") as f:
        f.write('{"dataset": "humaneval", "id": "Test/2", "cut')
    text = run("eval_tau.py", *common)
    assert "dropped a last row cut short" in text and "3 rows done, 0 prompts to run" in text
    assert len(rows_file.read_text().splitlines()) == 3 and json.loads(out.read_text())["summary"] == \
        json.loads(json.dumps(list(by.values())))
    # other settings than the rows': one line naming the setting
    err = fails("eval_tau.py", *common, "--temperature", "0.5")
    assert err.strip().splitlines()[-1] == (f"error: {rows_file}: made with other settings (temperature: 0.0 there, "
                                            "0.5 now); use another --out, or delete the file to start over")


def test_decode_chat_prompts_file(tmp_path):
    conv = [{"role": "user", "content": "def add(a, b):"}]
    prompts = write_jsonl(tmp_path / "p.jsonl", [conv])
    path = tmp_path / "d.json"
    out = run("decode.py", "--chat", "--chat_template", PLAIN_TEMPLATE, "--prompts_file", prompts, "--system",
              "Write Python.", "--reasoning_effort", "high", "--eos", "<|endoftext|>", "--max_new_tokens", "8",
              "--nobaseline", "--json_out", str(path))
    assert "# system (reasoning: high)\nWrite Python.\n# user\ndef add(a, b):\n# assistant\n" in out
    r = json.loads(path.read_text())
    fmt = chat.ChatFormat.load(assets.TARGET_DIR, PLAIN_TEMPLATE)
    system_conv = [{"role": "system", "content": "Write Python."}, *conv]
    assert r["prompts"] == [fmt.encode(system_conv, reasoning_effort="high")] and r["eos_ids"] == [0]
    assert len(r["decode"]["tokens"][0]) <= 8


def test_chat_flags_fail_in_one_line(tmp_path):
    err = fails("decode.py", "--reasoning_effort", "low", "--prompt", "x")
    assert err.strip().splitlines()[-1] == ("error: --reasoning_effort low: the target has no chat template "
                                            "(--chat_template gives one)")
    bad = write_jsonl(tmp_path / "bad.jsonl", ["fine", [{"role": "bot", "content": "x"}]])
    err = fails("decode.py", "--prompts_file", bad, "--chat_template", PLAIN_TEMPLATE)
    assert err.strip().splitlines()[-1] == (f"error: {bad}:2[0]: \"role\" is 'bot', expected one of ['system', "
                                            "'developer', 'user', 'assistant', 'tool']")
    err = fails("eval_tau.py", "--dataset", f"gsm8k={write_jsonl(tmp_path / 'g.jsonl', [{'problem': 'x'}])}")
    assert err.strip().splitlines()[-1].startswith(f"error: {tmp_path / 'g.jsonl'}:1: no 'question' field (GSM8K as "
                                                   "published: test.jsonl of openai/grade-school-math")
    he = write_jsonl(tmp_path / "h.jsonl", HUMANEVAL)
    err = fails("eval_tau.py", "--chat", "--dataset", f"humaneval={he}")
    assert "error: --chat: " in err and "has no chat template" in err
    # the sampling filters reach decode (which refuses top_p 0); --topk is --branching's old name
    err = fails("eval_tau.py", "--dataset", f"humaneval={he}", "--temperature", "0.6", "--top_p", "0", "--topk", "1")
    assert err.startswith("warning: --topk is deprecated: it is --branching")
    assert err.strip().splitlines()[-1] == "error: top_p: expected a number in (0, 1] or None, got 0.0"
    err = fails("decode.py", "--topk", "2", "--branching", "2")
    assert err.strip().splitlines()[-1] == ("error: --topk 2 and --branching 2: --topk is the deprecated name of "
                                            "--branching; give --branching only")
