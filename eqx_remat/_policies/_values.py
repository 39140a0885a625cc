"""Name policies: the policy values that decide by `checkpoint_name` tags.

A policy is what `jax.checkpoint(..., policy=...)` takes: a function called on each
primitive of the checkpointed function that says whether its output is saved
(`True`), recomputed (`False`) or offloaded to another memory space.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, TypeAlias

import jax

from .._inspect._jaxpr import is_tag, on_host
from ._second_order import second_order_offload_message


Policy: TypeAlias = Callable[..., Any]

_cp = jax.checkpoint_policies


class NamePolicy:
    """The base of eqx_remat's policies that decide by `checkpoint_name` tags
    (`save_names`, `save_all_but_names`, `offload_names`,
    `save_and_offload_names`): each has `names`, a `frozenset` of the tags it
    decides for. Where eqx_remat applies one to a layer, its names are checked
    against the layer's tags (`check_tags`); JAX's own policies are not.
    """


def check_tags(pol: NamePolicy, tags: list[str] | set[str]) -> None:
    """Raise a `ValueError` when a name of the name policy `pol` is not among
    `tags`, the `checkpoint_name` tags of the function it checkpoints: such a
    name does nothing (a typo, or a tag never attached), and the policy would
    silently save, offload or recompute other than asked. The message names
    the names that tag nothing and lists the tags that exist, sorted."""
    names: frozenset[str] = getattr(pol, "names")
    missing = sorted(names - set(tags))
    if not missing:
        return
    there = (
        f"The tags there are {sorted(tags)}."
        if tags
        else "That function has no checkpoint_name tags."
    )
    raise ValueError(
        f"{pol!r} expected names that tag values of the function it checkpoints "
        "(with jax.ad_checkpoint.checkpoint_name); a name that tags nothing "
        f"would silently do nothing. Got {', '.join(map(repr, missing))}, which "
        f"{'tags' if len(missing) == 1 else 'tag'} nothing. {there}"
    )


@dataclasses.dataclass(frozen=True)
class save_names(NamePolicy):
    """Save only the values tagged with one of `names` (by
    `jax.ad_checkpoint.checkpoint_name`); recompute everything else.

    Each name must tag a value of the layers it checkpoints, or tracing raises
    a `ValueError` (see [Name-based policies][name-based-policies]).

    Compares and hashes by value, so rebuilding the same policy does not trigger
    recompilation.

    **Arguments:**

    - `*names`: the `checkpoint_name` tags to save.
    """

    names: frozenset[str]

    def __init__(self, *names):
        _check_names("save_names", names)
        object.__setattr__(self, "names", frozenset(names))

    def __repr__(self) -> str:
        return f"save_names({', '.join(map(repr, sorted(self.names)))})"

    def __call__(self, prim, *_, **params) -> bool:
        return is_tag(prim, params) and params["name"] in self.names


@dataclasses.dataclass(frozen=True)
class save_all_but_names(NamePolicy):
    """Save everything the backward pass needs except the values tagged with one of
    `names`, which are recomputed.

    Unlike `jax.checkpoint_policies.save_anything_except_these_names` in jax 0.10.2
    (which ignores its names and saves everything), this really excludes the named
    values. A tag is an identity, and a JAX policy sees one operation at a time,
    so refusing to save the tag alone would save the identical output of the
    operation that produced it. eqx_remat's combinators (`scan_layers`, `chain`,
    the schedules and the zoo) therefore trace each layer once and recompute, with
    each excluded value:

    - the operations that produced it, back to values the backward pass needs
      anyway (for `qkv_proj = h @ W + b`: the bias add and the matmul, from `h`
      and `W`);
    - its reshapes, slices, transposes and dtype casts (the `q`, `k`, `v` split
      from a fused projection);
    - the derivative coefficients computed from it (`3 x²` in a GELU's
      derivative).

    So excluding a value that is saved under `"everything"` saves strictly less,
    and excluding one that is not (a layer's input, which a checkpointed layer
    always keeps; an output only added to the residual stream) changes nothing.
    Values inside nested control flow (a `lax.scan` within the layer) are not
    followed. Passed directly to `jax.checkpoint`, outside the combinators, this
    policy excludes the tags but not their producers, and saves about as much
    as `"everything"`.

    Each name must tag a value of the layers it checkpoints, or tracing raises
    a `ValueError` (see [Name-based policies][name-based-policies]).

    Compares and hashes by value.

    **Arguments:**

    - `*names`: the `checkpoint_name` tags not to save.
    """

    names: frozenset[str]

    def __init__(self, *names):
        _check_names("save_all_but_names", names)
        object.__setattr__(self, "names", frozenset(names))

    def __repr__(self) -> str:
        return f"save_all_but_names({', '.join(map(repr, sorted(self.names)))})"

    def __call__(self, prim, *_, **params) -> bool:
        if is_tag(prim, params):
            return params["name"] not in self.names
        return True


@dataclasses.dataclass(frozen=True)
class offload_names(NamePolicy):
    """Offload the values tagged with one of `names` from memory space `src` to
    `dst` (on the forward pass) and back (on the backward pass); recompute
    everything else.

    Offloading needs a backend with a host memory space (TPU, GPU); on the CPU the
    values stay where they are.

    Reverse-over-reverse differentiation (`jax.grad` of `jax.grad`) through an
    offloading policy raises a `NotImplementedError` at trace time, with JAX's
    remat3 or without: JAX cannot differentiate the reload of an offloaded
    value in the backward pass. Forward-over-reverse (`jax.jvp` of `jax.grad`,
    `jax.hessian`) works.

    Each name must tag a value of the layers it checkpoints, or tracing raises
    a `ValueError` (see [Name-based policies][name-based-policies]).

    Compares and hashes by value.

    **Arguments:**

    - `*names`: the `checkpoint_name` tags to offload.
    - `src`: the memory space the values are computed in: `"device"` (the
      default, and the only one: a layer's values are computed in device
      memory; JAX cannot differentiate an offload from `"pinned_host"` of
      values that are not, so it is refused here, naming `src`).
    - `dst`: where they are kept until the backward pass, `"pinned_host"`
      (the default) or `"device"`.
    """

    names: frozenset[str]
    src: str
    dst: str

    def __init__(self, *names, src="device", dst="pinned_host"):
        _check_names("offload_names", names)
        _check_spaces("offload_names", src, dst)
        object.__setattr__(self, "names", frozenset(names))
        object.__setattr__(self, "src", src)
        object.__setattr__(self, "dst", dst)

    def __repr__(self) -> str:
        names = ", ".join(map(repr, sorted(self.names)))
        return f"offload_names({names}, src={self.src!r}, dst={self.dst!r})"

    def __call__(self, prim, *args, **params):
        return self._jax_policy(prim, *args, **params)

    @property
    def _jax_policy(self) -> Policy:
        return _offload_policy(frozenset(), self.names, self.src, self.dst)


@dataclasses.dataclass(frozen=True)
class save_and_offload_names(NamePolicy):
    """Per `checkpoint_name` tag, one of three decisions: save the values
    tagged with one of `save` (kept in device memory), offload those tagged with
    one of `offload` (moved from memory space `src` to `dst` on the forward pass
    and back on the backward pass), recompute everything else.

    JAX's `jax.checkpoint_policies.save_and_offload_only_these_names` as one
    value: it compares and hashes by value (rebuilding an equal one does not
    recompile), its names are checked when it is built, and, like
    [`eqx_remat.offload_names`][], differentiating its backward pass again
    (grad of grad) raises a clear `NotImplementedError` when something is
    offloaded. With `offload=()` it saves what [`eqx_remat.save_names`][]
    saves; with `save=()`, it is [`eqx_remat.offload_names`][].

    ```python
    import eqx_remat

    # zoo.Transformer: keep the projections, move the MLP's hidden
    # activations to host memory, recompute the rest.
    pol = eqx_remat.save_and_offload_names(
        save=("qkv_proj", "out_proj"), offload=("mlp_hidden",)
    )
    same = eqx_remat.save_and_offload_names(
        offload="mlp_hidden", save=("out_proj", "qkv_proj")
    )
    print(pol == same, hash(pol) == hash(same), sorted(pol.names))
    ```

    ```text
    True True ['mlp_hidden', 'out_proj', 'qkv_proj']
    ```

    Offloading needs a backend with a host memory space (TPU, GPU); on the CPU
    the offloaded values stay where they are.

    **Arguments:**

    - `save`: the tags to save, a tuple of names (or one name as a string).
    - `offload`: the tags to offload, likewise. No name may be in both, and at
      least one name must be given.
    - `src`: the memory space the offloaded values are computed in:
      `"device"` (the default, and the only one, as for
      [`eqx_remat.offload_names`][]).
    - `dst`: where they are kept until the backward pass, `"pinned_host"`
      (the default) or `"device"`.
    """

    save: frozenset[str]
    offload: frozenset[str]
    src: str
    dst: str

    def __init__(self, save=(), offload=(), *, src="device", dst="pinned_host"):
        fn = "save_and_offload_names"
        save, offload = (
            _name_tuple(fn, "save", save),
            _name_tuple(fn, "offload", offload),
        )
        _check_names(fn, save + offload)
        both = sorted(set(save) & set(offload))
        if both:
            raise ValueError(
                f"{fn} expected each name in save or in offload, not both. Got "
                f"{', '.join(map(repr, both))} in both."
            )
        _check_spaces(fn, src, dst)
        object.__setattr__(self, "save", frozenset(save))
        object.__setattr__(self, "offload", frozenset(offload))
        object.__setattr__(self, "src", src)
        object.__setattr__(self, "dst", dst)

    @property
    def names(self) -> frozenset[str]:
        """Every name it decides for (saved or offloaded)."""
        return self.save | self.offload

    def __repr__(self) -> str:
        save = tuple(sorted(self.save))
        offload = tuple(sorted(self.offload))
        return (
            f"save_and_offload_names(save={save!r}, offload={offload!r}, "
            f"src={self.src!r}, dst={self.dst!r})"
        )

    def __call__(self, prim, *args, **params):
        return self._jax_policy(prim, *args, **params)

    @property
    def _jax_policy(self) -> Policy:
        return _offload_policy(self.save, self.offload, self.src, self.dst)


def _name_tuple(fn: str, arg: str, names: Any) -> tuple:
    """`names` (a string, or an iterable of them) as a tuple."""
    if isinstance(names, str):
        return (names,)
    try:
        return tuple(names)
    except TypeError:
        raise ValueError(
            f"{fn}: {arg} expected a tuple of names (the tags given to "
            f"`checkpoint_name`). Got {names!r}."
        ) from None


@functools.lru_cache(maxsize=256)
def _offload_policy(
    save: frozenset[str], offload: frozenset[str], src: str, dst: str
) -> Policy:
    """The JAX policy of `save_and_offload_names(save=save, offload=offload,
    src=src, dst=dst)` (and of `offload_names`, which saves nothing): one object
    per value (while it is among the 256 most recently used), so that rebuilding
    the same policy does not retrigger compilation. `Offloading` only where
    it offloads: with no names to offload, it is differentiated to any order,
    as `save_names` is."""
    pol = _cp.save_and_offload_only_these_names(
        names_which_can_be_saved=sorted(save),
        names_which_can_be_offloaded=sorted(offload),
        offload_src=src,
        offload_dst=dst,
    )
    if not offload:
        return pol
    return Offloading(pol, repr((sorted(save), sorted(offload), src, dst)))


class Offloading:
    """A JAX offloading policy that raises a clear error, at trace time, when the
    backward pass it produced is itself differentiated.

    JAX calls a policy on the operations of the function it checkpoints; when the
    backward pass is differentiated again, the policy is called once more, on the
    backward pass's operations — which include the reload of an offloaded value
    from host memory. That reload is what JAX cannot transpose, so seeing an
    input in host memory is the signal. (JAX's remat3 never asks a policy
    there: under it, `checkpointed` marks the checkpoint instead, see
    `_second_order.py`.)
    """

    def __init__(self, policy: Policy, key: str):
        self.policy = policy
        self.key = key

    def __call__(self, prim, *avals, **params):
        if any(on_host(a) for a in avals):
            raise NotImplementedError(second_order_offload_message())
        return self.policy(prim, *avals, **params)

    def __repr__(self) -> str:
        return f"Offloading({self.key})"


def _check_spaces(fn: str, src: Any, dst: Any) -> None:
    # A layer's values are computed in device memory: JAX's offload of such a
    # value from "pinned_host" fails in the backward pass with a bare
    # AssertionError, so `src` is "device" only. JAX reads any other name as
    # "device": a misspelt "pinned_host" would offload nothing.
    valid = {"src": ("device",), "dst": ("device", "pinned_host")}
    for arg, value in (("src", src), ("dst", dst)):
        if not isinstance(value, str) or value not in valid[arg]:
            why = ""
            if arg == "src":
                why = (
                    " (a layer's values are computed in device memory; JAX "
                    "cannot differentiate an offload of them from host memory)"
                )
            raise ValueError(
                f"{fn}: {arg} must be a memory-space name, "
                f"{' or '.join(map(repr, valid[arg]))}{why}. Got {value!r}."
            )


def _check_names(fn: str, names: tuple) -> None:
    if len(names) == 0:
        raise ValueError(f"{fn} expected at least one name. Got none.")
    for n in names:
        if not isinstance(n, str):
            raise ValueError(
                f"{fn} expected names as strings (the tags given to "
                f"`checkpoint_name`). Got {n!r} of type {type(n).__name__}."
            )
        if n == "":
            raise ValueError(f"{fn} expected non-empty names. Got ''.")
