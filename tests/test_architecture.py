"""The structure rules of docs/architecture.md: folders import one way (no cycle, imports inside functions
included), the model knows nothing of parallelism or memory techniques, and one function applies the techniques in
DESIGN.md's order."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import ROOT, tiny_config

PACKAGE = ROOT / "src" / "vlaforge"
# Lowest first. A module may import its own floor and any floor below it, never one above.
LAYERS = [("errors", "registry", "progress", "outputs", "seeding", "hub"), ("data",), ("config",), ("models",),
          ("techniques",), ("distributed",), ("checkpoints",), ("training", "inference"), ("serving",), ("evaluation",),
          ("planner", "export"), ("diagnostics",), ("cli", "cli_deploy", "lerobot_train", "lerobot_flags", "__main__")]
FLOOR = {name: i for i, names in enumerate(LAYERS) for name in names}


def folder_imports() -> list[tuple[str, str, str]]:
    """(importing floor, imported floor, where) for every `vlaforge.*` import of another top-level module."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).parts
        here = rel[0] if len(rel) > 1 else rel[0][:-3]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] == "vlaforge" and len(parts) > 1 and parts[1] != here:
                    out.append((here, parts[1], f"{'/'.join(rel)}:{node.lineno}"))
    return out


def test_every_module_has_a_floor():
    modules = {p.name[:-3] if p.is_file() else p.name for p in PACKAGE.iterdir()
               if (p.suffix == ".py" and p.name != "__init__.py") or (p.is_dir() and (p / "__init__.py").exists())}
    assert modules <= set(FLOOR), f"give these a floor in LAYERS and docs/architecture.md: {modules - set(FLOOR)}"


def test_folders_import_only_downwards():
    upward = [f"{a} -> {b} ({where})" for a, b, where in folder_imports() if FLOOR[b] > FLOOR[a]]
    assert not upward, "imports that point up a floor (move the code to the floor it belongs on):\n" + "\n".join(upward)
    same = {(a, b) for a, b, _ in folder_imports() if FLOOR[a] == FLOOR[b]}
    assert not {(a, b) for a, b in same if (b, a) in same}, "two modules of one floor import each other"


def module_graph() -> dict[str, set[str]]:
    """Module -> the vlaforge modules it imports (module level or inside a function; `from pkg import mod` names the
    submodule), by dotted name."""
    def name_of(path: Path) -> str:
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    paths = {name_of(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                module = (".".join(base[:len(base) - node.level + 1] + [node.module or ""]).rstrip(".")
                          if node.level else node.module or "")
                deps |= {module, *(f"{module}.{a.name}" for a in node.names)}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        graph[name] = {d for d in deps if d in paths and d != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of more than one module (Tarjan), each sorted."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while not part or part[-1] != v:
                part.append(stack.pop())
                on.discard(part[-1])
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_circle_inside_a_folder():
    """Modules of one folder import one way too: a circle means no file of it can be read, tested or changed alone
    (a package's `__init__` aside: it only names the folder)."""
    graph = module_graph()
    inside = {m: {d for d in deps if d.rsplit(".", 1)[0] == m.rsplit(".", 1)[0] and d in graph
                  and not PACKAGE.joinpath(*d.split(".")[1:], "__init__.py").is_file()}
              for m, deps in graph.items()}
    found = circles(inside)
    assert not found, "modules of one folder that import each other (move what both need to a leaf module):\n" + \
        "\n".join(" <-> ".join(c) for c in found)


def test_the_circle_check_finds_a_circle():
    assert circles({"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "a.w": {"a.x"}}) == [["a.x", "a.y", "a.z"]]
    assert circles({"a.x": {"a.y"}, "a.y": set()}) == []


def test_the_runtime_export_and_serving_never_import_the_trainer():
    """Checkpoints sit a floor below `training` so that what runs a trained policy loads it without the trainer."""
    bad = [f"{a} -> training ({where})" for a, b, where in folder_imports()
           if b == "training" and a in ("inference", "serving", "evaluation", "export")]
    assert not bad, "\n".join(bad)


MAX_LINES = 500


def test_no_source_file_over_500_lines():
    """One concern a file (STYLE.md 7): a file past 500 lines holds more than one; split it along its concerns."""
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these along their concerns: {long}"


def test_the_vla_knows_nothing_of_parallelism_or_memory_techniques():
    tree = ast.parse((PACKAGE / "models" / "vla.py").read_text())
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef)) and n.body
                  and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    words = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            words.add(node.id)
        elif isinstance(node, ast.Attribute):
            words.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            words.add(node.value)
    banned = ("parallel", "shard", "checkpoint", "offload", "fsdp", "distributed", "mesh", "autocast", "compile")
    assert not {w for w in words for b in banned if b in w.lower()}


def test_apply_techniques_runs_in_designs_order(monkeypatch):
    """Every step recorded with a layout of every kind (tp, cp, pp, data parallel): precision (fp8 converters),
    LoRA adapters, pipeline split, tensor then context parallel, checkpointing, offload, compile, data-parallel
    sharding, then the pipeline's tied weights registered with the sharded model's reducer."""
    from vlaforge.distributed import apply

    calls: list[str] = []

    def record(name, result=None):
        return lambda *a, **k: calls.append(name) or result

    monkeypatch.setattr(apply, "apply_precision", record("precision", "setup"))
    monkeypatch.setattr(apply, "apply_lora", record("lora", {}))
    monkeypatch.setattr(apply, "split_for_stage", record("pipeline", ("stage", "plan")))
    monkeypatch.setattr(apply, "apply_tensor_parallel", record("tensor_parallel"))
    monkeypatch.setattr(apply, "apply_sequence_parallel", record("context_parallel"))
    monkeypatch.setattr(apply, "apply_checkpointing", record("checkpointing"))
    monkeypatch.setattr(apply, "apply_offload", record("offload"))
    monkeypatch.setattr(apply, "compile_blocks", record("compile"))
    monkeypatch.setattr(apply, "apply_data_parallel", record("data_parallel", "reducer"))
    monkeypatch.setattr(apply, "tie_stages", record("tied_stages"))
    cfg = tiny_config(train={"compile": True})
    dims = SimpleNamespace(distributed=True, backend="fsdp2", pp=2, tp=2, cp=2, dp_shard=1, sequence_parallel=False)
    mesh = {"tp": None}
    applied = apply.apply_techniques(object(), cfg, "cpu", dims, mesh, tokens=64)
    assert calls == ["precision", "lora", "pipeline", "tensor_parallel", "context_parallel", "checkpointing", "offload",
                     "compile", "data_parallel", "tied_stages"]
    assert (applied.precision, applied.stage, applied.reducer) == ("setup", "stage", "reducer")
    calls.clear()
    apply.apply_techniques(object(), tiny_config(), "cpu")  # one process: no layout steps, no compile
    assert calls == ["precision", "lora", "checkpointing", "offload"]


@pytest.mark.parametrize("package", sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()))
def test_each_package_says_what_lives_there_and_what_it_may_import(package):
    doc = ast.get_docstring(ast.parse((PACKAGE / package / "__init__.py").read_text())) or ""
    assert f"floor {FLOOR[package]}" in doc and "import" in doc, doc
