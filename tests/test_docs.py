"""The documentation: every public name has a reference page and a docstring, and
the code on every page runs and prints what the page says it prints.

A page's ```python blocks run in order, as one script, in a fresh interpreter (so
a page may set `XLA_FLAGS` before importing jax, as the sharding tutorial does). A
```text block that directly follows a ```python block is that block's output: it
must match what the block prints, with doctest's `...` wildcard, after file paths
are shortened (`/tmp/.../page.py:12:8` -> `page.py:12:8`, a path into this
repository -> its path from the repository root). Line and column numbers are not
compared.

Blocks after an HTML comment `<!-- docs: slow -->` (compiles of full-size models)
run only with `-m slow`; the default run executes the blocks before it.

After changing a page's code, `EQX_REMAT_DOCS_UPDATE=1 pytest tests/test_docs.py`
rewrites its ```text output blocks with what the code prints now (read the diff:
the prose around them may need to change too).
"""

import ast
import doctest
import functools
import importlib
import os
import re
import subprocess
import sys
import types
from pathlib import Path
from typing import NamedTuple

import jax
import pytest

import eqx_remat
import zoo


ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PACKAGES = (eqx_remat, zoo)
# Documented like the packages: their names, and the semi-public helpers.
NAMESPACES = (eqx_remat, eqx_remat.internal, zoo)
# Pages whose code compiles for TPU v5e or trains: still well under a minute each.
TIMEOUT_S = 600


def _public_names(module: types.ModuleType) -> list[str]:
    """What `module/__init__.py` exports: every name without a leading underscore
    (so not `__version__`) that is not a module."""
    return sorted(
        name
        for name, value in vars(module).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    )


_DIRECTIVE = re.compile(r"^:::\s+([\w.]+)\s*$", re.MULTILINE)


def _directives() -> dict[str, Path]:
    """`::: name` in the reference pages -> the page."""
    out = {}
    for page in sorted((DOCS / "api").rglob("*.md")):
        for name in _DIRECTIVE.findall(page.read_text()):
            out[name] = page
    return out


PUBLIC = [f"{m.__name__}.{n}" for m in NAMESPACES for n in _public_names(m)]


@pytest.mark.parametrize("name", PUBLIC)
def test_public_name_has_a_reference_page(name):
    pages = _directives()
    assert name in pages, (
        f"{name} is exported but has no reference page: add `::: {name}` to a page "
        f"under docs/api/ (and the page to mkdocs.yml's nav)."
    )


def test_reference_pages_name_public_objects():
    public = set(PUBLIC)
    for name, page in _directives().items():
        module, _, attr = name.partition(".")
        assert module in {m.__name__ for m in PACKAGES}, (page, name)
        obj = importlib.import_module(module)
        for part in attr.split("."):
            assert hasattr(obj, part), f"{page.relative_to(ROOT)}: no object {name}"
            obj = getattr(obj, part)
        assert "." in attr or name in public, (
            f"{page.relative_to(ROOT)} documents {name}, which is not exported"
        )


def test_every_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in DOCS.rglob("*.md"):
        rel = page.relative_to(DOCS).as_posix()
        assert re.search(rf":\s*{re.escape(rel)}\s*$", nav, re.MULTILINE), (
            f"docs/{rel} is not in mkdocs.yml's nav"
        )


@functools.cache
def _griffe_package(module: str):
    import griffe

    loader = griffe.GriffeLoader(search_paths=[str(ROOT)])
    package = loader.load(module)
    loader.resolve_aliases(external=False, implicit=False)
    return package


