"""The package layout, read from the source (`ast`, nothing imported but
`eqx_remat` itself): the import graph between `eqx_remat`'s modules has no cycle
(imports inside functions and under `if TYPE_CHECKING:` count: they dodge a cycle,
they do not remove it), and each module imports only from its own layer or those
below it (`LAYERS`); `eqx_remat` never imports `zoo` or `benchmarks`; and `zoo`
and `benchmarks` use only the names `eqx_remat` exports, its public namespace and
the semi-public `eqx_remat.internal`, never a private `eqx_remat._x` module; only
`eqx_remat/_jax_private.py` imports `jax._src`; and no function in `eqx_remat`,
`zoo` or `benchmarks` is over 80 lines of code.

`benchmarks` is one tool (`benchmark_rule_breaks`): a script (`run.py`, a
module without a leading underscore) imports only the shared `_x` modules (and
`train_lm.py` the training package), never another script; a shared module never
imports a script or the training package; the training package
(`benchmarks/train/`) imports of the harness only `_device` (where it runs) and
`_files` (whether a directory can be written in), which import nothing of
`benchmarks`; the package has no import cycle, counting `from P import name` as
an import of `P` (`import_graph(..., package_reads=True)`: a module that reads
its own package's namespace while the package's `__init__` imports it is in a
cycle); and no file of it is over 800 lines.

Each check is a function returning what it found, so that the checks themselves
are tested on small made-up packages (they can fail).
"""

import ast
import graphlib
import io
import textwrap
import tokenize
from pathlib import Path

import pytest

import eqx_remat


ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "eqx_remat"
INTERNAL = "internal"
CLIENTS = ("zoo", "benchmarks")
# The layers of `eqx_remat`, lowest first, by the first part of a module's dotted
# name: a module imports only from its own layer or those below it.
LAYERS = (
    ("_jax_private", "_util", "_validate"),  # foundations
    ("_inspect",),  # the jaxpr toolkit, FLOPs, memory, residuals, Pallas costs, clock
    ("_policies",),  # policy values and how one is applied to a layer
    ("_schedules",),  # the engine, the checkpoint value, the schedules
    ("_accumulate", "_combinators", "_stacked"),  # the stack and batch combinators
    ("_roofline",),  # a function's price by tracing, and its roofline time
    ("_planning",),  # plan: its pricer, cost model, loop, bench and report
    ("__init__", "internal"),  # the namespaces
)
PRIVATE_JAX = "_jax_private.py"  # the one module that imports `jax._src`
MAX_FUNCTION_LINES = 80  # lines of code, as `function_sizes` counts them
BENCHMARKS = "benchmarks"
TRAIN = "train"  # the training package, benchmarks/train/
# Of the harness: where it runs, and whether a directory can be written in.
TRAIN_MAY_IMPORT = ("_device", "_files")
MAX_BENCHMARK_FILE_LINES = 800


