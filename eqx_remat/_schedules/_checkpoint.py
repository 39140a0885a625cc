"""The checkpoint value: the `Checkpoint` type of every `checkpoint` field, its
normalisation and validation (once, here), and the one walk over the `checkpoint`
fields of a pytree, behind `set_checkpoint` and `plan`.

Errors are `ValueError`s that name the function and the argument, say what was
expected and what was got, as Equinox's do.
"""

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeAlias, TypeVar

import equinox as eqx
import jax.tree_util as jtu

from .._policies._named import to_jax_policy
from .._policies._values import Policy
from ._engine import Schedule


_T = TypeVar("_T")


Checkpoint: TypeAlias = None | str | Callable[..., Any] | Schedule
"""The type of every `checkpoint` field: `None` (no checkpointing), a policy name,
a JAX policy callable, or a [`eqx_remat.Schedule`][]."""


class PerStack(Mapping):
    """A checkpoint for each stack of a model, by the path of its `checkpoint`
    field (as [`eqx_remat.set_checkpoint`][] takes a mapping): a hashable,
    read-only mapping that compares by value, in the order given.

    ```python
    import eqx_remat

    c = eqx_remat.PerStack({".encoder.checkpoint": "nothing", ".head.checkpoint": None})
    print(c[".encoder.checkpoint"], c == eqx_remat.PerStack(dict(c)))
    ```

    ```text
    nothing True
    ```
    """

    _pairs: tuple[tuple[str, Any], ...]

    def __init__(self, checkpoints: Mapping[str, Any]):
        pairs = tuple((str(p), c) for p, c in dict(checkpoints).items())
        seen: dict[str, Any] = {}
        for (path, _), key in zip(pairs, dict(checkpoints)):
            if path in seen:
                raise ValueError(
                    f"PerStack expected one checkpoint per path. Got {seen[path]!r} "
                    f"and {key!r}, which are both the path {path!r}."
                )
            seen[path] = key
        for path, c in pairs:
            check_checkpoint(c, name=f"PerStack: checkpoint of {path!r}")
        object.__setattr__(self, "_pairs", pairs)

    def __getitem__(self, path: str) -> Any:
        for p, c in self._pairs:
            if p == path:
                return c
        raise KeyError(path)

    def __iter__(self):
        return iter(p for p, _ in self._pairs)

    def __len__(self) -> int:
        return len(self._pairs)

    def __hash__(self) -> int:
        return hash(self._pairs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PerStack) and self._pairs == other._pairs

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("PerStack is read-only")

    def __repr__(self) -> str:
        inner = ", ".join(f"{p!r}: {checkpoint_name(c)}" for p, c in self._pairs)
        return f"PerStack({{{inner}}})"


Planned: TypeAlias = Checkpoint | PerStack
"""What the planner compiles and returns: one checkpoint for every stack, or a
[`eqx_remat.PerStack`][]."""


def checkpoint_name(c: Any) -> str:
    """`c` as messages and tables print it: a name or `None` as its repr
    (`'dots'`), anything else as its `str`."""
    return repr(c) if c is None or isinstance(c, str) else str(c)


# The schedules a `checkpoint` may be, as messages list them; a part of a
# `ranges(...)` may be any of them but `ranges`.
_SCHEDULES = "eqx_remat.every, nested, recursive, binomial, ranges"
SCHEDULES_IN_RANGES = "eqx_remat.every, nested, recursive, binomial"


def normalise_checkpoint(
    spec: Any, *, name: str = "checkpoint", schedules: str = _SCHEDULES
) -> Schedule | Policy | None:
    """`spec` as it is applied: a schedule as it is, a policy or its name as a
    JAX policy, `None` as `None`.

    **Raises:**

    `ValueError` starting with `name`, listing the valid policy names and the
    `schedules` accepted there.
    """
    if isinstance(spec, Schedule):
        return spec
    try:
        return to_jax_policy(spec)
    except ValueError as e:
        raise ValueError(
            f"{name} expected None, a policy name, a JAX policy or a schedule "
            f"({schedules}). {e}"
        ) from None