@pytest.mark.parametrize("name", PUBLIC)
def test_public_name_has_a_docstring(name):
    """Read statically, as mkdocstrings does (a module attribute's docstring is the
    string literal that follows it)."""
    pytest.importorskip("griffe")
    module, _, attr = name.partition(".")
    obj = _griffe_package(module)[attr].final_target
    assert obj.docstring is not None and obj.docstring.value.strip(), (
        f"{name} ({obj.filepath.name}) has no docstring"
    )
    if obj.is_class and "__call__" in obj.members and name.startswith("zoo."):
        for method in ("__init__", "__call__"):
            doc = obj.members[method].docstring
            assert doc is not None and "**Arguments:**" in doc.value, (
                f"{name}.{method} needs a docstring with **Arguments:**"
            )


# --- code on the pages --------------------------------------------------------

_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)
_SLOW = "<!-- docs: slow -->"
_MARK = "\x1e-- docs block {} --\x1e"


# The jax that made the pages' output blocks (and the figures quoted from them):
# a ```text block after a python block is what it printed with this jax. Where
# another jax prints something else, the page records that too, in a block
# right after it titled with its version (```text title="jax 0.12.1"), and says
# so; a test compares what the code prints with the block of the jax it runs
# on, that of the pages' jax where no block is titled with it.
PAGES_JAX = "0.10.2"
_TITLED = re.compile(r'^text\s+title="jax (\d+(?:\.\d+)+)"\s*$')


class _Block(NamedTuple):
    code: str
    # What it printed, by the jax that printed it: the ```text blocks right
    # after it (the first untitled one made with `PAGES_JAX`).
    outputs: dict[str, tuple[str, re.Match]]
    slow: bool  # after the page's `<!-- docs: slow -->` marker

    def output(self, version: str) -> tuple[str, str, re.Match] | None:
        """`(jax, text, match)` of the output to compare with on `version`."""
        for v in (version, PAGES_JAX):
            if v in self.outputs:
                return (v, *self.outputs[v])
        return None


def _output_version(info: str) -> str | None:
    """The jax an output fence's info string (```text, ```text title="jax
    0.12.1") says made it; `None` for a fence that is not an output."""
    if info.strip() == "text":
        return PAGES_JAX
    titled = _TITLED.match(info.strip())
    return None if titled is None else titled.group(1)


def _blocks(page: Path) -> list[_Block]:
    """The page's python blocks, in order."""
    text = page.read_text()
    slow_from = text.find(_SLOW)
    fences = list(_FENCE.finditer(text))
    out = []
    for i, m in enumerate(fences):
        if m.group(1) != "python":
            continue
        outputs: dict[str, tuple[str, re.Match]] = {}
        end = m.end()
        for nxt in fences[i + 1 :]:
            info = nxt.group(0).splitlines()[0][3:]
            version = _output_version(info)
            if version is None or text[end : nxt.start()].strip():
                break
            assert version not in outputs, f"{page}: two outputs for jax {version}"
            outputs[version] = nxt.group(2), nxt
            end = nxt.end()
        slow = slow_from != -1 and m.start() > slow_from
        out.append(_Block(m.group(2), outputs, slow))
    return out


def test_output_blocks_say_their_jax():
    """A page's outputs: the first, untitled, made with `PAGES_JAX`; the others
    titled with the jax that printed them, each once, read in that order."""
    readme = _blocks(ROOT / "README.md")
    first = next(b for b in readme if b.outputs)
    assert list(first.outputs) == [PAGES_JAX, "0.12.1"]
    assert first.output(PAGES_JAX)[0] == PAGES_JAX
    assert first.output("0.12.1")[0] == "0.12.1"
    assert first.output("0.11.2")[0] == PAGES_JAX
    assert _output_version('text title="jax 0.12.1"') == "0.12.1"
    assert _output_version("text") == PAGES_JAX
    assert _output_version("python") is None and _output_version("bash") is None


# The pages whose quick blocks take longest (11 s or more each on two cores): run
# with `-m heavy`, kept out of the README's test command.
_HEAVY_PAGES = {
    "README.md",
    "api/eqx_remat/name_policies.md",
    "api/eqx_remat/schedules.md",
    "api/zoo/transformer.md",
    "index.md",
    "tutorials/choosing-a-schedule.md",
    "tutorials/fit-a-batch.md",
    "tutorials/fit-a-budget.md",
    "tutorials/five-minutes.md",
    "tutorials/own-model.md",
    "tutorials/training.md",
    "tutorials/v5e-without-a-tpu.md",
    "tutorials/writing-a-schedule.md",
}


