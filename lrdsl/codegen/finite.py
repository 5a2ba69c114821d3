"""The staged backward's loads of the spec's inputs made finite (issues 39 and 43).

runtime/nonfinite.py's device mode ran every backward on finite copies of the inputs. Here each
load of an input in a backward kernel (and in the forward helpers those kernels call, through a
twin of each) puts the copy's fill value in place of the entries the copy replaced, so the kernels
read the inputs themselves: `_finite_input(tl.load(in_x ...), fill, POS, NEG)`, with input x's fill and
which infinities are bad decided here from the spec (nonfinite.load_rule). The forward's functions
keep their bytes: the backward calls `<helper>_finite`, a copy of the helper with its loads so
wrapped. A module whose backward reaches an input through anything but a plain `tl.load(in_x ...)`
(a pointer moved first, say) is left as it was and runs on the copies (FINITE_LOADS False).
"""
from __future__ import annotations

import re

from lrdsl.frontend import ir
from lrdsl.runtime import nonfinite

_DEF = re.compile(r"^@triton\.jit\ndef (\w+)\(", re.M)
_TOP = re.compile(r"^(?=[@A-Za-z_#])", re.M)  # a line that starts a new top-level statement

HELPER = '''@triton.jit
def _finite_input(x, fill, POS: tl.constexpr, NEG: tl.constexpr):
    # x with fill where the backward's finite copy of its input had it (runtime/nonfinite.py): every
    # nan, +inf with POS, -inf with NEG; in x's own dtype, as the copy stored it
    bad = x != x
    if POS:
        bad = bad | (x == float("inf"))
    if NEG:
        bad = bad | (x == float("-inf"))
    return tl.where(bad, fill, x).to(x.dtype)


FINITE_LOADS = True  # the staged backward reads the inputs themselves (codegen/finite.py)


'''


def rules(m: ir.Mixer) -> dict:
    """Input or param name -> the `_finite` call's arguments after the tile (fill, POS, NEG)."""
    rs = nonfinite.resets(m)
    out = {}
    for i in (*m.inputs, *m.params):
        fill, pos, neg = nonfinite.load_rule(i, i.name in rs)
        out[i.name] = f"{fill!r}, {pos}, {neg}"
    return out


def _blocks(text: str) -> dict:
    """name -> (start, end) of every @triton.jit function of the module text."""
    out = {}
    for mt in _DEF.finditer(text):
        body = mt.end()
        nxt = _TOP.search(text, text.index("\n", body) + 1)  # (a signature's "):" is not one)
        out[mt.group(1)] = (mt.start(), nxt.start() if nxt is not None else len(text))
    return out


def _close(text: str, i: int) -> int:
    """The index just past the parenthesis that closes the one at text[i]."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "(":
            depth += 1
        elif text[j] == ")":
            depth -= 1
            if depth == 0:
                return j + 1
    raise ValueError("unbalanced parentheses in generated code")


class Unsupported(ValueError):
    """The backward reads an input some other way than a plain load: the module keeps the copies."""


def _wrap_loads(body: str, ptrs: dict) -> str:
    """body with every tl.load of an input pointer (ptrs: pointer -> _finite's arguments) wrapped."""
    out, pos = [], 0
    for mt in re.finditer(r"tl\.load\(", body):
        if mt.start() < pos:
            continue
        arg = re.match(r"\s*(\w+)", body[mt.end():])
        if arg is None or arg.group(1) not in ptrs:
            continue
        end = _close(body, mt.end() - 1)
        out += [body[pos:mt.start()], "_finite_input(", body[mt.start():end], ", ", ptrs[arg.group(1)], ")"]
        pos = end
    out.append(body[pos:])
    return "".join(out)


def sanitise(text: str, backward: set, ptrs: dict) -> str:
    """The module text with the loads of the functions named in `backward` (and of twins of the
    other functions they reach that load an input) wrapped in _finite. ptrs: each input pointer's
    name (in_<input>, and the raw operands' own pointer names) -> _finite's arguments after the
    tile. Raises Unsupported where a reached function uses an input pointer other than as a load's
    address or an argument passed on."""
    blocks = _blocks(text)
    src = {n: text[a:b] for n, (a, b) in blocks.items()}
    calls = {n: {c for c in blocks if c != n and re.search(rf"\b{c}\(", s)} for n, s in src.items()}
    direct = {n for n, s in src.items() if any(re.search(rf"tl\.load\(\s*{p}\b", s) for p in ptrs)}
    loaders = set(direct)
    while True:
        more = {n for n in blocks if calls[n] & loaders} - loaders
        if not more:
            break
        loaders |= more
    live = [n for n in blocks if n in backward]
    twins, todo = set(), [c for n in live for c in calls[n]]
    while todo:
        c = todo.pop()
        if c in loaders and c not in backward and c not in twins:
            twins.add(c)
            todo += calls[c]
    if not twins and not any(n in loaders for n in live):
        return text
    pattern = re.compile(r"\b(" + "|".join(sorted(twins, key=len, reverse=True)) + r")\(") if twins else None

    def convert(name):
        body = _wrap_loads(src[name], ptrs)
        if pattern is not None:
            body = pattern.sub(r"\1_finite(", body)
        for p in ptrs:  # what is left of an input pointer: a name passed on whole, or moved in place
            for mt in re.finditer(rf"\b{p}\b", body):
                after = body[mt.end():].lstrip(" ")
                if not after.startswith((",", ")", ":", "+=")) and not body[:mt.start()].endswith("tl.load("):
                    raise Unsupported(f"{name} reads {p} through `{body[mt.start():mt.start() + 40]}`")
        return body
    new = {n: convert(n) for n in blocks if n in backward or n in twins}
    first = min(blocks[n][0] for n in live)
    twin_text = "".join(new[n] for n in blocks if n in twins)
    out = [text[:first], HELPER, twin_text]
    pos = first
    for n in sorted(live, key=lambda n: blocks[n][0]):
        a, b = blocks[n]
        out += [text[pos:a], new[n]]
        pos = b
    out.append(text[pos:])
    return "".join(out)