def check_checkpoint(
    spec: Any, *, name: str = "checkpoint", schedules: str = _SCHEDULES
) -> Checkpoint:
    """Check that `spec` can be a `checkpoint`: `None`, a policy name, a JAX
    policy callable or a [`eqx_remat.Schedule`][].

    The check every `checkpoint` argument goes through: the combinators',
    [`eqx_remat.set_checkpoint`][]'s, [`eqx_remat.plan`][]'s candidates and the
    zoo's constructors. A model of your own can call it in its `__init__`:

    ```python
    import eqx_remat

    eqx_remat.internal.check_checkpoint(eqx_remat.every(4))  # fine
    try:
        eqx_remat.internal.check_checkpoint("dot", name="MyModel: checkpoint")
    except ValueError as e:
        print(str(e)[:60])
    ```

    ```text
    MyModel: checkpoint expected None, a policy name, a JAX poli
    ```

    **Arguments:**

    - `spec`: the value to check.
    - `name`: what to call it in the message (e.g. `"MLP: checkpoint"`).
    - `schedules`: the schedules the message lists as accepted.

    **Returns:**

    `spec`, unchanged.

    **Raises:**

    `ValueError` starting with `name`, listing the valid policy names.
    """
    normalise_checkpoint(spec, name=name, schedules=schedules)
    return spec


def _is_module(x: Any) -> bool:
    return isinstance(x, eqx.Module)


_CHECKPOINT_FIELD = "eqx_remat.checkpoint"


def checkpoint_field(**kwargs: Any) -> Any:
    """`eqx.field(static=True, **kwargs)`, declared as holding a `Checkpoint`:
    `map_checkpoints` finds such a field by this declaration, whatever its
    name ([`eqx_remat.Stacked`][]'s `checkpoint` is one)."""
    metadata = dict(kwargs.pop("metadata", {}), **{_CHECKPOINT_FIELD: True})
    return eqx.field(static=True, metadata=metadata, **kwargs)


def _is_checkpoint_field(f: dataclasses.Field) -> bool:
    return f.name == "checkpoint" or bool(f.metadata.get(_CHECKPOINT_FIELD))


def map_fields(
    tree: _T, is_field: Callable[[dataclasses.Field], bool], fn: Callable[[Any], Any]
) -> tuple[_T, list[Any]]:
    """The one walk over a kind of module field: a copy of `tree` in which the
    value `v` of every field `f` with `is_field(f)` of every `eqx.Module`
    (modules nested inside others included) is replaced by `fn(v)`, and the
    list of the fields' old values, in the order met. The rest of the tree,
    arrays included, is kept as it is."""
    out, found = map_fields_at(tree, is_field, lambda _, v: fn(v))
    return out, [v for _, v in found]


def map_fields_at(
    tree: _T,
    is_field: Callable[[dataclasses.Field], bool],
    fn: Callable[[str, Any], Any],
) -> tuple[_T, list[tuple[str, Any]]]:
    """`map_fields`, telling `fn` the path of each field too (`fn(path, v)`):
    where it sits in `tree`, as `jax.tree_util.keystr` writes a path, then the
    field's name (`".encoder.checkpoint"`, `"[0].checkpoint"`); the list is
    of `(path, old value)` pairs."""
    found: list[tuple[str, Any]] = []

    def replace(prefix: str, x: Any) -> Any:
        if not _is_module(x):
            return x
        new = object.__new__(type(x))
        for f in dataclasses.fields(x):
            value = getattr(x, f.name)
            here = f"{prefix}.{f.name}"
            if is_field(f):
                found.append((here, value))
                value = fn(here, value)
            else:
                value = jtu.tree_map_with_path(
                    lambda p, v, here=here: replace(here + jtu.keystr(p), v),
                    value,
                    is_leaf=_is_module,
                )
            object.__setattr__(new, f.name, value)
        return new

    out = jtu.tree_map_with_path(
        lambda p, v: replace(jtu.keystr(p), v), tree, is_leaf=_is_module
    )
    return out, found


def map_checkpoints(
    tree: _T, fn: Callable[[Checkpoint], Checkpoint]
) -> tuple[_T, list[Checkpoint]]:
    """`map_fields` over checkpoint fields: one declared with
    `checkpoint_field()` — the `checkpoint` of an [`eqx_remat.Stacked`][],
    wherever it sits in a model — or any field named `checkpoint` (the zoo's
    models, and models of your own that follow them)."""
    return map_fields(tree, _is_checkpoint_field, fn)


def map_loss_chunk_sizes(
    tree: _T, fn: Callable[[int | None], int | None]
) -> tuple[_T, list[int | None]]:
    """`map_fields` over fields named `loss_chunk_size` (a
    `zoo.Transformer`'s, and models of your own that follow it)."""
    return map_fields(tree, lambda f: f.name == "loss_chunk_size", fn)