def _imports(path: Path):
    """Every `import` and `from ... import` statement in the file, at any depth."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return tree, [
        n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)
    ]


def import_graph(
    package_dir: Path, *, package_reads: bool = False
) -> dict[str, set[str]]:
    """`module -> the modules of the same package it imports`, for every `.py`
    file of the package at any depth, each named by its dotted path inside the
    package (`_inspect._jaxpr`; a subpackage by its name, `_inspect`; the
    package's own `__init__` as `__init__`). `from . import name`, when `name`
    is not a module, is an import of the package's `__init__`; with
    `package_reads`, `from P import name` is one of `P` (its `__init__`, for a
    package) whatever `name` is: Python reads `name` from `P`, which a module
    that `P`'s `__init__` imports finds half made."""
    name = package_dir.name

    def dotted(path: Path) -> str:
        parts = path.relative_to(package_dir).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        return ".".join(parts) or "__init__"

    files = {dotted(p): p for p in sorted(package_dir.rglob("*.py"))}

    def module_of(parts: list[str]) -> str:
        for k in range(len(parts), 0, -1):
            if ".".join(parts[:k]) in files:
                return ".".join(parts[:k])
        return "__init__"

    graph = {}
    for module, path in files.items():
        # The package a relative import starts from.
        if module == "__init__":
            package = []
        elif path.stem == "__init__":
            package = module.split(".")
        else:
            package = module.split(".")[:-1]
        edges = set()
        for node in _imports(path)[1]:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == name or alias.name.startswith(name + "."):
                        edges.add(module_of(alias.name.split(".")[1:]))
                continue
            if node.level == 0:
                if node.module != name and not node.module.startswith(name + "."):
                    continue
                base = node.module.split(".")[1:]
            else:
                up = node.level - 1
                base = package[: len(package) - up] if up else list(package)
                base = base + (node.module.split(".") if node.module else [])
            for alias in node.names:  # `from pkg import sub`: the submodule
                sub = ".".join([*base, alias.name])
                edges.add(sub if sub in files else module_of(base))
                if package_reads:
                    edges.add(module_of(base))
        edges.discard(module)
        graph[module] = edges
    return graph


def upward_imports(graph: dict[str, set[str]], layers) -> list[str]:
    """`a imports b` for each import of a module `b` of a higher layer than `a`
    (`layers`: tuples of first parts of dotted names, lowest first), and
    `a: in no layer` for a module that no layer holds."""
    rank = {head: i for i, layer in enumerate(layers) for head in layer}
    out = []
    for a in sorted(graph):
        if a.split(".")[0] not in rank:
            out.append(f"{a}: in no layer")
            continue
        for b in sorted(graph[a]):
            if rank.get(b.split(".")[0], -1) > rank[a.split(".")[0]]:
                out.append(f"{a} imports {b}")
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of `graph` (`module -> what it imports`), as `[a, b, ..., a]`
    where each module imports the next; `None` when there is none."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        return e.args[1][::-1]  # graphlib lists each module before its importer
    return None


def benchmark_rule_breaks(graph: dict[str, set[str]]) -> list[str]:
    """`a imports b: why` for each import in the benchmarks' `graph` (see
    `import_graph`) that breaks the tool's rules: a script (a top-level module
    without a leading underscore) importing another script; a shared `_x`
    module importing a script or the training package; the training package
    importing a module of the harness other than `TRAIN_MAY_IMPORT`, or one of
    those importing anything of `benchmarks`."""

    def kind(module: str) -> str:
        head = module.split(".")[0]
        if head == TRAIN:
            return "train"
        return (
            "init" if head == "__init__" else "shared" if head[0] == "_" else "script"
        )

    out = []
    for a in sorted(graph):
        for b in sorted(graph[a]):
            ka, kb = kind(a), kind(b)
            if kb == "script":
                out.append(f"{a} imports {b}: a script")
            elif ka == "shared" and kb == "train":
                out.append(f"{a} imports {b}: the training package")
            elif ka == "train" and kb == "shared" and b not in TRAIN_MAY_IMPORT:
                out.append(f"{a} imports {b}: the measuring harness")
            elif a in TRAIN_MAY_IMPORT and kb != "init":
                out.append(f"{a} imports {b}: a module the training package imports")
    return out


def long_files(package_dir: Path, limit: int) -> list[str]:
    """`file.py n` for each `.py` file under `package_dir` (at any depth) of more
    than `limit` lines."""
    out = []
    for path in sorted(package_dir.rglob("*.py")):
        n = len(path.read_text().splitlines())
        if n > limit:
            out.append(f"{path.relative_to(package_dir)} {n}")
    return out


def forbidden_imports(package_dir: Path, forbidden: tuple[str, ...]) -> list[str]:
    """`file:line module` for each import of a `forbidden` top-level package."""
    out = []
    for path in sorted(package_dir.rglob("*.py")):
        for node in _imports(path)[1]:
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif node.level == 0:
                names = [node.module]
            else:
                continue
            for n in names:
                if n.split(".")[0] in forbidden:
                    out.append(f"{path.name}:{node.lineno} {n}")
    return out


def private_uses(client_dir: Path, public: set[str], internal: set[str]) -> list[str]:
    """`file:line what` for each use, in the files under `client_dir`, of a name
    of `eqx_remat` that is neither in `public` (its `__all__`) nor in `internal`
    (`eqx_remat.internal.__all__`): imports of a private module, imports of a
    name that is not exported, and attributes `er.x` / `er.internal.x` of a name
    bound to `eqx_remat` or to `eqx_remat.internal`."""
    allowed = {PACKAGE: public | {INTERNAL, "__version__"}, INTERNAL: internal}
    out = []
    for path in sorted(client_dir.rglob("*.py")):
        tree, imports = _imports(path)
        bound: dict[str, str] = {}  # local name -> PACKAGE or INTERNAL

        def bad(node, what):
            out.append(f"{path.name}:{node.lineno} {what}")

        for node in imports:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    if parts[0] != PACKAGE:
                        continue
                    if parts[1:] not in ([], [INTERNAL]):
                        bad(node, f"import {alias.name}")
                    elif alias.asname is None:
                        bound[PACKAGE] = PACKAGE
                    else:
                        bound[alias.asname] = INTERNAL if parts[1:] else PACKAGE
            elif node.level == 0 and node.module.split(".")[0] == PACKAGE:
                where = {PACKAGE: PACKAGE, f"{PACKAGE}.{INTERNAL}": INTERNAL}
                if node.module not in where:
                    bad(node, f"from {node.module} import ...")
                    continue
                for alias in node.names:
                    if alias.name not in allowed[where[node.module]]:
                        bad(node, f"from {node.module} import {alias.name}")
                    elif alias.name == INTERNAL:
                        bound[alias.asname or alias.name] = INTERNAL

        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            value = node.value
            if isinstance(value, ast.Name) and value.id in bound:
                space = bound[value.id]
            elif (
                isinstance(value, ast.Attribute)
                and value.attr == INTERNAL
                and isinstance(value.value, ast.Name)
                and bound.get(value.value.id) == PACKAGE
            ):
                space = INTERNAL
            else:
                continue
            if node.attr not in allowed[space]:
                bad(node, f"{ast.unparse(node)}")
    return out


_FUNCTION = ast.FunctionDef | ast.AsyncFunctionDef
_DOCUMENTED = ast.Module | ast.ClassDef | _FUNCTION


def function_sizes(path: Path) -> list[tuple[str, int]]:
    """`(line:name, n)` for each function of the file (methods and nested
    functions too; `name` qualified by its classes and functions), where `n` is
    its lines of code: from `def` to its last line, less blank lines, comment-only
    lines and docstrings (its own and those of the classes and functions in it).
    Decorators do not count."""
    source = path.read_text()
    tree = ast.parse(source, filename=str(path))
    code = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE):
            code.update(range(tok.start[0], tok.end[0] + 1))
    for node in ast.walk(tree):
        if isinstance(node, _DOCUMENTED) and ast.get_docstring(node) is not None:
            doc = node.body[0]
            code.difference_update(range(doc.lineno, doc.end_lineno + 1))

    sizes = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = prefix
            if isinstance(child, ast.ClassDef | _FUNCTION):
                name = f"{prefix}{child.name}."
            if isinstance(child, _FUNCTION):
                lines = code.intersection(range(child.lineno, child.end_lineno + 1))
                sizes.append((f"{child.lineno}:{name[:-1]}", len(lines)))
            visit(child, name)

    visit(tree, "")
    return sizes


