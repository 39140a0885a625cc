"""`eqx_remat.parse_checkpoint` and `eqx_remat.checkpoint_label`: a checkpoint as
text and back. Every checkpoint the library builds round-trips
(`parse_checkpoint(checkpoint_label(c)) == c`); every spelling the command lines
and results files use reads as what it says; a bad spec is a `ValueError` that
names it and lists the valid forms."""

import jax
import pytest
from hypothesis import given, strategies as st

import eqx_remat as er


NAMES = ("layer_input", "qkv_proj", "attention_context", "mlp_hidden", "a-b", "x.y")
SPACES = ("device", "pinned_host")  # where offloaded values are kept

# A tag is any non-empty text: the labels escape it as Python does.
tags = st.one_of(st.sampled_from(NAMES), st.text(min_size=1))
names = st.lists(tags, min_size=1, max_size=3, unique=True)


@st.composite
def per_name_decisions(draw):
    both = draw(st.lists(tags, min_size=1, max_size=4, unique=True))
    cut = draw(st.integers(0, len(both)))
    return er.save_and_offload_names(
        save=both[:cut],
        offload=both[cut:],
        dst=draw(st.sampled_from(SPACES)),
    )


policies = st.one_of(
    st.none(),
    st.sampled_from(sorted(er.POLICIES)),
    names.map(lambda n: er.save_names(*n)),
    names.map(lambda n: er.save_all_but_names(*n)),
    st.builds(
        lambda n, dst: er.offload_names(*n, dst=dst), names, st.sampled_from(SPACES)
    ),
    per_name_decisions(),
)
schedules = st.one_of(
    st.builds(er.every, st.integers(1, 64), policies),
    st.builds(er.nested, st.integers(2, 4), policies),
    st.just(er.recursive()),  # it takes no policy
    st.builds(er.binomial, st.integers(1, 64), policies),
)
parts = st.tuples(st.integers(1, 99), st.one_of(policies, schedules))
checkpoints = st.one_of(
    policies,
    schedules,
    st.lists(parts, min_size=1, max_size=4).map(lambda p: er.ranges(*p)),
)


@given(c=checkpoints)
def test_every_checkpoint_round_trips(c):
    label = er.checkpoint_label(c)
    assert er.parse_checkpoint(label) == c, label
    assert er.checkpoint_label(er.parse_checkpoint(label)) == label


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("None", None),
        ("none", None),
        ("dots", "dots"),
        ("every(4, dots)", er.every(4, "dots")),
        ("every(k=4, policy=dots)", er.every(4, "dots")),
        ("nested(3)", er.nested(3)),
        ("recursive()", er.recursive()),
        ("binomial(log2)", er.binomial(6)),
        ("every(sqrt)", er.every(8)),
        # The spelling that needs no shell quoting.
        ("every:4", er.every(4)),
        ("every:4:dots", er.every(4, "dots")),
        ("nested:3", er.nested(3)),
        ("recursive", er.recursive()),
        ("binomial:log2", er.binomial(6)),
        # Name policies, names bare or quoted (as their repr prints them).
        ("save_names(qkv_proj, out_proj)", er.save_names("qkv_proj", "out_proj")),
        ("save_names('qkv_proj')", er.save_names("qkv_proj")),
        ("offload_names(a, dst=device)", er.offload_names("a", dst="device")),
        (
            "save_and_offload_names(save=(a, b), offload=c)",
            er.save_and_offload_names(save=("a", "b"), offload=("c",)),
        ),
        ("every(2, save_names(a))", er.every(2, er.save_names("a"))),
        ("ranges(4:dots, 60:None)", er.ranges((4, "dots"), (60, None))),
        (
            "ranges(16:every(4, dots), 16:recursive(), 32:binomial(log2))",
            er.ranges(
                (16, er.every(4, "dots")), (16, er.recursive()), (32, er.binomial(5))
            ),
        ),
        (
            "ranges(2:every:2:dots, 6:recursive)",
            er.ranges((2, er.every(2, "dots")), (6, er.recursive())),
        ),
        # As `ranges` prints itself.
        (
            "ranges((4, 'nothing'), (4, save_names('out_proj')))",
            er.ranges((4, "nothing"), (4, er.save_names("out_proj"))),
        ),
    ],
)
def test_parse_checkpoint_reads_each_spelling(spec, expected):
    c = er.parse_checkpoint(spec, depth=64)
    assert c == expected
    assert er.parse_checkpoint(er.checkpoint_label(c), depth=64) == expected


