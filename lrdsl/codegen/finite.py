"""The staged backward's loads of the spec's inputs made finite (issues 39 and 43).

runtime/nonfinite.py's device mode ran every backward on finite copies of the inputs. Here each
load of an input in a backward kernel (and in the forward functions those kernels call, and in the
forward kernels the backward launches again to make the forward's stages, through a twin of each)
puts the copy's value in place of the entries the copy replaced, so the kernels read the inputs
themselves: `x = tl.load(in_x ...)` then `x = _finite_input(x, in_x, fill, POS, NEG)`, input x's fill
and which infinities are bad decided here from the spec (fills.load_rule). The forward's
functions keep their bytes: the backward calls `<name>_finite`, a copy with its loads so made, and
_staged_states_finite launches the twins. A rewrite of the rendered text (a decision per load in
Python, no template changed): a module whose backward reaches an input other than through a load of
its pointer (or of a pointer made from it) is left as it was and runs on the copies (no FINITE_LOADS).
"""
from __future__ import annotations

import re

from lrdsl.codegen import fills
from lrdsl.frontend import ir

_DEF = re.compile(r"^@triton\.jit(?:\(.*\))?\ndef (\w+)\(", re.M)
_TOP = re.compile(r"^(?=[@A-Za-z_#])", re.M)  # a line that starts a new top-level statement

HELPER = '''@triton.jit
def _finite_input(x, ptr, fill, POS: tl.constexpr, NEG: tl.constexpr):
    # x, loaded from ptr's input, with fill where the backward's finite copy of that input had it
    # (runtime/nonfinite.py): every nan, +inf with POS, -inf with NEG; fill rounded to the input's
    # dtype, as the copy stored it (one comparison each: false at nan too)
    if POS and NEG:
        good = tl.abs(x) < float("inf")
    elif POS:
        good = x < float("inf")
    elif NEG:
        good = x > float("-inf")
    else:
        good = x == x
    return tl.where(good, x, tl.full([], fill, ptr.dtype.element_ty).to(x.dtype))


FINITE_LOADS = True  # the staged backward reads the inputs themselves (codegen/finite.py)


'''


def rules(m: ir.Mixer) -> dict:
    """Input or param name -> _finite_input's arguments after the pointer (fill, POS, NEG) as text."""
    rs = fills.resets(m)
    out = {}
    for i in (*m.inputs, *m.params):
        fill, pos, neg = fills.load_rule(i, i.name in rs)
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


def _aliases(body: str, ptrs: dict) -> dict:
    """ptrs and the pointers that a function makes from one of them (`p_z = in_v + ...`): the
    same arguments (the staged forward's WY stage moves its value pointer so)."""
    out = dict(ptrs)
    for mt in re.finditer(r"^\s*(\w+) = (\w+) \+", body, re.M):
        if mt.group(2) in ptrs:
            out[mt.group(1)] = ptrs[mt.group(2)]
    return out


_WHOLE = re.compile(r"(\.to\([\w.]*\))?(\[[^\]]*\])?\s*$")  # what may follow a load that is a whole statement


def _wrap_loads(body: str, ptrs: dict) -> str:
    """body with every tl.load of an input pointer (ptrs: pointer -> _finite_input's arguments
    after the pointer) made finite: `x = tl.load(p ...).to(...)[...]` becomes `x = tl.load(p ...)`
    and `x = _finite_input(x, p, ...).to(...)[...]`; a load inside an expression is wrapped in place."""
    out, pos = [], 0
    for mt in re.finditer(r"tl\.load\(", body):
        if mt.start() < pos:
            continue
        arg = re.match(r"\s*(\w+)", body[mt.end():])
        if arg is None or arg.group(1) not in ptrs:
            continue
        p, end = arg.group(1), _close(body, mt.end() - 1)
        line_start = body.rfind("\n", 0, mt.start()) + 1
        line_end = body.find("\n", end)
        line_end = len(body) if line_end < 0 else line_end
        lead = re.match(r"(\s*)(\w+) = $", body[line_start:mt.start()])
        if lead and _WHOLE.match(body[end:line_end]):  # in the input's dtype, then converted
            indent, var = lead.groups()
            out += [body[pos:end], f"\n{indent}{var} = _finite_input({var}, {p}, {ptrs[p]}){body[end:line_end].rstrip()}"]
            pos = line_end
        else:
            out += [body[pos:mt.start()], "_finite_input(", body[mt.start():end], f", {p}, {ptrs[p]})"]
            pos = end
    out.append(body[pos:])
    return "".join(out)