def jax_private_imports(root: Path, packages: tuple[str, ...]) -> list[str]:
    """`package/file.py:line module` for each import of `jax._src` (at any depth,
    `from jax import _src` too) in the packages under `root`."""
    out = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            for node in _imports(path)[1]:
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif node.level == 0:
                    names = [f"{node.module}.{alias.name}" for alias in node.names]
                else:
                    continue
                for n in names:
                    if n == "jax._src" or n.startswith("jax._src."):
                        out.append(f"{path.relative_to(root)}:{node.lineno} {n}")
    return out


def long_functions(root: Path, packages: tuple[str, ...], limit: int) -> list[str]:
    """`package/file.py:line:name n` for each function of the packages under `root`
    (every `.py` file, at any depth) with more than `limit` lines of code."""
    return [
        f"{path.relative_to(root)}:{where} {n}"
        for package in packages
        for path in sorted((root / package).rglob("*.py"))
        for where, n in function_sizes(path)
        if n > limit
    ]


def private_names_imported(package_dir: Path) -> list[str]:
    """`file.py:line name` for each `_`-prefixed name (not a module) that a
    module of the package imports from another of its modules, by a relative
    `from ... import` (as Equinox: what two modules share is not private)."""
    out = []
    for path in sorted(package_dir.rglob("*.py")):
        for node in _imports(path)[1]:
            if not isinstance(node, ast.ImportFrom) or node.level == 0:
                continue
            base = path.parent
            for _ in range(node.level - 1):
                base = base.parent
            source = base.joinpath(
                *(node.module or "").split(".") if node.module else ()
            )
            for alias in node.names:
                name = alias.name
                if not name.startswith("_") or name.startswith("__"):
                    continue
                if (source / f"{name}.py").exists() or (source / name).is_dir():
                    continue  # a module
                where = path.relative_to(package_dir)
                out.append(f"{where}:{node.lineno} {name}")
    return out


