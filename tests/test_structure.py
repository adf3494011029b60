"""The package's structure (docs/architecture.md): imports go one way and form no cycle (function-level
imports included), no private name crosses a file, jax._src is fenced in one module, module docstrings
state a contract in at most 30 lines (the history lives in docs/perf/), no work-log references."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent / "eagle3_jax"
LAYERS = {"formats": {"formats"}, "pallas": {"pallas", "formats"},
          "models": {"models", "pallas", "formats", "checks", "parallel"},
          "parallel": {"models.config", "pallas", "formats", "checks"}}  # what each layer may import of the package


def _modules():
    mods = {}
    for p in sorted(ROOT.rglob("*.py")):
        parts = ["eagle3_jax", *p.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = p
    return mods


def _imports(name, path, mods):
    """[(line, module imported, name imported or None, local alias)] of every import in the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, None, a.asname) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".")[:None if path.name == "__init__.py" else -1]
                base = ".".join(pkg[:len(pkg) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((node.lineno, sub if sub in mods else base, None if sub in mods else a.name,
                            a.asname or a.name))
    return out


def test_import_graph_and_private_names():
    mods = _modules()
    graph, private, src_users, upward = {m: set() for m in mods}, [], set(), []
    for m, p in mods.items():
        aliases = {}
        for line, target, name, alias in _imports(m, p, mods):
            if target.startswith("jax._src"):
                src_users.add(m)
            if target not in mods or target == m:
                continue
            graph[m].add(target)
            aliases[alias or target] = target
            if name and name.startswith("_"):
                private.append(f"{p.name}:{line} imports {target}.{name}")
            layer, used = m.split(".")[1:2], target.split(".")[1:3]
            if layer and layer[0] in LAYERS and not {used[0], ".".join(used)} & LAYERS[layer[0]]:
                upward.append(f"{m} imports {target}")
        for node in ast.walk(ast.parse(p.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                private.append(f"{p.name}:{node.lineno} reads {aliases[node.value.id]}.{node.attr}")
    state, cycles = {}, []

    def visit(u, stack):
        state[u] = 1
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                cycles.append(stack[stack.index(v):] + [v])
            elif v not in state:
                visit(v, stack + [v])
        state[u] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles
    assert not private, private
    assert not upward, upward
    assert src_users <= {"eagle3_jax.pallas.lowering"}, src_users


def test_docstrings_and_no_work_log():
    long, words = [], []
    for p in ROOT.rglob("*.py"):
        text = p.read_text()
        doc = ast.get_docstring(ast.parse(text), clean=False) or ""
        if len(doc.splitlines()) > 30:
            long.append((p.name, len(doc.splitlines())))
        words += [f"{p.name}: {m.group(0)}" for m in re.finditer(r"(?i)\bsession\b|\bbranch\b", text)]
    assert not long, long
    assert not words, words


# Measured figures belong in docs/perf/*.md and experiments/results/, not in the package's comments
# and strings; select.py's thresholds may name the JSON that justifies them. The file names the code
# reads or writes are not figures.
_FIGURE = re.compile(r"\b\d+(?:\.\d+)?\s?(?:us|µs|ns|ms)\b|\b\d+\.\d+\s?s\b|\b\d+(?:\.\d+)?\s?[KMGT]B/s\b"
                     r"|\b\d+(?:\.\d+)?\s?T?FLOP/s\b|\b\d+\.\d+x\b|\b\d+(?:\.\d+)?x (?:faster|slower)\b"
                     r"|\b\d+(?:\.\d+)?%[^\n]{0,40}\broofline\b")
_JSON = re.compile(r"(?:[\w.-]|\{[\w,]*\})*\w\.json\b")
_FILE_NAMES = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "model.safetensors.index.json", "eagle3_jax.json", "meta.json", "eval_prompts.json",
               "train_log.json"}


def _text_lines(path):
    """(line, text) of every comment and string literal (docstrings included) in the file."""
    import io
    import tokenize
    kinds = {tokenize.COMMENT, tokenize.STRING} | {getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type in kinds:
            for i, text in enumerate(tok.string.splitlines()):
                yield tok.start[0] + i, text


def test_no_figures_in_package_comments():
    hits = []
    for p in sorted(ROOT.rglob("*.py")):
        rel = p.relative_to(ROOT.parent).as_posix()
        for line, text in _text_lines(p):
            found = [m.group(0) for m in _FIGURE.finditer(text)]
            if rel != "eagle3_jax/pallas/select.py":
                found += [m.group(0) for m in _JSON.finditer(text) if m.group(0) not in _FILE_NAMES]
            if found:
                hits.append(f"{rel}:{line}: {', '.join(found)}")
    assert not hits, "measured figures or JSON names (move them to docs/perf/):\n" + "\n".join(hits)


def _dotted(node):
    """'a.b.c' for an attribute chain on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def test_experiments_structure():
    """experiments/ uses the package's public names only, and jax._src from one module at most
    (experiments/lib/timing.py)."""
    mods = _modules()
    exp = ROOT.parent / "experiments"
    private, src_users = [], set()
    for p in sorted(exp.rglob("*.py")):
        rel = p.relative_to(ROOT.parent).as_posix()
        name = ".".join(p.relative_to(ROOT.parent).with_suffix("").parts)
        aliases = {}
        for line, target, imported, alias in _imports(name, p, mods):
            if target.startswith("jax._src"):
                src_users.add(rel)
            if target in mods:
                if imported and imported.startswith("_"):
                    private.append(f"{rel}:{line} imports {target}.{imported}")
                if imported is None and alias:
                    aliases[alias] = target
        for node in ast.walk(ast.parse(p.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            dotted = _dotted(node)
            if dotted and (dotted == "jax._src" or dotted.startswith("jax._src.")):
                src_users.add(rel)
            base = _dotted(node.value)
            if not base or not node.attr.startswith("_") or node.attr.startswith("__"):
                continue
            head, _, rest = base.partition(".")
            module = aliases[head] + ("." + rest if rest else "") if head in aliases else base
            if module in mods:
                private.append(f"{rel}:{node.lineno} reads {module}.{node.attr}")
    src_extra = sorted(src_users - {"experiments/lib/timing.py"})
    assert not private and not src_extra, {"private names": private, "jax._src outside lib/timing.py": src_extra}