def _cases() -> list:
    """One case per page with code (the README's snippet too): its blocks before
    `<!-- docs: slow -->`, marked heavy if the page is in `_HEAVY_PAGES`, and one
    more, marked slow, for a page with blocks after that marker (all of them)."""
    cases = []
    for page in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
        blocks = _blocks(page)
        rel = page.relative_to(DOCS if page.is_relative_to(DOCS) else ROOT).as_posix()
        if any(not b.slow for b in blocks):
            heavy = [pytest.mark.heavy] if rel in _HEAVY_PAGES else []
            cases.append(pytest.param(page, False, id=rel, marks=heavy))
        if any(b.slow for b in blocks):
            cases.append(
                pytest.param(page, True, id=rel + "[all]", marks=pytest.mark.slow)
            )
    ids = {c.id for c in cases}
    assert _HEAVY_PAGES <= ids, _HEAVY_PAGES - ids  # a renamed page stays heavy
    return cases


def _normalise(out: str, script: Path) -> str:
    out = out.replace(str(script), script.name).replace(str(ROOT) + "/", "")
    # Line and column numbers of source locations.
    out = re.sub(r"(\.py):\d+(?::\d+)?", r"\1:L", out)
    return "\n".join(line.rstrip() for line in out.splitlines()).strip() + "\n"


def _undefined(code: str) -> set[str]:
    """Names a block reads at module level that it neither imports nor assigns
    (nor Python provides)."""
    import builtins

    tree = ast.parse(code)
    defined = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            defined |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            defined.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
    used = {
        n.id
        for n in ast.walk(tree)
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
    }
    return used - defined


def test_readme_snippets_stand_alone_and_change_one_thing():
    """Each README snippet runs on its own (a reader copies one), and the
    first compares checkpoints on one target: it changes nothing else."""
    blocks = [b.code for b in _blocks(ROOT / "README.md")]
    python = [b for b in blocks if "import" in b]
    assert len(python) >= 2
    for code in python:
        assert not _undefined(code), (_undefined(code), code)
    first = ast.parse(python[0])
    reports = [
        n
        for n in ast.walk(first)
        if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "memory_report"
    ]
    assert len(reports) == 1 and not reports[0].keywords, python[0]


@pytest.mark.heavy
def test_readme_plan_paragraph_states_its_blocks_figures():
    """The README's plan paragraph names the block's budget and what the
    checkpoints it compares the budget with need, compiled (at the jax CI
    runs the docs at: each within 5%)."""
    text = (ROOT / "README.md").read_text()
    code = next(b.code for b in _blocks(ROOT / "README.md") if "er.plan(" in b.code)
    budget = int(re.search(r'budget_bytes="(\d+)MiB"', code).group(1))
    said = re.search(
        rf"with {budget} MiB: more than `\"nothing\"` needs \(about\s+(\d+)\s+MiB"
        r".*?less than\s+`\"dots_no_batch\"` \((\d+) MiB\) or `\"dots\"` "
        r"\((\d+) MiB\)",
        text,
        re.S,
    )
    assert said, "the README's plan paragraph does not state the block's budget"
    setup = code[: code.index("result = er.plan(")]
    namespace: dict = {}
    mib = {}
    # As a reader runs it: jax's default promotion rules, not the tests'.
    with jax.numpy_dtype_promotion("standard"):
        exec(setup, namespace)  # the model, the AdamW state, the step: no plan
        er, step = namespace["er"], namespace["step"]
        args = (namespace["model"], namespace["opt_state"], namespace["tokens"])
        for c in ("nothing", "dots_no_batch", "dots"):
            report = er.memory_report(step, *er.set_checkpoint(args[:2], c), args[2])
            mib[c] = report.total_bytes / 2**20
    assert mib["nothing"] < budget < mib["dots_no_batch"] < mib["dots"], mib
    for c, figure in zip(mib, map(int, said.groups())):
        assert abs(mib[c] - figure) <= 0.05 * figure, (c, mib[c], figure)


