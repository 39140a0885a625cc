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


class _Block(NamedTuple):
    code: str
    expected: str | None  # the ```text block right after it, if any
    output: re.Match | None  # where that block's content is in the page
    slow: bool  # after the page's `<!-- docs: slow -->` marker


def _blocks(page: Path) -> list[_Block]:
    """The page's python blocks, in order."""
    text = page.read_text()
    slow_from = text.find(_SLOW)
    fences = list(_FENCE.finditer(text))
    out = []
    for m, nxt in zip(fences, fences[1:] + [None]):
        if m.group(1) != "python":
            continue
        if (
            nxt is not None
            and nxt.group(1) == "text"
            and not text[m.end() : nxt.start()].strip()
        ):
            expected, output = nxt.group(2), nxt
        else:
            expected, output = None, None
        slow = slow_from != -1 and m.start() > slow_from
        out.append(_Block(m.group(2), expected, output, slow))
    return out


def _cases() -> list:
    """One case per page with code (its blocks before `<!-- docs: slow -->`), and
    one more, marked slow, for a page with blocks after that marker (all of
    them)."""
    cases = []
    for page in sorted(DOCS.rglob("*.md")):
        blocks = _blocks(page)
        rel = page.relative_to(DOCS).as_posix()
        if any(not b.slow for b in blocks):
            cases.append(pytest.param(page, False, id=rel))
        if any(b.slow for b in blocks):
            cases.append(
                pytest.param(page, True, id=rel + "[all]", marks=pytest.mark.slow)
            )
    return cases


def _normalise(out: str, script: Path) -> str:
    out = out.replace(str(script), script.name).replace(str(ROOT) + "/", "")
    # Line and column numbers of source locations.
    out = re.sub(r"(\.py):\d+(?::\d+)?", r"\1:L", out)
    return "\n".join(line.rstrip() for line in out.splitlines()).strip() + "\n"


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
        if block.expected is None:
            continue
        got = _normalise(got, script)
        want = _normalise(block.expected, script)
        assert checker.check_output(want, got, doctest.ELLIPSIS), (
            f"{page.relative_to(ROOT)}, python block {i + 1} (starting "
            f"{block.code.strip().splitlines()[0]!r}) printed\n{got}\nbut the page "
            f"says\n{want}"
        )


def _update(page: Path, blocks: list[_Block], outputs: list[str], script: Path):
    """Replace the output blocks of `page` with what their python blocks printed.
    Blocks that use doctest's `...` wildcard were edited by hand: left as they
    are."""
    text = page.read_text()
    pieces, last = [], 0
    for block, got in zip(blocks, outputs, strict=True):
        if block.output is None or "..." in block.expected:
            continue
        got = got.replace(str(script), script.name).replace(str(ROOT) + "/", "")
        got = "\n".join(line.rstrip() for line in got.strip().splitlines()) + "\n"
        pieces += [text[last : block.output.start(2)], got]
        last = block.output.end(2)
    pieces.append(text[last:])
    page.write_text("".join(pieces))
