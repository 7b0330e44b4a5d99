"""The house rules of docs/ARCHITECTURE.md, checked over the source with the standard library's ast.

Imports only downward along the layers the page lists (and the layers name every package and
top-level module), no import cycles, no module importing a private name (or a private
module) from another, no module listing in ``__all__`` what it only imports, functions at
most 80 lines and modules at most 600, at most 20 top-level names, and the precision and
mode names spelled out once (in memfit/vocab.py).
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

import memfit
from memfit.vocab import CHECKPOINT_MODES, PRECISIONS

SRC = Path(__file__).resolve().parents[1] / "src" / "memfit"
ARCHITECTURE = SRC.parents[1] / "docs" / "ARCHITECTURE.md"
#: The longest a module may be: as long as its one concern needs, within reason (a cap of
#: 350 split concerns across files; the redesign issue raises it to about 600).
MAX_LINES = 600
#: The most names the top-level package exports.
MAX_PUBLIC = 20
#: The longest a function may be (most are under 40 lines).
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _target(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(path: Path, modules: dict[str, Path]) -> list[tuple[str, str]]:
    """(module imported, name imported) for every memfit import in ``path``, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "memfit":
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.append((full if full in modules else node.module, alias.name))
        elif isinstance(node, ast.Import):
            found += [(a.name, "") for a in node.names if a.name.split(".")[0] == "memfit"]
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        for imported, _ in _imports(path, modules):
            target = _target(imported, modules)
            if target and target != mod and not mod.startswith(target + "."):
                graph[mod].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _layers() -> dict[str, int]:
    """``{unit: layer}`` from the ``layer N: a, b, c`` lines of docs/ARCHITECTURE.md."""
    found = {}
    for number, names in re.findall(r"^layer (\d+): (.+)$", ARCHITECTURE.read_text(encoding="utf-8"), re.M):
        for name in names.split(","):
            found[name.strip()] = int(number)
    return found


def _unit(module: str) -> str:
    """The layered unit a module belongs to: its top-level package or module (``memfit`` itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "memfit"


def test_the_layers_name_every_package_and_module_once() -> None:
    units = {_unit(m) for m in _modules()}
    layers = _layers()
    assert set(layers) == units, "docs/ARCHITECTURE.md's layers and src/memfit differ"
    text = ARCHITECTURE.read_text(encoding="utf-8")
    lines = [ln for ln in text.splitlines() if re.match(r"^layer \d+: ", ln)]
    assert sum(len(ln.split(":", 1)[1].split(",")) for ln in lines) == len(layers)  # each once


def test_imports_point_down_the_layers() -> None:
    layers = _layers()
    upward = [
        f"{mod} (layer {layers[_unit(mod)]}) imports {dep} (layer {layers[_unit(dep)]})"
        for mod, deps in _graph().items()
        for dep in sorted(deps)
        if layers.get(_unit(dep), -1) > layers.get(_unit(mod), -1)
    ]
    assert upward == []


def test_the_direction_check_finds_an_upward_import() -> None:
    layers = {"low": 0, "high": 1}
    graph = {"memfit.low.a": {"memfit.high.b"}, "memfit.high.b": set()}
    assert [m for m, deps in graph.items() for d in deps if layers[_unit(d)] > layers[_unit(m)]] == [
        "memfit.low.a"
    ]


def _defined(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def _exported(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            return [e.value for e in getattr(node.value, "elts", []) if isinstance(e, ast.Constant)]
    return []


def test_only_package_facades_re_export() -> None:
    found = set()
    for mod, path in _modules().items():
        if path.name == "__init__.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        found |= {f"{mod}.{name}" for name in _exported(tree) if name not in _defined(tree)}
    assert found == set()


def test_the_import_graph_has_no_cycles() -> None:
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_a_private_name_from_another() -> None:
    modules = _modules()
    private = []
    for mod, path in modules.items():
        for imported, name in _imports(path, modules):
            hidden = [p for p in imported.split(".") if p.startswith("_") and p != "__init__"]
            if (name.startswith("_") or hidden) and _target(imported, modules) != mod:
                private.append(f"{mod} imports {name or imported} from {imported}")
    assert private == []


def test_modules_stay_small() -> None:
    long = {m for m, p in _modules().items() if len(p.read_text().splitlines()) > MAX_LINES}
    assert long == set()


def test_functions_fit_on_a_screen() -> None:
    long = set()
    for mod, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            function = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            if function and (node.end_lineno or node.lineno) - node.lineno + 1 > MAX_FUNCTION_LINES:
                long.add(f"{mod}.{node.name}")  # type: ignore[attr-defined]
    assert long == set()


_DEFINED_NOTE = re.compile(r"^\s*# Note \[([^\]]+)\]\s*$", re.M)
_NOTE_REFERENCE = re.compile(r"[Ss]ee Note \[([^\]]+)\]|\(Note \[([^\]]+)\]\)")


def test_design_notes_are_named_and_every_reference_has_its_note() -> None:
    """Torch-style notes: ``# Note [name]`` on its own line, defined once; ``See Note [name]``
    refers to one that exists; no anonymous ``# NOTE:`` blocks."""
    texts = {m: p.read_text(encoding="utf-8") for m, p in _modules().items()}
    anonymous = [m for m, t in texts.items() if "# NOTE" in t]
    defined = [name for t in texts.values() for name in _DEFINED_NOTE.findall(t)]
    referenced = {a or b for t in texts.values() for a, b in _NOTE_REFERENCE.findall(t)}
    assert anonymous == []
    assert sorted(n for n in set(defined) if defined.count(n) > 1) == []
    assert sorted(referenced - set(defined)) == []


