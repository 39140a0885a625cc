"""Collectives in a compiled, partitioned program (`collectives`): the bytes each
chip sends per step in all-gathers, reduce-scatters, all-reduces, all-to-alls
and collective permutes, each counted once per trip of the loops around it, as
`count_flops` counts FLOPs; and, of a program for several TPU slices, what it
sends between them over the data center network. Read from the program's text
(`Compiled.as_text()`): XLA's SPMD partitioner adds the collectives while
compiling, so no jaxpr has them. Between slices, XLA's TPU compiler writes a
collective as a `send` to its Megascale runtime (a host transfer naming the
collective: `_xla_megascale_transfer_type="ALL_REDUCE"`), over the slices."""

import math
import re
from typing import NamedTuple


KINDS = (
    "all-gather",
    "reduce-scatter",
    "all-reduce",
    "all-to-all",
    "collective-permute",
)

_ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s4": 0.5, "u4": 0.5, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_INSTRUCTION = re.compile(
    r"^\s+(?:ROOT\s+)?%?([^\s=]+) = (.+?) ([a-z][a-z0-9\-]*)\((.*)$"
)
_CALLEE = re.compile(
    r"\b(condition|body|calls|to_apply|true_computation|false_computation)"
    r"=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_MEGASCALE = re.compile(r'_xla_megascale_transfer_type="([A-Z_]+)"')


class Collectives(NamedTuple):
    """What a program's chips send each other in one step, per chip.

    **Attributes:**

    - `sent`: bytes each chip sends, by kind (`KINDS`), each collective once per
      trip of the loops around it, over its group of `n` chips as ring
      algorithms send them: an all-gather `(n - 1) / n` of its result, a
      reduce-scatter `n - 1` times its result (a shard), an all-reduce twice
      `(n - 1) / n` of it, an all-to-all `(n - 1) / n` of it, a collective
      permute all of it.
    - `unknown_loops`: how many loops' trip counts could not be read from the
      program (their collectives are counted once per entry to the loop).
    - `network`: of a program for several slices, bytes each chip sends chips
      of other slices (over the data center network), by kind, as `sent`
      counts them over the slices; `sent` is then what stays within a slice.
    """

    sent: dict[str, int]
    unknown_loops: int = 0
    network: dict[str, int] = {}

    @property
    def total(self) -> int:
        """Bytes sent within a slice."""
        return sum(self.sent.values())

    @property
    def network_total(self) -> int:
        """Bytes sent to other slices."""
        return sum(self.network.values())


def collectives(hlo: str, slices: int = 1) -> Collectives:
    """The collectives of a compiled program, from its text (`as_text()`), for
    `slices` slices."""
    computations, entry = _computations(hlo)
    header = hlo.split("\n", 1)[0]
    partitions = re.search(r"num_partitions=(\d+)", header)
    everyone = int(partitions.group(1)) if partitions else 1
    sent = dict.fromkeys(KINDS, 0.0)
    network = dict.fromkeys(KINDS, 0.0)
    unknown = 0

    def visit(name: str, times: int) -> None:
        nonlocal unknown
        for line in computations.get(name, ()):
            m = _INSTRUCTION.match(line)
            if m is None:
                continue
            _, result, op, rest = m.groups()
            kind = op.removesuffix("-done")
            if kind in sent and not op.endswith("-start"):
                sent[kind] += times * _sent(
                    kind, _bytes(result), _group(rest, everyone)
                )
            megascale = _MEGASCALE.search(rest) if op == "send" else None
            if megascale is not None:
                kind = megascale.group(1).lower().replace("_", "-")
                kind = kind if kind in network else "collective-permute"
                # The send's operand: the first array of its result tuple.
                first = _ARRAY.search(result)
                operand = 0.0 if first is None else _bytes(first.group(0))
                network[kind] += times * _network_sent(kind, operand, slices)
            callees = dict(_CALLEE.findall(rest))
            if op == "while":
                trips = _trips(rest, computations.get(callees.get("condition", "")))
                unknown += trips is None
                visit(callees["body"], times * (1 if trips is None else trips))
                continue
            for role, callee in callees.items():
                if role != "to_apply":  # a reduction's: no collective in it
                    visit(callee, times)
            for branches in _BRANCHES.findall(rest):
                for callee in branches.split(","):
                    visit(callee.strip().lstrip("%"), times)

    visit(entry, 1)
    whole = lambda d: {k: int(round(v)) for k, v in d.items()}
    return Collectives(whole(sent), unknown, whole(network))


def _computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    """Each computation's instruction lines, by name, and the entry's name."""
    out: dict[str, list[str]] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            head = line.split("(", 1)[0].split()
            if head and head[0] == "ENTRY":
                current = entry = head[1].lstrip("%")
            elif head and head[0] != "HloModule":
                current = head[0].lstrip("%")
            else:
                continue
            out[current] = []
        elif current is not None and line.startswith(" "):
            out[current].append(line)
    return out, entry


def _bytes(result: str) -> float:
    """The bytes of the arrays in an instruction's result type."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(result):
        size = math.prod(int(d) for d in dims.split(",") if d)
        total += size * _item_bytes(dtype)
    return total


def _item_bytes(dtype: str) -> float:
    if dtype in _ITEM_BYTES:
        return _ITEM_BYTES[dtype]
    bits = re.match(r"[a-z]+(\d+)", dtype)
    if bits is None:
        return 0.0  # token[], opaque
    return 1.0 if dtype.startswith("f8") else int(bits.group(1)) / 8


def _group(rest: str, everyone: int) -> int:
    """How many chips an instruction's collective spans: its replica groups'
    size (`{{0,1},{2,3}}`, `[2,2]<=[4]`, or `mesh['a'=2,'b'=2] {'b'}`), or
    every chip (`{}`, or none given)."""
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\](?:\s*\{([^}]*)\})?", rest)
    if mesh:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", mesh.group(1)))
        axes = re.findall(r"'([^']+)'", mesh.group(2) or "") or list(sizes)
        return math.prod(int(sizes[a]) for a in axes if a in sizes)
    iota = re.search(r"replica_groups=\[([0-9,]+)\]<=", rest)
    if iota:
        return int(iota.group(1).split(",")[-1])
    listed = re.search(r"replica_groups=\{\{([0-9,]*)\}", rest)
    if listed:
        return len(listed.group(1).split(","))
    return everyone


def _sent(kind: str, result: float, n: int) -> float:
    """Bytes one chip sends for a collective of `result` bytes over `n` chips."""
    if n <= 1:
        return 0.0
    if kind == "collective-permute":
        return result
    if kind == "reduce-scatter":
        return (n - 1) * result
    share = (n - 1) / n * result
    return 2 * share if kind == "all-reduce" else share


def _network_sent(kind: str, operand: float, n: int) -> float:
    """Bytes one chip sends other slices for a collective over `n` slices
    whose operand (the chip's part) is `operand` bytes, as `_sent` counts."""
    if kind == "all-gather":  # the operand is the result's `1 / n`
        return _sent(kind, n * operand, n)
    if kind == "reduce-scatter":  # the operand is the whole
        return _sent(kind, operand / n, n)
    return _sent(kind, operand, n)


def _trips(rest: str, condition: list[str] | None) -> int | None:
    """A `while`'s trip count: XLA's `known_trip_count`, else its condition's
    counter compared with a constant (`i < N` from 0, as `lax.scan` and
    `fori_loop` count), else `None`."""
    known = re.search(r'known_trip_count":\{"n":"(\d+)"', rest)
    if known:
        return int(known.group(1))
    constants = {}
    for line in condition or ():
        m = _INSTRUCTION.match(line)
        if m is None:
            continue
        name, _, op, args = m.groups()
        value = re.match(r"(-?\d+)\)", args)
        if op == "constant" and value:
            constants[name] = int(value.group(1))
        direction = re.search(r"direction=(\w+)", args)
        operands = re.findall(r"%([^\s,()]+)", args.split(")", 1)[0])
        if op != "compare" or direction is None or len(operands) != 2:
            continue
        # `i < N` or `N > i` (`<=`, `>=`: one more trip).
        flipped = {"LT": "LT", "LE": "LE", "GT": "LT", "GE": "LE"}
        i = 1 if direction.group(1) in ("LT", "LE") else 0
        if operands[i] in constants and direction.group(1) in flipped:
            return constants[operands[i]] + (flipped[direction.group(1)] == "LE")
    return None