@pytest.mark.parametrize(("page", "slow"), _cases())
def test_page_code_runs(page, slow, tmp_path):
    blocks = [b for b in _blocks(page) if slow or not b.slow]
    script = tmp_path / (page.stem.replace("-", "_") + ".py")
    parts = []
    for i, block in enumerate(blocks):
        parts.append(f"print({_MARK.format(i)!r}, flush=True)\n")
        parts.append(block.code)
    script.write_text("".join(parts))
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, (
        f"{page.relative_to(ROOT)} failed:\n{proc.stdout[-3000:]}\n"
        f"{proc.stderr[-5000:]}"
    )
    marks = "|".join(re.escape(_MARK.format(i)) for i in range(len(blocks)))
    outputs = re.split(marks, proc.stdout)[1:]
    if os.environ.get("EQX_REMAT_DOCS_UPDATE"):
        _update(page, blocks, outputs, script)
        return
    checker = doctest.OutputChecker()
    for i, (block, got) in enumerate(zip(blocks, outputs, strict=True)):
        expected = block.output(jax.__version__)
        if expected is None:
            continue
        made_with, text, _ = expected
        got = _normalise(got, script)
        want = _normalise(text, script)
        assert checker.check_output(want, got, doctest.ELLIPSIS), (
            f"{page.relative_to(ROOT)}, python block {i + 1} (starting "
            f"{block.code.strip().splitlines()[0]!r}) printed\n{got}\non jax "
            f"{jax.__version__}, but the page says\n{want}\n(printed with jax "
            f"{made_with}; where this jax prints otherwise, record its output "
            f'after that block, as ```text title="jax {jax.__version__}"```: '
            "EQX_REMAT_DOCS_UPDATE=1 does)"
        )


def _update(page: Path, blocks: list[_Block], outputs: list[str], script: Path):
    """Write what the python blocks of `page` printed into the output block of
    this jax: replaced where the page has one (titled with this jax, or the
    untitled one on `PAGES_JAX`), added after the others, titled, where it has
    none and this jax prints otherwise. Blocks that use doctest's `...`
    wildcard were edited by hand: left as they are."""
    text = page.read_text()
    pieces, last = [], 0
    version = jax.__version__
    for block, got in zip(blocks, outputs, strict=True):
        expected = block.output(version)
        if expected is None or "..." in expected[1]:
            continue
        got = got.replace(str(script), script.name).replace(str(ROOT) + "/", "")
        got = "\n".join(line.rstrip() for line in got.strip().splitlines()) + "\n"
        made_with, said, where = expected
        if made_with == version:
            pieces += [text[last : where.start(2)], got]
            last = where.end(2)
        elif _normalise(said, script) != _normalise(got, script):
            end = max(m.end() for _, m in block.outputs.values())
            titled = f'```text title="jax {version}"\n{got}```'
            pieces += [text[last:end].rstrip("\n"), f"\n\n{titled}\n"]
            last = end
    pieces.append(text[last:])
    page.write_text("".join(pieces))


# --- figures and numbers from the benchmark results -----------------------------

