"""The package's layering, checked from the source: no import circle, no import of a higher layer.

Every `import` / `from ... import` of an offline_rec module counts, function-level ones included
(a lazy import is still a dependency). Layers, lowest first; a module may import its own layer
and the ones below, never one above, and the module graph has no cycle.
"""

import ast
from pathlib import Path

import pytest
from paths import REPO

PACKAGE = REPO / "offline_rec"
LAYERS = [
    {"offline_rec", "offline_rec.errors", "offline_rec.schema", "offline_rec.files", "offline_rec.progress",
     "offline_rec.coerce", "offline_rec.preemption", "offline_rec.algorithms", "offline_rec.options",
     "offline_rec.ray_cluster", "offline_rec.devices"},
    {"offline_rec.models"},
    {"offline_rec.tasks"},
    {"offline_rec.data"},
    {"offline_rec.hub"},
    {"offline_rec.rollout", "offline_rec.record"},
    {"offline_rec.training"},
    {"offline_rec.eval"},
    {"offline_rec.demo"},
    {"offline_rec.cli", "offline_rec.display", "offline_rec.summaries", "offline_rec.__main__"},
]


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The offline_rec modules `path` imports (for `from X import name`, X.name when that is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("offline_rec"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("offline_rec"):
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if candidate in modules else node.module)
    return found


def layer_of(module: str) -> int:
    for level, prefixes in enumerate(LAYERS):
        if module in prefixes:
            return level
    for level, prefixes in enumerate(LAYERS):
        if any(module.startswith(prefix + ".") for prefix in prefixes if prefix != "offline_rec"):
            return level
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS in {__file__}")


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in files}
    return {module_name(p): imported_modules(p, modules) - {module_name(p)} for p in files}


def test_no_module_imports_a_higher_layer(graph):
    upward = [f"{source} (layer {layer_of(source)}) imports {target} (layer {layer_of(target)})"
              for source, targets in graph.items() for target in sorted(targets)
              if layer_of(target) > layer_of(source)]
    assert not upward, "\n".join(upward)


def test_no_import_circle(graph):
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if target not in graph:
                continue
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            pytest.fail("import circle: " + " -> ".join(cycle))


def test_the_package_modules_all_have_a_docstring(graph):
    missing = [name for name, path in ((module_name(p), p) for p in PACKAGE.rglob("*.py"))
               if ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) is None]
    assert not missing, missing


def test_no_two_classes_of_the_package_share_a_name():
    """A reader who meets a class name (in a traceback, a doc, a grep) finds one class."""
    where: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(module_name(path))
    shared = {name: modules for name, modules in where.items() if len(modules) > 1}
    assert not shared, shared


# --------------------------------------------------------------------------------------------
# backends: what a backend can do is read from its class in rollout/backends/, never from its name


def backend_name_comparisons(source: str, names: set[str]) -> list[int]:
    """Lines of `source` that compare a value with one of `names` (==, !=, in / not in a literal collection)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        literals = [e for o in operands for e in (o.elts if isinstance(o, (ast.Tuple, ast.List, ast.Set)) else [o])]
        if any(isinstance(e, ast.Constant) and e.value in names for e in literals):
            lines.append(node.lineno)
    return lines


def test_backend_names_are_compared_only_inside_rollout_backends():
    from offline_rec.rollout.backends import BACKENDS

    names = {key for key in BACKENDS} | {backend.engine for backend in BACKENDS.values()}
    assert names >= {"hf", "vllm", "transformers"}
    backends_folder = PACKAGE / "rollout" / "backends"
    found = [f"{path.relative_to(REPO)}:{line}"
             for path in sorted(PACKAGE.rglob("*.py")) if backends_folder not in path.parents
             for line in backend_name_comparisons(path.read_text(encoding="utf-8"), names)]
    assert not found, "compare a capability of backends.BACKENDS[name] instead of the name: " + ", ".join(found)


def test_the_backend_name_check_finds_every_form_of_comparison():
    names = {"hf", "vllm", "transformers"}
    source = ('a = name == "hf"\nb = "vllm" != engine\nc = engine in ("transformers", "x")\n'
              'd = name not in ["vllm"]\ne = name == "other"\nf = {"hf": 1}\n')
    assert backend_name_comparisons(source, names) == [1, 2, 3, 4]


def test_every_backend_declares_its_capabilities():
    from offline_rec.rollout.backends import BACKENDS
    from offline_rec.rollout.backends.base import Backend

    declared = {name for name in Backend.__annotations__ if name not in ("engine_version", "model_name", "dtype",
                                                                          "tokenizer")}
    assert {"name", "engine", "batches_prompts", "tensor_parallel", "evaluates_in_child"} <= declared
    for key, backend in BACKENDS.items():
        assert backend.name == key
        assert all(hasattr(backend, attribute) for attribute in declared), (key, declared)
        assert callable(backend.load)
