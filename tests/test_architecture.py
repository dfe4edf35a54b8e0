"""The package's layering, checked from the source: no import circle, no import of a higher layer.

Every `import` / `from ... import` of an offline_rec module counts, function-level ones included
(a lazy import is still a dependency). Layers, lowest first; a module may import its own layer
and the ones below, never one above, and the module graph has no cycle.
"""

import ast
from pathlib import Path

import pytest
from support.paths import REPO

PACKAGE = REPO / "offline_rec"
LAYERS = [
    {"offline_rec", "offline_rec.errors", "offline_rec.schema", "offline_rec.files", "offline_rec.progress",
     "offline_rec.coerce", "offline_rec.preemption", "offline_rec.objectives", "offline_rec.algorithms",
     "offline_rec.options",
     "offline_rec.ray_cluster", "offline_rec.devices", "offline_rec.workers"},
    {"offline_rec.dataset", "offline_rec.data"},  # the format, below everything that reads or writes it
    {"offline_rec.models"},
    {"offline_rec.tasks"},
    {"offline_rec.rewards", "offline_rec.importers"},  # scoring and importing load models and run task rewards
    {"offline_rec.hub"},
    {"offline_rec.rollout", "offline_rec.record"},
    {"offline_rec.training"},
    {"offline_rec.eval", "offline_rec.view"},
    {"offline_rec.demo", "offline_rec.rounds"},  # the whole loop: rollout, training and eval together
    {"offline_rec.cli", "offline_rec.display", "offline_rec.summaries", "offline_rec.__main__"},
]


OLD_PATH_SHIMS = {"offline_rec.data", "offline_rec.data.dataset", "offline_rec.data.card", "offline_rec.data.validate"}
"""Old import paths kept as re-exports for one release (docs/architecture.md lists them); no module uses them."""


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


def shared_file_names(paths: list[Path]) -> dict[str, list[str]]:
    """File names (besides __init__.py and config.py) that two or more of `paths` have, with the paths."""
    where: dict[str, list[str]] = {}
    for path in paths:
        if path.name not in ("__init__.py", "config.py"):
            where.setdefault(path.name, []).append(str(path))
    return {name: found for name, found in where.items() if len(found) > 1}


def test_no_two_modules_of_the_package_share_a_file_name():
    """A file name says its job: `reward_model.py` in two rooms left a reader guessing which one a traceback meant."""
    modules = [path.relative_to(REPO) for path in sorted(PACKAGE.rglob("*.py"))
               if module_name(path) not in OLD_PATH_SHIMS]
    assert not shared_file_names(modules), shared_file_names(modules)


def test_the_shared_file_name_check_finds_a_repeat():
    paths = [Path("p/a/__init__.py"), Path("p/b/__init__.py"), Path("p/a/config.py"), Path("p/b/config.py"),
             Path("p/a/policy.py"), Path("p/b/policy.py"), Path("p/a/loop.py")]
    assert shared_file_names(paths) == {"policy.py": ["p/a/policy.py", "p/b/policy.py"]}


def test_no_package_module_imports_an_old_path(graph):
    assert OLD_PATH_SHIMS <= set(graph)
    users = [f"{source} imports {target}" for source, targets in graph.items() if source not in OLD_PATH_SHIMS
             for target in targets & OLD_PATH_SHIMS]
    assert not users, users


def test_the_old_paths_still_import_what_the_readme_named_and_warn():
    import importlib
    import sys

    from offline_rec.dataset import card, validate
    from offline_rec.dataset import format as dataset_format

    for old, new, name in (("offline_rec.data.dataset", dataset_format, "DatasetWriter"),
                           ("offline_rec.data.card", card, "refresh_dataset_card"),
                           ("offline_rec.data.validate", validate, "check_dataset_for_use")):
        sys.modules.pop(old, None)
        with pytest.warns(DeprecationWarning, match=old.replace(".", r"\.") + " moved to " + new.__name__):
            module = importlib.import_module(old)
        assert getattr(module, name) is getattr(new, name)


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


# --------------------------------------------------------------------------------------------
# record/: the proxy's rooms, one job each, lowest first (a room imports only the ones before it)

RECORD_PROXY_ROOMS = ["offline_rec.record.proxy_state", "offline_rec.record.request_checks",
                      "offline_rec.record.forwarding", "offline_rec.record.logprobs_probe",
                      "offline_rec.record.recorded_call", "offline_rec.record.proxy"]


def test_the_record_proxy_rooms_import_only_the_rooms_below_them(graph):
    """The checks send nothing upstream, the forwarding records nothing, and only the app sees them all."""
    assert set(RECORD_PROXY_ROOMS) <= set(graph)
    upward = [f"{room} imports {above}" for level, room in enumerate(RECORD_PROXY_ROOMS)
              for above in RECORD_PROXY_ROOMS[level + 1:] if above in graph[room]]
    assert not upward, upward


def function_lengths(source: str) -> list[tuple[int, str]]:
    """(lines, qualified name) of every function in `source`, methods and nested functions included."""
    found = []

    def walk(node, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((child.end_lineno - child.lineno + 1, prefix + child.name))
                walk(child, f"{prefix}{child.name}.")
            else:
                walk(child, f"{prefix}{child.name}." if isinstance(child, ast.ClassDef) else prefix)

    walk(ast.parse(source), "")
    return found


def test_function_lengths_count_methods_and_nested_functions():
    source = "def f():\n    def g():\n        pass\n    return g\n\nclass C:\n    async def m(self):\n        pass\n"
    assert sorted(function_lengths(source)) == [(2, "C.m"), (2, "f.g"), (4, "f")]


def test_no_function_of_the_package_is_over_100_lines():
    long = [f"{path.relative_to(PACKAGE)}:{name} ({lines} lines)" for path in sorted(PACKAGE.rglob("*.py"))
            for lines, name in function_lengths(path.read_text(encoding="utf-8")) if lines > 100]
    assert not long, long


def test_test_helpers_live_in_the_support_package():
    """A helper module at the tests root would be imported by a bare name (`paths`, `datagen`) that an installed
    package can shadow: the tests root holds only test modules and conftest.py, the helpers are in tests/support/."""
    loose = sorted(path.name for path in (REPO / "tests").glob("*.py")
                   if not path.name.startswith("test_") and path.name != "conftest.py")
    assert not loose, loose
    assert (REPO / "tests" / "support" / "__init__.py").is_file()
