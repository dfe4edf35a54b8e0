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
    {"offline_rec", "offline_rec.errors", "offline_rec.schema", "offline_rec.files", "offline_rec.folder_lock",
     "offline_rec.progress", "offline_rec.coerce", "offline_rec.preemption", "offline_rec.loss",
     "offline_rec.options",
     "offline_rec.ray_cluster", "offline_rec.devices", "offline_rec.workers"},
    {"offline_rec.dataset"},  # the format, below everything that reads or writes it
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


BESIDE_THE_PACKAGE = ("experiments", "benchmarks")
"""The research experiments and the performance benchmarks: they use the package, the package never uses them."""


def test_no_two_modules_share_a_file_name():
    """A file name says its job: `reward_model.py` in two rooms left a reader guessing which one a traceback meant.
    The package, the experiments and the benchmarks together."""
    modules = [path.relative_to(REPO) for path in sorted(PACKAGE.rglob("*.py"))]
    modules += [path.relative_to(REPO) for folder in BESIDE_THE_PACKAGE
                for path in sorted((REPO / folder).rglob("*.py"))]
    assert not shared_file_names(modules), shared_file_names(modules)


def imported_roots(path: Path) -> set[str]:
    """The top-level names of every module `path` imports (function-level imports included)."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            roots.add(node.module.split(".")[0])
    return roots


def test_the_package_never_imports_the_experiments_or_the_benchmarks():
    users = [f"{path.relative_to(REPO)} imports {root}" for path in sorted(PACKAGE.rglob("*.py"))
             for root in sorted(imported_roots(path) & set(BESIDE_THE_PACKAGE))]
    assert not users, users


def test_the_import_check_finds_every_form_of_import(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("import os.path\nfrom experiments import harness\ndef f():\n    import benchmarks.run as r\n"
                      "from . import sibling\n")
    assert imported_roots(source) == {"os", "experiments", "benchmarks"}


def declared_benchmark_keys(paths) -> list[str]:
    """The names of every `Key("name", ...)` of `paths`: each key of the benchmark is declared so, once."""
    names = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Key"
                    and node.args and isinstance(node.args[0], ast.Constant)):
                names.append(node.args[0].value)
    return names


def test_no_benchmark_key_is_declared_twice():
    names = declared_benchmark_keys(sorted((REPO / "benchmarks").rglob("*.py")))
    assert len(names) > 100 and {"train_vs_bare", "record_throughput_vs_direct", "judge_vs_bare_client"} <= set(names)
    assert sorted({name for name in names if names.count(name) > 1}) == []
    from benchmarks.parts import PARTS
    from benchmarks.run import RUN_KEYS

    # every key the runner knows is one of those declarations
    known = [key.name for part in PARTS for key in part.keys] + [key.name for key in RUN_KEYS]
    assert sorted(known) == sorted(names)


def test_the_shared_file_name_check_finds_a_repeat():
    paths = [Path("p/a/__init__.py"), Path("p/b/__init__.py"), Path("p/a/config.py"), Path("p/b/config.py"),
             Path("p/a/policy.py"), Path("p/b/policy.py"), Path("p/a/loop.py")]
    assert shared_file_names(paths) == {"policy.py": ["p/a/policy.py", "p/b/policy.py"]}


def test_the_old_data_paths_are_gone():
    """The re-exports `offline_rec.data.dataset`, `.card` and `.validate`, kept one release after the data layer's
    split, are removed (CHANGELOG.md; docs/architecture.md maps each old path to its new one): the package has no
    data/ module left. (Not an import attempt: an editable install of another checkout would answer for it.)"""
    assert not list((PACKAGE / "data").glob("**/*.py"))  # a checkout may keep an ignored __pycache__ there


# --------------------------------------------------------------------------------------------
# backends: what a backend can do is read from its class in rollout/backends/, never from its name


def compared_constants(node: ast.Compare) -> set:
    """The constants a comparison compares with, alone or in a literal collection (`x in ("a", "b")`)."""
    operands = [node.left, *node.comparators]
    literals = [e for o in operands for e in (o.elts if isinstance(o, (ast.Tuple, ast.List, ast.Set)) else [o])]
    return {e.value for e in literals if isinstance(e, ast.Constant)}


def backend_name_comparisons(source: str, names: set[str]) -> list[int]:
    """Lines of `source` that compare a value with one of `names` (==, !=, in / not in a literal collection)."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Compare) and compared_constants(node) & names]


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
# import formats: what a format does is asked of its IMPORT_FORMATS entry or done in its own module, never
# decided by a test of its name


def format_name_comparisons(source: str, names: set[str]) -> list[int]:
    """Lines of `source` that compare an import format's name (an attribute `.format`, or a variable `fmt`) with
    one of `names`."""
    def names_a_format(operand: ast.expr) -> bool:
        return (isinstance(operand, ast.Attribute) and operand.attr == "format") or (
            isinstance(operand, ast.Name) and operand.id == "fmt")

    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Compare) and compared_constants(node) & names
            and any(names_a_format(operand) for operand in [node.left, *node.comparators])]


def test_import_format_names_are_never_compared():
    from offline_rec.importers import IMPORT_FORMATS

    found = [f"{path.relative_to(REPO)}:{line}" for path in sorted(PACKAGE.rglob("*.py"))
             for line in format_name_comparisons(path.read_text(encoding="utf-8"), set(IMPORT_FORMATS))]
    assert not found, ("give the format a hook or an ImportFormat field (importers/__init__.py) instead of "
                       "testing its name: " + ", ".join(found))


def test_the_format_name_check_finds_every_form_of_comparison():
    names = {"text", "openai", "trl"}
    source = ('a = fmt == "text"\nb = config.format in ("text", "trl")\nc = "openai" != fmt\n'
              'd = fmt not in ["trl"]\ne = evidence.kind == "text"\nf = fmt == "other"\n')
    assert format_name_comparisons(source, names) == [1, 2, 3, 4]


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


STEP_PATH = ["loss/ratios.py", "loss/objective.py", "loss/presets.py", "loss/advantages.py", "loss/policy_loss.py",
             "loss/totals.py", "training/config.py", "training/recipes.py", "training/legacy_keys.py",
             "training/step_source.py", "training/micro_batching.py", "training/trainer.py", "training/loop.py",
             "training/metrics.py", "training/checks.py", "training/checkpoint.py"]
"""The modules a training step reads from the command line down to the loss (docs/architecture.md, "The training
path, in one picture"). loss/terms.py is left out: a registered term's keyword-only parameters are the objective
fields it reads, its formula's own symbols."""


def parameter_counts(source: str) -> list[tuple[int, str]]:
    """(parameters, name) of every function in `source`, self and cls left out."""
    counts = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            arguments = node.args
            named = [a.arg for a in arguments.posonlyargs + arguments.args + arguments.kwonlyargs]
            extra = int(arguments.vararg is not None) + int(arguments.kwarg is not None)
            counts.append((len([n for n in named if n not in ("self", "cls")]) + extra, node.name))
    return counts


def test_parameter_counts_leave_self_out():
    assert parameter_counts("class C:\n    def m(self, a, b=1, *c, d, **e):\n        pass\n") == [(5, "m")]


def test_no_function_of_the_step_path_takes_more_than_six_parameters():
    wide = [f"{module}:{name} ({count})" for module in STEP_PATH
            for count, name in parameter_counts((PACKAGE / module).read_text(encoding="utf-8")) if count > 6]
    assert not wide, wide
