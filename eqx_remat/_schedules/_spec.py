"""A checkpoint as text and back: `parse_checkpoint(spec)` reads what a command
line, a config file or a results file says, `checkpoint_label(c)` writes it, and
`parse_checkpoint(checkpoint_label(c)) == c` for every checkpoint the library
builds (Haliax's `ScanCheckpointPolicy.from_bool_or_str` is the model: one
normaliser, a `ValueError` naming the bad text and listing what is valid).

The grammar is Python's call syntax, with names unquoted where they are plain
words (`every(4, dots)`, `save_names(qkv_proj, out_proj)`), plus two spellings
that need no shell quoting: colons for a schedule (`every:4:dots`,
`recursive`) and `n:spec` for a part of `ranges(...)`.
"""

import ast
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from .._policies._named import POLICIES
from .._policies._values import (
    NamePolicy,
    offload_names,
    save_all_but_names,
    save_and_offload_names,
    save_names,
)
from .._validate import check_int
from ._binomial import binomial
from ._checkpoint import Checkpoint
from ._ranges import ranges
from ._uniform import every, nested, recursive


# What `parse_checkpoint` reads, as its errors list it.
SPEC_FORMS = (
    "None",
    *POLICIES,
    "every(k[, policy])",
    "nested(levels[, policy])",
    "recursive([policy])",
    "binomial(slots[, policy])",
    "ranges(n:spec, ...)",
    "save_names(name, ...)",
    "save_all_but_names(name, ...)",
    "offload_names(name, ...[, src=..., dst=...])",
    "save_and_offload_names(save=(name, ...), offload=(name, ...))",
)
_SCHEDULES = {"every": every, "nested": nested, "binomial": binomial}
_NAME_POLICIES = {
    "save_names": save_names,
    "save_all_but_names": save_all_but_names,
    "offload_names": offload_names,
    "save_and_offload_names": save_and_offload_names,
}
# A name in quotes is a Python string literal, escapes and all (as `repr`
# writes one, and so `checkpoint_label`): scanned here, read by
# `ast.literal_eval`.
_TOKEN = re.compile(
    r"\s*(?:(\d+)|([A-Za-z_][A-Za-z0-9_.\-]*)"
    r"|('(?:[^'\\\n]|\\.)*'|\"(?:[^\"\\\n]|\\.)*\")|(.))"
)


_KINDS = {
    "int": "an integer",
    "word": "a name",
    "str": "a name",
    "op": "more",
    None: "more",
}


def _string(literal: str, fail: Callable[[str], Exception]) -> str:
    """The text of a quoted name: a Python string literal (`'a\\tb'`)."""
    try:
        value = ast.literal_eval(literal)
    except (SyntaxError, ValueError) as e:
        raise fail(f"{literal} is not a Python string literal ({e})") from None
    if not isinstance(value, str):  # pragma: no cover - the regex quotes it
        raise fail(f"{literal} is not a string")
    return value


class _Tokens:
    """The tokens of a spec: `("int", 4)`, `("word", "dots")`, `("str", "a b")`
    or `("op", "(")`, read left to right."""

    def __init__(self, text: str, fail: Callable[[str], Exception]):
        self.items: list[tuple[str, Any]] = []
        for m in _TOKEN.finditer(text.strip()):
            number, word, literal, op = m.groups()
            if number is not None:
                self.items.append(("int", int(number)))
            elif word is not None:
                self.items.append(("word", word))
            elif literal is not None:
                self.items.append(("str", _string(literal, fail)))
            elif op in "():,=":
                self.items.append(("op", op))
            elif op is not None:
                raise fail(f"unexpected {op!r}")
        self.at, self.fail = 0, fail

    def peek(self, kind: str | None = None, value: Any = None) -> bool:
        if self.at >= len(self.items):
            return False
        k, v = self.items[self.at]
        return (kind is None or k == kind) and (value is None or v == value)

    def take(self, kind: str | None = None, value: Any = None) -> Any:
        if not self.peek(kind, value):
            got = (
                repr(self.items[self.at][1]) if self.at < len(self.items) else "the end"
            )
            wanted = repr(value) if value is not None else _KINDS[kind]
            raise self.fail(f"expected {wanted} where it has {got}")
        self.at += 1
        return self.items[self.at - 1][1]


def _count(tokens: _Tokens, depth: int | None) -> int:
    """An integer, or `sqrt` / `log2` of `depth`."""
    if tokens.peek("int"):
        return tokens.take()
    word = tokens.take("word") if tokens.peek("word") else None
    if word not in ("sqrt", "log2"):
        raise tokens.fail(f"expected an integer, sqrt or log2, got {word!r}")
    if depth is None:
        raise tokens.fail(f"{word} needs the depth of the stack (depth=...)")
    if word == "sqrt":
        return max(1, round(math.sqrt(depth)))
    return max(1, math.ceil(math.log2(max(2, depth))))