def checkpoint_paths(tree: Any) -> list[str]:
    """The path of every checkpoint field of `tree`, in the order met (as
    [`eqx_remat.set_checkpoint`][] takes them: `".encoder.checkpoint"`)."""
    return [
        path for path, _ in map_fields_at(tree, _is_checkpoint_field, lambda p, v: v)[1]
    ]


def _parts(tree: Any) -> list[tuple[str, Any]]:
    """The top-level parts of `tree`, with their paths: `tree` itself where it
    is a module, else its children (the arguments of `(model, opt_state)`)."""
    if _is_module(tree):
        return [("", tree)]
    children = jtu.tree_flatten_with_path(tree, is_leaf=lambda x: x is not tree)[0]
    return [(jtu.keystr(p), x) for p, x in children if p]


def _copies_in(
    x: Any, path: str, of: Any, paths: list[str], out: list[tuple[str, Any]]
) -> None:
    """Append to `out` `(path, part)` (its path from `x`, prefixed by `path`)
    of every proper part of `x` that may be a copy of `of`: of its type, with
    checkpoint fields at the same `paths`; outermost first, not looking
    inside one."""
    children = jtu.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)[0]
    for p, y in children:
        if not p:
            continue
        here = path + jtu.keystr(p)
        if type(y) is type(of) and checkpoint_paths(y) == paths:
            out.append((here, y))
        else:
            _copies_in(y, here, of, paths, out)


def _shapes(x: Any) -> list[tuple[int, ...]]:
    return sorted(tuple(a.shape) for a in jtu.tree_leaves(x) if hasattr(a, "shape"))


def copies(tree: Any) -> dict[str, str]:
    """`{path: original}`: the checkpoint fields of `tree` that are copies of
    another's. A copy of a top-level part of `tree` (the model among a
    function's arguments) is a part of another top-level part of the same type
    with checkpoint fields at the same paths (of the parts it may copy, the
    first whose arrays have its arrays' shapes): an optimiser state made by
    `optimiser.init(eqx.filter(model, eqx.is_array))` holds such copies of the
    model's modules (Adam's `mu` and `nu`), static `checkpoint` fields
    included, and they must hold what the model's fields hold for the model
    and the state to have the same structure."""
    parts = [(h, x, checkpoint_paths(x)) for h, x in _parts(tree)]
    candidates: dict[str, list[tuple[str, list[str], bool]]] = {}
    for head, part, paths in parts:
        if not paths:
            continue
        for other_head, other, _ in parts:
            if other_head == head:
                continue
            found: list[tuple[str, Any]] = []
            _copies_in(other, other_head, part, paths, found)
            for at, copy in found:
                alike = _shapes(copy) == _shapes(part)
                candidates.setdefault(at, []).append((head, paths, alike))
    out: dict[str, str] = {}
    for at, of in candidates.items():
        head, paths, _ = next((c for c in of if c[2]), of[0])
        out.update({at + p: head + p for p in paths})
    return out


def resolve_paths(tree: Any, spec: Mapping[str, Any]) -> dict[str, Any]:
    """`spec`'s paths as paths from the root of `tree`, with the copies of the
    fields they name (see `copies`): the rule by which
    [`eqx_remat.set_checkpoint`][] reads a mapping.

    **Raises:** `ValueError` for a path that names no checkpoint field of
    `tree` nor of any of its top-level parts."""
    paths = checkpoint_paths(tree)
    have = set(paths)
    heads = [h for h, _ in _parts(tree) if h]
    out: dict[str, Any] = {}
    for key, c in spec.items():
        full = [key] if key in have else [h + key for h in heads if h + key in have]
        if not full and paths:
            parts = "" if not heads else " (or of one of its top-level parts)"
            raise ValueError(
                f"set_checkpoint expected paths of checkpoint fields of the tree"
                f"{parts}, which are {', '.join(map(repr, paths))}. Got {key!r}, "
                "which names none."
            )
        out.update(dict.fromkeys(full, c))
    named = dict(out)
    for path, original in copies(tree).items():
        if original in named and path not in named:
            out[path] = named[original]
    return out