RESULTS = ROOT / "benchmarks" / "results"
# Every Markdown file a reader sees: the site's pages and the two READMEs.
PAGES = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *DOCS.rglob("*.md")]
# A quoted result: the number (and unit) right before the marker
# `<!-- result: FILE KEY=VALUE ... FIELD -->`, where FILE is a JSON file in
# benchmarks/results, the KEY=VALUE pairs pick one row of its "rows" (or of the
# list named by `list=`, e.g. `list=peers`) and FIELD is a number in that row; with
# no pairs, FIELD is a dotted path from the top of the file. `A / B` quotes the
# ratio of two such values (B may leave out FILE: A's). A marker
# `<!-- results: FILE KEY=VALUE ... -->` earlier on the page gives the later ones
# that name no FILE its FILE and pairs (theirs win). The number must agree with
# the value to the digits it is written with, in its unit: KiB/MiB/GiB for bytes,
# % for a fraction, x or × (or none) for the value itself.
_RESULT = re.compile(r"<!--\s*result:\s*(.*?)\s*-->")
_DEFAULTS = re.compile(r"<!--\s*results:\s*(.*?)\s*-->")
_QUOTED = re.compile(r"([−+-]?\d+(?:\.\d+)?)\s?(KiB|MiB|GiB|×|x|%)?$")
_UNIT = {"KiB": 2**-10, "MiB": 2**-20, "GiB": 2**-30, "%": 100.0}


@functools.cache
def _results(name: str) -> dict:
    import json

    path = RESULTS / name
    assert path.is_file(), f"no results file benchmarks/results/{name}"
    return json.loads(path.read_text())


def _split(spec: str) -> tuple[str | None, dict[str, str], list[str]]:
    """A marker's FILE (or None), KEY=VALUE pairs and other tokens."""
    import shlex

    tokens = shlex.split(spec)
    name = tokens.pop(0) if tokens and tokens[0].endswith(".json") else None
    pairs = dict(x.split("=", 1) for x in tokens if "=" in x)
    return name, pairs, [x for x in tokens if "=" not in x]


def _result_value(spec: str, defaults: str) -> float:
    """The value that `spec` (one side of a marker) names."""
    name, pairs, rest = _split(spec)
    default_name, select, _ = _split(defaults)
    if name is not None:  # a marker that names its file takes no defaults
        select = {}
    name = name or default_name
    assert name and len(rest) == 1, f"{spec!r}: expected [FILE] [KEY=VALUE ...] FIELD"
    (field,) = rest
    data = _results(name)
    if not pairs:
        for key in field.split("."):
            data = data[key]
        return float(data)
    select = select | pairs
    rows = data[select.pop("list", "rows")]
    found = [r for r in rows if all(str(r.get(k)) == v for k, v in select.items())]
    assert len(found) == 1, f"{spec!r} picks {len(found)} rows of {name}, not one"
    assert found[0].get(field) is not None, f"{spec!r}: no {field} in that row"
    return float(found[0][field])


def _quoted_results() -> list:
    out = []
    for page in PAGES:
        text = page.read_text()
        defaults = [(m.start(), m.group(1)) for m in _DEFAULTS.finditer(text)]
        for m in _RESULT.finditer(text):
            before = [d for at, d in defaults if at < m.start()]
            line = text.count("\n", 0, m.start()) + 1
            rel = page.relative_to(ROOT).as_posix()
            case = (page, m, before[-1] if before else "")
            out.append(pytest.param(*case, id=f"{rel}:{line}"))
    return out


@pytest.mark.parametrize(("page", "marker", "defaults"), _quoted_results())
def test_quoted_result_matches_its_json(page, marker, defaults):
    text = page.read_text()
    quoted = _QUOTED.search(text[: marker.start()])
    where = f"{page.relative_to(ROOT)}: {marker.group(0)}"
    assert quoted, f"{where} follows no number"
    number, unit = quoted.groups()
    sides = marker.group(1).split(" / ")
    # B of `A / B` takes A's FILE, if A names one, as its defaults.
    named = _split(sides[0])[0]
    sides = [_result_value(s, named or defaults) for s in sides]
    value = sides[0] / sides[1] if len(sides) == 2 else sides[0]
    value *= _UNIT.get(unit, 1.0)
    written = float(number.replace("−", "-"))
    digits = len(number.partition(".")[2])
    unit = f" {unit}" if unit in ("KiB", "MiB", "GiB") else unit or ""
    assert abs(written - value) <= 0.5 * 10**-digits + 1e-9, (
        f"{where}: the page says {number}{unit}, the results say "
        f"{value:.{digits + 2}f}{unit}"
    )