def state_changes(path: Path) -> list[str]:
    """`line:Class.method self.x` for each assignment to an attribute of `self`
    in a method other than `__init__` / `__post_init__`: state kept on an
    object instead of passed along as a value."""
    out = []
    tree = ast.parse(path.read_text(), filename=str(path))
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for method in cls.body:
            if not isinstance(method, _FUNCTION):
                continue
            if method.name in ("__init__", "__post_init__"):
                continue
            for node in ast.walk(method):
                targets = []
                if isinstance(node, ast.Assign):
                    targets = node.targets
                elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                    targets = [node.target]
                for t in targets:
                    if (
                        isinstance(t, ast.Attribute)
                        and isinstance(t.value, ast.Name)
                        and t.value.id == "self"
                    ):
                        out.append(
                            f"{node.lineno}:{cls.name}.{method.name} {ast.unparse(t)}"
                        )
    return out


def class_sizes(path: Path) -> list[tuple[str, int]]:
    """`(line:Class, n)` for each class of the file: its lines, `class` to its
    last line."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        (f"{n.lineno}:{n.name}", n.end_lineno - n.lineno + 1)
        for n in ast.walk(tree)
        if isinstance(n, ast.ClassDef)
    ]


# --- the repository -----------------------------------------------------------


def test_eqx_remat_import_graph_has_no_cycle():
    graph = import_graph(ROOT / PACKAGE)
    # The parse found them.
    assert "_schedules._engine" in graph and graph["__init__"], graph
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle in eqx_remat: {' imports '.join(cycle)}"


def test_eqx_remat_imports_only_downwards():
    graph = import_graph(ROOT / PACKAGE)
    assert upward_imports(graph, LAYERS) == []


def test_benchmarks_are_one_tool_without_a_cycle():
    graph = import_graph(ROOT / BENCHMARKS, package_reads=True)
    # The parse found them.
    assert {"_cli", "_results"} <= graph["run"] and "train.config" in graph
    assert "train.loop" in graph["train"] and "train.metrics" in graph["train.loop"]
    assert benchmark_rule_breaks(graph) == []
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle in benchmarks: {' imports '.join(cycle)}"


def test_no_benchmark_file_is_over_800_lines():
    assert len(list((ROOT / BENCHMARKS).rglob("*.py"))) > 20  # found them
    found = long_files(ROOT / BENCHMARKS, MAX_BENCHMARK_FILE_LINES)
    assert found == [], f"over {MAX_BENCHMARK_FILE_LINES} lines: {found}"


def test_eqx_remat_never_imports_zoo_or_benchmarks():
    assert forbidden_imports(ROOT / PACKAGE, CLIENTS) == []


@pytest.mark.parametrize("client", CLIENTS)
def test_clients_use_only_exported_names(client):
    public, internal = set(eqx_remat.__all__), set(eqx_remat.internal.__all__)
    assert private_uses(ROOT / client, public, internal) == []


def test_private_jax_is_imported_by_one_module():
    found = jax_private_imports(ROOT, (PACKAGE, *CLIENTS))
    assert found, "the parse found no import of jax._src at all"
    assert {f.split(":")[0] for f in found} == {f"{PACKAGE}/{PRIVATE_JAX}"}, found


def test_no_function_is_over_80_lines_of_code():
    packages = (PACKAGE, *CLIENTS)
    sizes = function_sizes(ROOT / PACKAGE / "_schedules" / "_engine.py")
    assert len(sizes) > 10 and all(n > 0 for _, n in sizes), sizes  # parsed
    found = long_functions(ROOT, packages, MAX_FUNCTION_LINES)
    assert found == [], f"over {MAX_FUNCTION_LINES} lines of code: {found}"


# --- the checks can fail ------------------------------------------------------


def _package(tmp_path: Path, name: str, files: dict[str, str]) -> Path:
    package = tmp_path / name
    package.mkdir()
    for file, text in files.items():
        (package / file).parent.mkdir(parents=True, exist_ok=True)
        (package / file).write_text(textwrap.dedent(text))
    return package


def test_a_cycle_through_a_deferred_import_is_found(tmp_path):
    package = _package(
        tmp_path,
        PACKAGE,
        {
            "__init__.py": "from ._a import f as f\n",
            "_a.py": "from ._b import g\n",
            "_b.py": """
                from typing import TYPE_CHECKING
                if TYPE_CHECKING:
                    from ._c import C
                def g():
                    return 1
            """,
            "_c.py": """
                def h():
                    from ._a import f  # deferred, still a cycle
                    return f
            """,
        },
    )
    graph = import_graph(package)
    assert graph == {"__init__": {"_a"}, "_a": {"_b"}, "_b": {"_c"}, "_c": {"_a"}}
    assert set(find_cycle(graph)) == {"_a", "_b", "_c"}
    # `from . import name` of a non-module name imports `__init__`: a cycle too.
    (package / "_c.py").write_text("from . import f\n")
    assert find_cycle(import_graph(package)) is not None
    (package / "_c.py").write_text("import os\n")
    assert find_cycle(import_graph(package)) is None


def test_an_upward_import_is_found(tmp_path):
    package = _package(
        tmp_path,
        PACKAGE,
        {
            "__init__.py": "from ._top import f as f\n",
            "_top.py": "from ._low import g\n",
            "_low.py": "def g():\n    from ._top import f\n",
            "_sub/__init__.py": "",
            "_sub/_x.py": "from .._top import f\nfrom .. import _low\n",
            "_stray.py": "",
        },
    )
    graph = import_graph(package)
    assert graph["_sub._x"] == {"_top", "_low"}, graph
    layers = (("_low",), ("_sub",), ("_top",), ("__init__",))
    assert upward_imports(graph, layers) == [
        "_low imports _top",
        "_stray: in no layer",
        "_sub._x imports _top",
    ]


def test_benchmark_rule_breaks_are_found(tmp_path):
    package = _package(
        tmp_path,
        BENCHMARKS,
        {
            "__init__.py": "",
            "_cli.py": "import os\n",
            "_device.py": "def f():\n    from benchmarks import _ok\n",
            "_results.py": "def g():\n    from benchmarks.train import config\n",
            "_ok.py": "from ._cli import parser\n",
            "run.py": "from benchmarks import _cli, plan_sweep\n",
            "plan_sweep.py": "from benchmarks import _ok\n",
            "seed_claim.py": "def h():\n    from benchmarks import run\n",
            "train_lm.py": "from benchmarks.train import main\n",
            "train/__init__.py": "from .config import main\n",
            "train/config.py": "from benchmarks import _device, _cli\n",
        },
    )
    graph = import_graph(package, package_reads=True)
    # `from benchmarks import _device` reads `benchmarks/__init__.py` too.
    assert graph["train_lm"] == {"train"} and graph["train.config"] == {
        "_device",
        "_cli",
        "__init__",
    }
    assert benchmark_rule_breaks(graph) == [
        "_device imports _ok: a module the training package imports",
        "_results imports train: the training package",
        "_results imports train.config: the training package",
        "run imports plan_sweep: a script",
        "seed_claim imports run: a script",
        "train.config imports _cli: the measuring harness",
    ]
    assert find_cycle(graph) is None
    # The training package's cycle the checks found (config <-> data).
    (package / "train/data.py").write_text("from .config import main\n")
    (package / "train/config.py").write_text("def f():\n    from .data import x\n")
    cycle = find_cycle(import_graph(package, package_reads=True))
    assert set(cycle) == {"train.config", "train.data"}


def test_a_cycle_through_a_package_namespace_is_found(tmp_path):
    """The training package's cycle the checks found (loop -> the package,
    whose `__init__` imports loop): `from . import config` reads the package
    half made, though `config` is a module."""
    package = _package(
        tmp_path,
        BENCHMARKS,
        {
            "__init__.py": "",
            "train/__init__.py": "from .config import c\nfrom .loop import main\n",
            "train/config.py": "c = 1\n",
            "train/loop.py": "def main():\n    from . import config\n",
        },
    )
    assert import_graph(package)["train.loop"] == {"train.config"}
    assert find_cycle(import_graph(package)) is None  # without package reads
    graph = import_graph(package, package_reads=True)
    assert graph["train.loop"] == {"train", "train.config"}
    assert set(find_cycle(graph)) == {"train", "train.loop"}
    (package / "train/loop.py").write_text("from .config import c\n")
    assert find_cycle(import_graph(package, package_reads=True)) is None


def test_long_files_are_found(tmp_path):
    package = _package(
        tmp_path,
        BENCHMARKS,
        {"a.py": "x = 1\n" * 5, "sub/b.py": "y = 2\n" * 6, "c.txt": "z\n" * 9},
    )
    assert long_files(package, 5) == ["sub/b.py 6"]
    assert long_files(package, 4) == ["a.py 5", "sub/b.py 6"]
    assert long_files(package, 6) == []


def test_an_import_of_zoo_is_found(tmp_path):
    package = _package(
        tmp_path,
        PACKAGE,
        {
            "_a.py": "def f():\n    import zoo.x\n",
            "_b.py": "from benchmarks import y\n",
        },
    )
    assert forbidden_imports(package, CLIENTS) == [
        "_a.py:2 zoo.x",
        "_b.py:1 benchmarks",
    ]


def test_private_uses_are_found(tmp_path):
    client = _package(
        tmp_path,
        "zoo",
        {
            "_ok.py": """
                import eqx_remat
                import eqx_remat as er
                from eqx_remat import internal, scan_layers
                from eqx_remat.internal import check_int
                er.scan_layers, eqx_remat.internal.check_int, internal.check_int
            """,
            "_bad.py": """
                import eqx_remat as er
                import eqx_remat._plan
                from eqx_remat._engine import Layers
                from eqx_remat import _plan, check_int
                from eqx_remat.internal import nope
                er.check_int, er._plan, er.internal.nope
            """,
        },
    )
    found = private_uses(client, {"scan_layers"}, {"check_int"})
    assert found == [
        "_bad.py:3 import eqx_remat._plan",
        "_bad.py:4 from eqx_remat._engine import ...",
        "_bad.py:5 from eqx_remat import _plan",
        "_bad.py:5 from eqx_remat import check_int",
        "_bad.py:6 from eqx_remat.internal import nope",
        "_bad.py:7 er.check_int",
        "_bad.py:7 er._plan",
        "_bad.py:7 er.internal.nope",
    ]


def test_private_jax_imports_are_found(tmp_path):
    _package(
        tmp_path,
        "pkg",
        {
            "_a.py": "import jax\nfrom jax._src import core\n",
            "_b.py": "def f():\n    import jax._src.ad_util as u\n",
            "_c.py": "from jax import _src, numpy\nimport jax.extend\n",
        },
    )
    assert jax_private_imports(tmp_path, ("pkg",)) == [
        "pkg/_a.py:2 jax._src.core",
        "pkg/_b.py:2 jax._src.ad_util",
        "pkg/_c.py:1 jax._src",
    ]


def test_function_sizes_count_code_lines_only(tmp_path):
    package = _package(
        tmp_path,
        "pkg",
        {
            "_a.py": '''
                """The module's docstring."""


                @decorator
                def f(x):
                    """A docstring
                    over three
                    lines."""
                    # A comment.

                    y = (x +  # a comment after code
                         1)
                    return y


                class C:
                    """A class."""

                    def method(self):
                        def inner():
                            """Inner's docstring."""
                            return 1

                        return inner
            ''',
        },
    )
    # f: `def`, `y = (x +`, `1)`, `return y`; C.method: its `def`, inner's two
    # lines of code, its `return`.
    assert function_sizes(package / "_a.py") == [
        ("6:f", 4),
        ("20:C.method", 4),
        ("21:C.method.inner", 2),
    ]
    assert long_functions(tmp_path, ("pkg",), 3) == [
        "pkg/_a.py:6:f 4",
        "pkg/_a.py:20:C.method 4",
    ]
    assert long_functions(tmp_path, ("pkg",), 4) == []


# --- the planner: values passed along, effects at one edge ----------------------

PLANNING = ROOT / PACKAGE / "_planning"
MAX_PLANNING_CLASS_LINES = 300


def test_no_private_name_is_imported_across_modules():
    assert private_names_imported(ROOT / PACKAGE) == []


def test_no_planning_method_keeps_state_on_self():
    files = sorted(PLANNING.glob("*.py"))
    assert len(files) > 5  # the package was found
    found = [f"{p.name}:{c}" for p in files for c in state_changes(p)]
    assert found == [], found


def test_no_planning_class_is_over_300_lines():
    files = sorted(PLANNING.glob("*.py"))
    sizes = [(p.name, where, n) for p in files for where, n in class_sizes(p)]
    assert len(sizes) > 5, sizes  # parsed
    assert [s for s in sizes if s[2] > MAX_PLANNING_CLASS_LINES] == []


SEAM = f"{PACKAGE}._planning.testing"  # the tests' one way into the planner


def planner_reaches(tests_dir: Path) -> list[str]:
    """Each import in `tests_dir` of a module of the planner other than its
    test seam (`SEAM`): `file:line module`."""
    out = []
    planning = f"{PACKAGE}._planning"
    for path in sorted(tests_dir.glob("*.py")):
        _, imports = _imports(path)
        for n in imports:
            if isinstance(n, ast.Import):
                modules = [a.name for a in n.names]
            elif n.module == planning:
                modules = [f"{planning}.{a.name}" for a in n.names]
            else:
                modules = [n.module or ""]
            for m in modules:
                if m.startswith(planning) and m not in (SEAM, planning):
                    out.append(f"{path.name}:{n.lineno} {m}")
    return out


def test_tests_reach_the_planner_only_through_its_seam():
    assert planner_reaches(ROOT / "tests") == []


def test_an_import_past_the_seam_is_found(tmp_path):
    (tmp_path / "test_a.py").write_text(
        "from eqx_remat._planning import testing\n"
        "from eqx_remat._planning.testing import Bench\n"
        "from eqx_remat._planning import _loop\n"
        "import eqx_remat._planning._cost\n"
        "from eqx_remat._planning._bench import Bench\n"
    )
    assert planner_reaches(tmp_path) == [
        "test_a.py:3 eqx_remat._planning._loop",
        "test_a.py:4 eqx_remat._planning._cost",
        "test_a.py:5 eqx_remat._planning._bench",
    ]


def test_private_names_imported_across_modules_are_found(tmp_path):
    package = _package(
        tmp_path,
        "pkg",
        {
            "__init__.py": "from ._a import A as A\n",
            "_a.py": "A = 1\n_B = 2\n",
            "_sub/__init__.py": "",
            "_sub/_c.py": """
                from .. import _a
                from .._a import A, _B
                from ._d import _helper as helper
                from ._d import __doc__
            """,
            "_sub/_d.py": "def _helper(): pass\n",
        },
    )
    assert private_names_imported(package) == [
        "_sub/_c.py:3 _B",
        "_sub/_c.py:4 _helper",
    ]


def test_state_kept_on_self_is_found(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        textwrap.dedent(
            """
            class A:
                def __init__(self):
                    self.x = 1
                def __post_init__(self):
                    self.y = 2
                def add(self):
                    self.x += 1
                    self.d["k"] = 1
                    other.x = 3
                def set(self, v):
                    self.y: int = v
            """
        )
    )
    assert state_changes(path) == ["8:A.add self.x", "12:A.set self.y"]


def test_class_sizes_count_their_lines(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("class A:\n    x = 1\n\n    y = 2\n\n\nclass B:\n    pass\n")
    assert class_sizes(path) == [("1:A", 4), ("7:B", 2)]