def test_labels_read_as_the_results_files_write_them():
    assert er.checkpoint_label(er.every(4, "dots")) == "every(4, dots)"
    assert er.checkpoint_label(er.recursive()) == "recursive()"
    assert er.checkpoint_label(er.save_names("b", "a")) == "save_names('a', 'b')"
    c = er.ranges((4, er.save_names("qkv_proj")), (12, None))
    assert er.checkpoint_label(c) == "ranges(4:save_names('qkv_proj'), 12:None)"
    # JAX's policy objects of POLICIES are labelled by their names.
    assert er.checkpoint_label(er.POLICIES["dots"]) == "dots"


@pytest.mark.parametrize(
    "name",
    ["a\\b", "tab\there", "line\nbreak", "\x1f", "\U00018cd6", "both'\"quotes", "é"],
    ids=["backslash", "tab", "newline", "control", "non-printable", "quotes", "é"],
)
def test_a_name_that_needs_escaping_round_trips(name):
    for c in (
        er.save_names(name),
        er.save_all_but_names(name, "b"),
        er.every(3, er.save_names(name)),
        er.ranges((2, er.offload_names(name)), (1, er.binomial(2))),
        er.save_and_offload_names(save=("a",), offload=(name,)),
    ):
        label = er.checkpoint_label(c)
        assert er.parse_checkpoint(label) == c, label
    # Written by hand, in either quotes.
    assert er.parse_checkpoint(f"save_names({name!r})") == er.save_names(name)
    double = '"' + repr(name)[1:-1].replace('"', '\\"') + '"'
    if repr(name).startswith("'"):
        assert er.parse_checkpoint(f"save_names({double})") == er.save_names(name)


def test_a_quoted_name_that_is_no_string_literal_is_named():
    with pytest.raises(ValueError, match=r"is not a Python string literal"):
        er.parse_checkpoint("save_names('\\N{nope}')")


@pytest.mark.parametrize(
    "spec, problem",
    [
        ("checkpoint_dots", "unknown checkpoint 'checkpoint_dots'"),
        ("binomial(log2)", r"log2 needs the depth"),
        ("ranges(4:None, dots)", r"ranges\(n:spec, ...\).*a count first"),
        ("ranges(0:None)", "the count of pair 0 must be an int >= 1"),
        ("every(4", "expected ',' or '\\)' where it has the end"),
        ("every(4))", "unexpected '\\)' after the checkpoint"),
        ("every:x", "expected an integer, sqrt or log2, got 'x'"),
        ("save_names()", "save_names expected at least one name"),
        ("offload_names(a, dst=disk)", "dst must be a memory-space name"),
        ("every(4; dots)", "unexpected ';'"),
        ("", "it is empty"),
    ],
)
def test_a_bad_spec_is_named_with_the_valid_forms(spec, problem):
    with pytest.raises(ValueError, match=problem) as e:
        er.parse_checkpoint(spec)
    message = str(e.value)
    assert message.startswith(f"Invalid checkpoint {spec!r}: "), message
    for form in ("None", *er.POLICIES, "every(k[, policy])", "ranges(n:spec, ...)"):
        assert form in message
    assert "save_and_offload_names(save=(name, ...), offload=(name, ...))" in message


@pytest.mark.parametrize("depth", [-4, 0, True], ids=["negative", "zero", "bool"])
def test_a_bad_depth_is_named_with_the_spec(depth):
    for spec in ("every(sqrt)", "binomial(log2)", "dots"):
        with pytest.raises(ValueError, match="depth must be an int >= 1") as e:
            er.parse_checkpoint(spec, depth=depth)
        assert str(e.value).startswith(f"Invalid checkpoint {spec!r} at depth="), e
    assert er.parse_checkpoint("every(sqrt)", depth=1) == er.every(1)


def test_a_checkpoint_without_text_is_an_error():
    with pytest.raises(ValueError, match="has no text"):
        er.checkpoint_label(jax.checkpoint_policies.save_only_these_names("a"))
    with pytest.raises(ValueError, match="unknown policy name 'dotz'"):
        er.checkpoint_label("dotz")