def test_results_are_quoted():
    """The pages quote the results files' figures (with markers) somewhere."""
    assert len(_quoted_results()) >= 20


# A figure worked out from the page's own output: the number (and unit) right
# before the marker `<!-- output: EXPR -->`, where EXPR is arithmetic (+ - * /,
# parentheses) on numbers. A number written with a decimal point is read from the
# output: it must appear, as written, in one of the page's ```text output blocks
# above the marker (which `test_page_code_runs` holds to what the code prints), so
# a change to the output fails here until the prose is updated; whole numbers are
# constants. The figure must agree with EXPR to the digits it is written with:
# % for a fraction, x or × (or none) for the value itself.
_OUTPUT = re.compile(r"<!--\s*output:\s*(.*?)\s*-->")
_DECIMAL = re.compile(r"\d+\.\d+")


def _arithmetic(expr: str) -> float:
    """The value of `expr`, which may hold only numbers, + - * / and brackets."""
    tree = ast.parse(expr, mode="eval")
    allowed = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.operator)
    allowed += (ast.unaryop,)
    for node in ast.walk(tree):
        assert isinstance(node, allowed), (
            f"{expr!r}: {ast.dump(node)} is not arithmetic"
        )
        assert not isinstance(node, ast.Constant) or type(node.value) in (int, float)
    return float(eval(compile(tree, "<output marker>", "eval"), {"__builtins__": {}}))


def _output_markers() -> list:
    out = []
    for page in PAGES:
        for m in _OUTPUT.finditer(page.read_text()):
            line = page.read_text().count("\n", 0, m.start()) + 1
            out.append(pytest.param(page, m, id=f"{page.relative_to(ROOT)}:{line}"))
    return out


@pytest.mark.parametrize(("page", "marker"), _output_markers())
def test_quoted_output_matches_its_block(page, marker):
    text = page.read_text()
    where = f"{page.relative_to(ROOT)}: {marker.group(0)}"
    quoted = _QUOTED.search(text[: marker.start()])
    assert quoted, f"{where} follows no number"
    number, unit = quoted.groups()
    expr = marker.group(1)
    outputs = [
        m.group(2)
        for m in _FENCE.finditer(text[: marker.start()])
        if m.group(1) == "text"
    ]
    for read in _DECIMAL.findall(expr):
        pattern = rf"(?<![\d.]){re.escape(read)}(?!\d)"
        assert any(re.search(pattern, out) for out in outputs), (
            f"{where}: {read} is in no output block above it (has the output "
            "changed? then so has the figure)"
        )
    value = _arithmetic(expr) * _UNIT.get(unit, 1.0)
    written = float(number)
    digits = len(number.partition(".")[2])
    assert abs(written - value) <= 0.5 * 10**-digits + 1e-9, (
        f"{where}: the page says {number}{unit or ''}, its output gives "
        f"{value:.{digits + 2}f}{unit or ''}"
    )