def test_the_top_level_exports_few_names_and_none_shadows_a_subpackage() -> None:
    assert len(memfit.__all__) <= MAX_PUBLIC
    assert all(hasattr(memfit, n) for n in memfit.__all__)
    subpackages = {p.name for p in SRC.iterdir() if (p / "__init__.py").exists()}
    assert subpackages.isdisjoint(memfit.__all__)


def _name_lists(path: Path) -> list[tuple[str, ...]]:
    """Tuple and list literals made only of string constants."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        strings = isinstance(node, ast.Tuple | ast.List) and all(
            isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts
        )
        if strings and node.elts:  # type: ignore[attr-defined]
            found.append(tuple(e.value for e in node.elts))  # type: ignore[attr-defined]
    return found


def test_precision_and_mode_names_are_spelled_out_once() -> None:
    """A literal list of two or more precisions, or of checkpoint modes, appears only in vocab.py."""
    vocabularies = [set(PRECISIONS), set(CHECKPOINT_MODES)]
    spelled = [
        f"{p.relative_to(SRC)}: {names}"
        for p in SRC.rglob("*.py")
        if p.name != "vocab.py"
        for names in _name_lists(p)
        if any(len(set(names)) >= 2 and set(names) <= vocab for vocab in vocabularies)
    ]
    assert spelled == []


#: Methods that change a list or dict in place.
_MUTATORS = {"append", "extend", "insert", "update", "pop", "clear", "setdefault", "remove", "sort"}


def _plan_fields() -> set[str]:
    from memfit.records import MadeFor, Plan, PlanReport

    return {f.name for cls in (Plan, PlanReport, MadeFor) for f in dataclasses.fields(cls)}


def _writes_to_plans(tree: ast.AST, fields: set[str]) -> list[int]:
    """Lines that assign to, or change in place, an attribute named like a field of a plan or
    its report (``x.notes = ...``, ``x.notes.append(...)``, ``x.blocks[k] = ...``)."""
    lines = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for t in targets:
            for part in ast.walk(t):
                inner = part.value if isinstance(part, ast.Subscript) else part
                if (
                    isinstance(inner, ast.Attribute)
                    and inner.attr in fields
                    and isinstance(t, ast.Attribute | ast.Subscript | ast.Tuple)
                ):
                    lines.append(node.lineno)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in _MUTATORS
        ):
            owner = node.func.value
            if isinstance(owner, ast.Attribute) and owner.attr in fields:
                lines.append(node.lineno)
    return sorted(set(lines))


def test_nothing_in_planning_assigns_to_a_plan_or_its_report() -> None:
    """A plan and its report are made whole (``dataclasses.replace`` makes a changed copy): no
    module of the planning package assigns to, or changes in place, an attribute named like one
    of their fields; and the records themselves refuse it."""
    from memfit.records import Plan, PlanReport

    fields = _plan_fields()
    found = {
        f"{mod}:{line}"
        for mod, path in _modules().items()
        if mod.startswith("memfit.planning")
        for line in _writes_to_plans(ast.parse(path.read_text(encoding="utf-8")), fields)
    }
    assert found == set()
    plan = Plan(blocks={})
    for record, name in ((plan, "micro_batches"), (plan.report, "notes")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(record, name, 2)
    assert PlanReport.__dataclass_params__.frozen  # type: ignore[attr-defined]


def test_the_plan_writes_check_finds_a_write() -> None:
    tree = ast.parse("p.notes.append('x')\nq.report = r\nz.blocks['a'] = 'full'\nok = p.notes\n")
    assert _writes_to_plans(tree, {"notes", "report", "blocks"}) == [1, 2, 3]