def part_paths(tree: Any, paths: Sequence[str]) -> dict[str, str]:
    """`{path: spelling}`: each of `paths` (from the root of `tree`) taken from
    inside the top-level part of `tree` that holds them all
    (`"[0].encoder.checkpoint"` -> `".encoder.checkpoint"`), where one does
    and the spelling names no other field (`resolve_paths` reads it back to
    the same field); else as it is. The one spelling of a stack's path in
    [`eqx_remat.plan`][]'s results, progress lines and errors."""
    have = set(checkpoint_paths(tree))
    heads = [h for h, _ in _parts(tree) if h]

    def head_of(p: str) -> str | None:
        for h in heads:
            if p.startswith(h) and p[len(h) : len(h) + 1] in (".", "["):
                return h
        return None

    holders = {head_of(p) for p in paths}
    if len(holders) != 1 or None in holders:
        return {p: p for p in paths}
    (head,) = holders
    assert head is not None
    out = {p: p[len(head) :] for p in paths}
    if any(
        r in have or any(h + r in have for h in heads if h != head)
        for r in out.values()
    ):
        return {p: p for p in paths}
    return out


def set_checkpoint(tree: _T, spec: Checkpoint | Mapping[str, Checkpoint]) -> _T:
    """A copy of `tree` with every `checkpoint` field replaced by `spec`; or,
    with a mapping `{path: checkpoint}`, each field named by a path replaced by
    its checkpoint (and the others kept).

    Works on any pytree: zoo models, modules nested inside other modules, lists of
    models, models of your own that hold their layers in an
    [`eqx_remat.Stacked`][] (its `checkpoint` is found wherever it sits). Use it
    to change the schedule of a trained model, or to compare schedules on the
    same weights. A model with several stacks (an encoder and a decoder) can
    give each its own:

    ```python
    model = eqx_remat.set_checkpoint(
        model, {".encoder.checkpoint": "nothing", ".decoder.checkpoint": None}
    )
    ```

    A path is where the field sits in `tree`, as `jax.tree_util.keystr` writes
    it, then the field's name (`".encoder.checkpoint"` in a model); where
    `tree` is a tuple (or list, or dict) of parts, a path may also be taken
    from inside one of its parts (`".encoder.checkpoint"` names the model's
    field in `(model, opt_state)`, as `"[0].encoder.checkpoint"` does). This
    is how [`eqx_remat.PlanResult`][]`.stacks` and the paths of a planned
    [`eqx_remat.PerStack`][] name them. A path that names no checkpoint field
    is an error that lists those there are.

    The `checkpoint` field is static: it is part of the tree's structure, and so
    of the structure of anything built from the model — an optimiser state made
    by `optimiser.init(eqx.filter(model, eqx.is_array))` holds copies of the
    model's modules (Adam's `mu` and `nu`). To switch the checkpoint of a model
    being trained, switch both in one call, so that the next update sees
    matching structures:

    ```python
    model, opt_state = eqx_remat.set_checkpoint((model, opt_state), "dots")
    ```

    A mapping sets each copy of a field it names too: a copy is a part of
    another of the tree's top-level parts of the same type as the part that
    holds the named field, with checkpoint fields at the same paths (Adam's
    `mu` and `nu` are copies of the model), so
    `set_checkpoint((model, opt_state), result.checkpoint)` switches a model
    and its optimiser state to a plan's pick, one checkpoint per stack.

    **Arguments:**

    - `tree`: any pytree containing `eqx.Module`s with a `checkpoint` field
      (an [`eqx_remat.Stacked`][], a zoo model).
    - `spec`: the new checkpoint: `None`, a policy or its name, or a schedule;
      or a mapping from paths to such checkpoints.

    **Returns:**

    The same pytree, with the same arrays, and `spec` in every `checkpoint`
    field (or in those it names).

    **Raises:**

    `ValueError` for an invalid `spec` (naming the path of a bad one in a
    mapping), a path that names no checkpoint field, or when `tree` holds no
    module with a `checkpoint` field (a wrong or mistyped tree would otherwise
    silently get no checkpointing).
    """
    if isinstance(spec, Mapping):
        for path, c in spec.items():
            check_checkpoint(c, name=f"set_checkpoint: spec[{path!r}]")
        full = resolve_paths(tree, spec)
        out, found = map_fields_at(
            tree, _is_checkpoint_field, lambda p, v: full.get(p, v)
        )
    else:
        check_checkpoint(spec, name="set_checkpoint: spec")
        out, found = map_checkpoints(tree, lambda _: spec)
    if not found:
        raise ValueError(
            "set_checkpoint expected a pytree containing an eqx.Module with a "
            "`checkpoint` field (an eqx_remat.Stacked, every zoo model). Got "
            f"{type(tree).__name__} without one: nothing would be checkpointed."
        )
    return out