# A percentage or ratio in the site's prose (outside code and comments).
_FIGURE = re.compile(r"(?<![\w.:×/-])\d+(?:\.\d+)?\s?(?:%|×|x)(?![\w×]|\s*\d)")
_SOURCE = re.compile(r"<!--\s*(?:result|output):")
# Figures on the site's pages that measure nothing (settings, thresholds, others'
# claims quoted), each with the words that follow it: the rest cite their source.
_NOT_MEASURED = {
    ("tutorials/choosing-a-schedule.md", "1.00× | every layer's"): "None against None",
    ("tutorials/v5e-without-a-tpu.md", "1.00× | | | 28.1"): "None against None",
    ("tutorials/fit-a-batch.md", "5% over the budget"): "the planner's threshold",
    ("tutorials/fit-a-batch.md", "1% of its least estimate"): "the planner's rule",
    ("tutorials/fit-a-budget.md", "3% slower than one"): "the race's threshold",
    ("tutorials/fit-a-budget.md", "5%): options"): "the planner's margin",
    ("tutorials/fit-a-budget.md", "5%) whose time"): "the planner's margin",
    ("tutorials/fit-a-budget.md", "10%: programs"): "the planner's time margin",
    ("tutorials/fit-a-budget.md", "8% apart as"): "issue 50's measurement",
    ("tutorials/fit-a-budget.md", "0.1%, are one"): "the planner's rule",
    ("tutorials/fit-a-budget.md", "3% of that one"): "the race's threshold",
    ("tutorials/own-model.md", "3% of the fastest"): "the race's threshold",
    ("tutorials/training.md", "5%) is held out"): "a setting of the script",
    ("tutorials/v5e-without-a-tpu.md", "40% at ~12%"): "the seed claim, quoted",
    ("tutorials/v5e-without-a-tpu.md", "12% step-time"): "the seed claim, quoted",
    ("tutorials/v5e-without-a-tpu.md", "40% for almost"): "the seed claim, quoted",
}


def _prose(text: str) -> str:
    """`text` with its code blocks, inline code and HTML comments blanked out
    (their characters replaced by spaces, so offsets stay those of `text`)."""

    def blank(m: re.Match) -> str:
        return re.sub(r"[^\n]", " ", m.group(0))

    text = _FENCE.sub(blank, text)
    text = re.sub(r"<!--.*?-->", blank, text, flags=re.DOTALL)
    return re.sub(r"`[^`\n]*`", blank, text)


@pytest.mark.parametrize(
    "page", sorted(DOCS.rglob("*.md")), ids=lambda p: p.relative_to(DOCS).as_posix()
)
def test_quoted_figures_cite_their_source(page):
    """Every percentage or ratio a page's prose states is checked: by a `result:`
    marker against the committed results, by an `output:` marker against the
    page's own output, or listed above as measuring nothing."""
    text = page.read_text()
    prose = _prose(text)
    rel = page.relative_to(DOCS).as_posix()
    unchecked = []
    for m in _FIGURE.finditer(prose):
        if _SOURCE.match(text, m.end()):
            continue
        after = " ".join(prose[m.start() : m.start() + 60].split())
        if any(p == rel and after.startswith(w) for p, w in _NOT_MEASURED):
            continue
        line = text.count("\n", 0, m.start()) + 1
        unchecked.append(f"line {line}: {after!r}")
    assert not unchecked, (
        f"docs/{rel} states figures with no source: put `<!-- result: ... -->` or "
        "`<!-- output: ... -->` right after each (see the comments above this test), "
        "or list it in _NOT_MEASURED if it measures nothing:\n" + "\n".join(unchecked)
    )


_IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_images_are_committed_results(page):
    """Every figure a page shows is a file in the repository; the site's pages show
    the benchmark results themselves (served at results/ by docs/hooks.py), not
    copies."""
    for target in _IMAGE.findall(page.read_text()):
        if target.startswith(("http://", "https://")):
            continue
        path = (page.parent / target).resolve()
        if page.is_relative_to(DOCS):
            rel = path.relative_to(DOCS)
            assert rel.parts[0] == "results", f"{page}: {target} is not a result"
            path = RESULTS / Path(*rel.parts[1:])
        assert path.is_file(), f"{page.relative_to(ROOT)} shows {target}: no such file"