_TUNED = re.compile(r"^(\w+) = triton\.autotune\((.*)\)\((\w+)\)$", re.M)
HOST = "_staged_states"  # the host function whose stages the backward makes again


def _host(text: str) -> tuple:
    """(start, end) of the host function HOST in the module text, or None."""
    mt = re.search(rf"^def {HOST}\(", text, re.M)
    if mt is None:
        return None
    nxt = _TOP.search(text, text.index("\n", mt.end()) + 1)
    return mt.start(), nxt.start() if nxt is not None else len(text)


def sanitise(text: str, backward: set, ptrs: dict) -> str:
    """The module text with the loads of the functions named in `backward` (and of twins of the
    other functions they reach that load an input) wrapped in _finite_input, and a twin of HOST
    (`_staged_states_finite`) that launches twins of the kernels it launches (with twins of their
    autotuned wrappers). ptrs: each input pointer's name (in_<input>, and the raw operands' own
    pointer names) -> _finite_input's arguments after the tile. Raises Unsupported where a reached
    function uses an input pointer other than as a load's address, an argument passed on, a pointer
    moved in place or the start of another pointer, and where there is no HOST."""
    blocks = _blocks(text)
    host = _host(text)
    wrappers = _TUNED.findall(text)
    tuned = {w: k for w, _, k in wrappers}
    launched = set(re.findall(r"\b(\w+)\[", text[host[0]:host[1]])) if host else set()
    roots = {tuned.get(x, x) for x in launched} & set(blocks)
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
    twins, todo = set(), [c for n in live for c in calls[n]] + sorted(roots)
    while todo:
        c = todo.pop()
        if c in loaders and c not in backward and c not in twins:
            twins.add(c)
            todo += calls[c]
    if host is None or not (twins or any(n in loaders for n in live)):
        raise Unsupported("no staged backward that reads an input")
    pattern = re.compile(r"\b(" + "|".join(sorted(twins, key=len, reverse=True)) + r")\(") if twins else None

    def convert(name):
        local = _aliases(src[name], ptrs)
        body = _wrap_loads(src[name], local)
        if pattern is not None:
            body = pattern.sub(r"\1_finite(", body)
        for p in local:  # what else reads an input pointer: passed on whole, moved in place, aliased
            for mt in re.finditer(rf"\b{p}\b", body):
                after = body[mt.end():].lstrip(" ")
                alias = re.search(r"^\s*\w+ = $", body[body.rfind("\n", 0, mt.start()) + 1:mt.start()])
                if not (after.startswith((",", ")", ":", "+=")) or body[:mt.start()].endswith("tl.load(")
                        or (alias and after.startswith("+")) or (p not in ptrs and after.startswith("= "))):
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
    return "".join(out) + _host_twin(text[host[0]:host[1]], wrappers, twins)


def _host_twin(host: str, wrappers: list, twins: set) -> str:
    """The autotuned wrappers (wrappers: (name, autotune's arguments, kernel) each) of the twinned
    kernels and HOST's twin, which launches them."""
    lines = [f"{w}_finite = triton.autotune({args})({k}_finite)" for w, args, k in wrappers if k in twins]
    names = {w for w, _, k in wrappers if k in twins} | twins
    body = re.sub(rf"^def {HOST}\(", f"def {HOST}_finite(", host, flags=re.M)
    if names:
        body = re.sub(r"\b(" + "|".join(sorted(names, key=len, reverse=True)) + r")\[", r"\1_finite[", body)
    return ("\n\n# the backward's twins of the autotuned kernels above and of _staged_states: the same\n"
            "# stages, their loads of the inputs made finite (codegen/finite.py)\n"
            + "\n".join(lines) + "\n\n\n" + body.rstrip("\n") + "\n")
