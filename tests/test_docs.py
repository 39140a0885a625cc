"""The documentation: every public name has a reference page and a docstring, and
the code on every page runs and prints what the page says it prints.

A page's ```python blocks run in order, as one script, in a fresh interpreter (so
a page may set `XLA_FLAGS` before importing jax, as the sharding tutorial does). A
```text block that directly follows a ```python block is that block's output: it
must match what the block prints, with doctest's `...` wildcard, after file paths
are shortened (`/tmp/.../page.py:12:8` -> `page.py:12:8`, a path into this
repository -> its path from the repository root). Line and column numbers are not
compared.

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

import pytest

import eqx_remat
import zoo


ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PACKAGES = (eqx_remat, zoo)
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


PUBLIC = [f"{m.__name__}.{n}" for m in PACKAGES for n in _public_names(m)]


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
_MARK = "\x1e-- docs block {} --\x1e"


def _blocks(page: Path) -> list[tuple[str, str | None]]:
    """The page's python blocks, each with the ```text block directly after it."""
    text = page.read_text()
    fences = list(_FENCE.finditer(text))
    out = []
    for i, m in enumerate(fences):
        if m.group(1) != "python":
            continue
        expected = None
        if i + 1 < len(fences):
            nxt = fences[i + 1]
            between = text[m.end() : nxt.start()]
            if nxt.group(1) == "text" and not between.strip():
                expected = nxt.group(2)
        out.append((m.group(2), expected))
    return out


def _pages_with_code() -> list[Path]:
    return [p for p in sorted(DOCS.rglob("*.md")) if _blocks(p)]


def _normalise(out: str, script: Path) -> str:
    out = out.replace(str(script), script.name).replace(str(ROOT) + "/", "")
    # Line and column numbers of source locations.
    out = re.sub(r"(\.py):\d+(?::\d+)?", r"\1:L", out)
    return "\n".join(line.rstrip() for line in out.splitlines()).strip() + "\n"


@pytest.mark.parametrize(
    "page", _pages_with_code(), ids=lambda p: p.relative_to(DOCS).as_posix()
)
def test_page_code_runs(page, tmp_path):
    blocks = _blocks(page)
    script = tmp_path / (page.stem.replace("-", "_") + ".py")
    parts = []
    for i, (code, _) in enumerate(blocks):
        parts.append(f"print({_MARK.format(i)!r}, flush=True)\n")
        parts.append(code)
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
        _update(page, outputs, script)
        return
    checker = doctest.OutputChecker()
    for i, ((code, expected), got) in enumerate(zip(blocks, outputs, strict=True)):
        if expected is None:
            continue
        got = _normalise(got, script)
        want = _normalise(expected, script)
        assert checker.check_output(want, got, doctest.ELLIPSIS), (
            f"{page.relative_to(ROOT)}, python block {i + 1} (starting "
            f"{code.strip().splitlines()[0]!r}) printed\n{got}\nbut the page says\n"
            f"{want}"
        )


def _update(page: Path, outputs: list[str], script: Path) -> None:
    """Replace each output block of `page` with what its python block printed.
    Blocks that use doctest's `...` wildcard were edited by hand: left as they
    are."""
    text = page.read_text()
    fences = list(_FENCE.finditer(text))
    pieces, last, k = [], 0, -1
    for m, nxt in zip(fences, fences[1:] + [None]):
        if m.group(1) != "python":
            continue
        k += 1
        if nxt is None or nxt.group(1) != "text" or "..." in nxt.group(2):
            continue
        if text[m.end() : nxt.start()].strip():
            continue
        got = outputs[k].replace(str(script), script.name)
        got = got.replace(str(ROOT) + "/", "")
        got = "\n".join(line.rstrip() for line in got.strip().splitlines()) + "\n"
        pieces += [text[last : nxt.start(2)], got]
        last = nxt.end(2)
    pieces.append(text[last:])
    page.write_text("".join(pieces))