_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s#]*)(?:#([^)\s]*))?\)")


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives `page`'s headings: lower case, punctuation
    dropped, spaces as hyphens; a repeated one gets `-1`, `-2`, ..."""
    anchors, times = set(), {}
    for m in re.finditer(r"^#{1,6} +(.+?) *$", _FENCE.sub("", page.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = times.get(slug, 0)
        anchors.add(f"{slug}-{n}" if n else slug)
        times[slug] = n + 1
    return anchors


def test_anchors_are_githubs(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# Results\n\n## `plan()` on MaxText's 16B: v5e:16x16\n\n### Compile time\n\n"
        "```python\n# a comment, not a heading\n```\n\n#### Compile time\n\n"
        "## Summary (every target)\n"
    )
    assert _anchors(page) == {
        "results",
        "plan-on-maxtexts-16b-v5e16x16",
        "compile-time",
        "compile-time-1",
        "summary-every-target",
    }


@pytest.mark.parametrize("page", PAGES[:2], ids=["README.md", "benchmarks/README.md"])
def test_readme_links_resolve(page):
    """The READMEs (read on GitHub, not built) link only files that exist, and
    a link into a Markdown page only to one of its headings."""
    for target, anchor in _LINK.findall(page.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        path = page.parent / target
        assert path.exists(), f"{page.relative_to(ROOT)} links {target}: no such file"
        if anchor and (not target or path.suffix == ".md"):
            path = path if target else page
            assert anchor in _anchors(path), (
                f"{page.relative_to(ROOT)} links {target}#{anchor}: no such heading"
            )


def _readme_headlines() -> list[list[str]]:
    """The cells of the README's results table, the header row first."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("\n## Results\n") :]
    section = section[: section.index("\n## ", 1)]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return [
        [c.strip() for c in row.strip().strip("|").split(" | ")]
        for row in rows
        if not set(row) <= set("|-: ")
    ]


def test_readme_headlines_say_their_jax():
    """Each line of the README's results table quotes its figures with markers
    (so `test_quoted_result_matches_its_json` holds them to the results files),
    says the jax that made them, as the files' `meta` records it (and the
    libtpu, where a file is compiled for a TPU), and links its paragraph in
    benchmarks/README.md."""
    header, *rows = _readme_headlines()
    assert header[:4] == ["measured", "eqx-remat", "beside it", "jax"], header
    assert len(rows) >= 10
    for cells in rows:
        line = " | ".join(cells)
        assert len(cells) == len(header), f"{line!r}: {len(cells)} cells"
        names = set()
        for marker in _RESULT.finditer(line):
            first, *rest = marker.group(1).split(" / ")
            name = _split(first)[0]
            assert name, f"{marker.group(0)}: a headline names its results file"
            names |= {name} | {n for s in rest if (n := _split(s)[0])}
        assert names, f"{cells[0]!r}: no figure quoted with a result marker"
        metas = [_results(n)["meta"] for n in sorted(names)]
        jaxes = sorted({m["versions"]["jax"] for m in metas})
        tpu = [m for m in metas if m.get("target") or m.get("backend") == "tpu"]
        said = ", ".join(f"jax {v}" for v in jaxes)
        if tpu:
            said += ", " + ", ".join(
                f"libtpu {v}" for v in sorted({m["versions"]["libtpu"] for m in tpu})
            )
        assert cells[3] == said, f"{cells[0]!r}: says {cells[3]!r}, its files {said!r}"
        assert re.search(r"\]\(benchmarks/README\.md#[^)]+\)", cells[4]), cells[4]


def test_benchmarks_readme_has_the_report():
    """benchmarks/README.md shows what `benchmarks/report.py` prints from the
    committed results, section by section (re-run it and paste after measuring),
    and summary.md is its summary."""
    from benchmarks import report

    readme = (ROOT / "benchmarks" / "README.md").read_text()
    for title, name, fn in report.SECTIONS:
        data = _results(f"{name}.json")
        body = f"{report.provenance(data)}\n\n{fn(data)}"
        assert body in readme, f"benchmarks/README.md: section {title!r} is stale"
    summary = report.summary(RESULTS)
    assert summary.strip() in readme, "benchmarks/README.md: the summary is stale"
    assert (RESULTS / "summary.md").read_text() == summary
