"""The package's structure (docs/architecture.md): imports go one way and form no cycle (function-level
imports included), no private name crosses a file, jax._src is fenced in one module, module docstrings
state a contract in at most 30 lines (the history lives in docs/perf/), no work-log references."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent / "eagle3_jax"
LAYERS = {"formats": {"formats"}, "pallas": {"pallas", "formats"},
          "models": {"models", "pallas", "formats", "checks"}}  # what each layer may import of the package


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
            layer, used = m.split(".")[1:2], target.split(".")[1]
            if layer and layer[0] in LAYERS and used not in LAYERS[layer[0]]:
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