def _names(tokens: _Tokens) -> tuple[str, ...]:
    """One name, or a parenthesised tuple of them."""
    if not tokens.peek("op", "("):
        return (_name(tokens),)
    tokens.take("op", "(")
    out = []
    while not tokens.peek("op", ")"):
        out.append(_name(tokens))
        _next(tokens)
    tokens.take("op", ")")
    return tuple(out)


def _next(tokens: _Tokens) -> None:
    """After an argument: a comma, or the closing parenthesis (left unread)."""
    if tokens.peek("op", ")"):
        return
    if not tokens.peek("op", ","):
        got = repr(tokens.items[tokens.at][1]) if tokens.peek() else "the end"
        raise tokens.fail(f"expected ',' or ')' where it has {got}")
    tokens.take()


def _name(tokens: _Tokens) -> str:
    if tokens.peek("str"):
        return tokens.take()
    return str(tokens.take("word"))


def _arguments(tokens: _Tokens, read: Callable[[str | None], Any]) -> tuple:
    """`(a, b, key=c)` after a function's name: `read(keyword or None)` reads
    each value. Returns `(positional, keywords)`."""
    args, kwargs = [], {}
    tokens.take("op", "(")
    while not tokens.peek("op", ")"):
        key = None
        if tokens.peek("word") and tokens.at + 1 < len(tokens.items):
            if tokens.items[tokens.at + 1] == ("op", "="):
                key = tokens.take()
                tokens.take("op", "=")
        value = read(key)
        if key is None:
            if kwargs:
                raise tokens.fail("a positional argument after a keyword one")
            args.append(value)
        else:
            kwargs[key] = value
        _next(tokens)
    tokens.take("op", ")")
    return tuple(args), kwargs


def _checkpoint(tokens: _Tokens, depth: int | None) -> Any:
    """One checkpoint, starting at the current token."""
    if tokens.peek("str"):
        word = tokens.take()
    else:
        word = tokens.take("word")
    if word in ("None", "none"):
        return None
    if word in POLICIES:
        return word
    if word in _NAME_POLICIES:
        args, kwargs = _arguments(tokens, lambda key: _name_argument(tokens, key))
        return _build(word, args, kwargs, tokens)
    if word == "ranges":
        return _ranges(tokens, depth)
    if word not in (*_SCHEDULES, "recursive"):
        raise tokens.fail(f"unknown checkpoint {word!r}")
    counted = word != "recursive"
    if tokens.peek("op", ":"):  # every:4:dots, recursive:dots
        args: list[Any] = []
        while tokens.peek("op", ":"):
            tokens.take()
            first = counted and not args
            args.append(_count(tokens, depth) if first else _checkpoint(tokens, depth))
        return _build(word, tuple(args), {}, tokens)
    if not tokens.peek("op", "("):  # `recursive`, `every`: the call with no arguments
        return _build(word, (), {}, tokens)
    position = [0]

    def read(key: str | None) -> Any:
        first = counted and key in (None, "k", "levels", "slots") and not position[0]
        position[0] += 1
        return _count(tokens, depth) if first else _checkpoint(tokens, depth)

    args, kwargs = _arguments(tokens, read)
    return _build(word, args, kwargs, tokens)


def _name_argument(tokens: _Tokens, key: str | None) -> Any:
    if key in ("save", "offload"):
        return _names(tokens)
    return _name(tokens)


def _build(word: str, args: Sequence, kwargs: dict, tokens: _Tokens) -> Any:
    make = {**_SCHEDULES, **_NAME_POLICIES, "recursive": recursive}[word]
    try:
        return make(*args, **kwargs)
    except (TypeError, ValueError) as e:
        said = str(e) if str(e).startswith(word) else f"{word}: {e}"
        raise tokens.fail(said) from None


def _ranges(tokens: _Tokens, depth: int | None) -> ranges:
    """`ranges(n:spec, ...)`, or `ranges((n, spec), ...)` as `ranges` prints."""
    parts = []
    tokens.take("op", "(")
    while not tokens.peek("op", ")"):
        pair = tokens.peek("op", "(")
        if pair:
            tokens.take()
        if not tokens.peek("int"):
            raise tokens.fail(
                "expected ranges(n:spec, ...), e.g. ranges(4:dots, 12:None): a "
                "count first"
            )
        n = tokens.take()
        tokens.take("op", "," if pair else ":")
        parts.append((n, _checkpoint(tokens, n)))
        if pair:
            tokens.take("op", ")")
        _next(tokens)
    tokens.take("op", ")")
    try:
        return ranges(*parts)
    except ValueError as e:
        raise tokens.fail(str(e)) from None


def parse_checkpoint(spec: str, depth: int | None = None) -> Checkpoint:
    """The checkpoint a piece of text names: the inverse of
    [`eqx_remat.checkpoint_label`][].

    ```python
    import eqx_remat

    print(eqx_remat.parse_checkpoint("every:4:dots"))
    print(eqx_remat.parse_checkpoint("ranges(4:save_names(qkv_proj), 12:None)"))
    print(eqx_remat.parse_checkpoint("binomial(log2)", depth=24))
    ```

    ```text
    every(k=4, policy='dots')
    ranges((4, save_names('qkv_proj')), (12, None))
    binomial(slots=5, policy=None)
    ```

    **Arguments:**

    - `spec`: `"None"`; a policy name (`"dots"`, one of
      [`eqx_remat.POLICIES`][]); a name policy as a call, names bare or quoted
      (`"save_names(qkv_proj, out_proj)"`, `"offload_names(mlp_hidden,
      dst=pinned_host)"`, `"save_and_offload_names(save=(qkv_proj,),
      offload=(mlp_hidden,))"`); a schedule as a call (`"every(4, dots)"`,
      `"recursive()"`, `"binomial(8)"`) or, needing no shell quoting, with
      colons (`"every:4:dots"`, `"nested:3"`, `"recursive"`); or layer ranges
      (`"ranges(4:dots, 12:every:3)"`). Where a schedule takes an integer,
      `sqrt` or `log2` (of `depth`; inside `ranges`, of the range's count) may
      stand for it.
    - `depth`: the depth of the stack, for `sqrt` and `log2`: `None` (the
      default) or an int `>= 1`.

    **Returns:**

    A [`eqx_remat.Checkpoint`][]: `None`, a policy name, a name policy or a
    schedule.

    **Raises:**

    `ValueError` naming `spec`, saying what is wrong and listing the forms it
    may take; for a `depth` that is not `None` or an int `>= 1`, naming `spec`
    and `depth`.
    """
    if not isinstance(spec, str):
        raise ValueError(f"parse_checkpoint expected a string. Got {spec!r}.")
    if depth is not None:
        try:
            depth = check_int("parse_checkpoint", "depth", depth, 1)
        except ValueError:
            raise ValueError(
                f"Invalid checkpoint {spec!r} at depth={depth!r}: parse_checkpoint's "
                "depth must be an int >= 1, the depth of the stack (for sqrt and "
                f"log2), or None. Got {depth!r}."
            ) from None

    def fail(problem: str) -> ValueError:
        return ValueError(
            f"Invalid checkpoint {spec!r}: {problem.rstrip('.')}. It needs to be "
            f"one of: {', '.join(SPEC_FORMS)}; a schedule may be written with colons "
            "(every:4:dots, recursive), and an integer as sqrt or log2 (of the "
            "depth)."
        )

    tokens = _Tokens(spec, fail)
    if not tokens.items:
        raise fail("it is empty")
    c = _checkpoint(tokens, depth)
    if tokens.at != len(tokens.items):
        raise fail(f"unexpected {tokens.items[tokens.at][1]!r} after the checkpoint")
    return c


def checkpoint_label(c: Checkpoint) -> str:
    """The text of a checkpoint, as [`eqx_remat.parse_checkpoint`][] reads it
    back: `parse_checkpoint(checkpoint_label(c)) == c`. Short and stable, for
    tables, file names' contents and logs.

    ```python
    import eqx_remat

    c = eqx_remat.ranges((4, eqx_remat.save_names("qkv_proj")), (12, "dots"))
    print(eqx_remat.checkpoint_label(c))
    print(eqx_remat.checkpoint_label(eqx_remat.every(4, "dots")))
    ```

    ```text
    ranges(4:save_names('qkv_proj'), 12:dots)
    every(4, dots)
    ```

    **Arguments:**

    - `c`: `None`, a policy name, a name policy, one of the JAX policies of
      [`eqx_remat.POLICIES`][] (labelled by its name) or a schedule.

    **Raises:**

    `ValueError` for a checkpoint that has no text: any other JAX policy
    callable, or an unknown policy name.
    """
    if c is None:
        return "None"
    if isinstance(c, str):
        if c not in POLICIES:
            raise ValueError(
                f"checkpoint_label: unknown policy name {c!r}. It needs to be one "
                f"of {', '.join(POLICIES)}."
            )
        return c
    if isinstance(c, NamePolicy):
        return repr(c)
    if isinstance(c, ranges):
        return f"ranges({', '.join(f'{n}:{checkpoint_label(k)}' for n, k in c.parts)})"
    for name, make in (*_SCHEDULES.items(), ("recursive", recursive)):
        if type(c) is make:
            counts = [
                str(getattr(c, f)) for f in ("k", "levels", "slots") if hasattr(c, f)
            ]
            policy = getattr(c, "policy")
            inner = [] if policy is None else [checkpoint_label(policy)]
            return f"{name}({', '.join(counts + inner)})"
    for name, p in POLICIES.items():
        if c is p:
            return name
    raise ValueError(
        f"checkpoint_label: {c!r} has no text. Expected None, a policy name, a "
        "name policy (save_names, ...), one of eqx_remat.POLICIES' JAX policies "
        "or a schedule (every, nested, recursive, binomial, ranges)."
    )
