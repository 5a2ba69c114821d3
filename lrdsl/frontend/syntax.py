"""Spec text -> parse tree (lark, LALR) -> a small AST of frozen dataclasses with spans."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from fractions import Fraction
from importlib import resources

from lark import Lark, Token, Transformer, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken, VisitError

from lrdsl.errors import Span, SpecError
from lrdsl.frontend.primitives import NAMES

MAX_NESTING = 64
MAX_BYTES = 1 << 20
MAX_DEPTH = 200  # parse-tree levels (a long chain like a + b + c + ... nests one level per operator)
MAX_NUMBER_CHARS = 64
MAX_EXPONENT = 300


# ---- expression AST -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Num:
    value: Fraction
    span: Span


@dataclass(frozen=True)
class Var:
    name: str
    span: Span
    called: bool = field(default=False, compare=False)  # `name(...)`: a misspelt function, if unknown


@dataclass(frozen=True)
class Call:
    func: str
    args: tuple
    kwargs: tuple  # ((name, expr), ...)
    span: Span


@dataclass(frozen=True)
class BinOp:
    op: str  # add sub emul ediv matmul pow
    lhs: object
    rhs: object
    span: Span


@dataclass(frozen=True)
class Neg:
    x: object
    span: Span


@dataclass(frozen=True)
class Transpose:
    x: object
    span: Span


# ---- statements ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Range:
    lo: Fraction | None  # None is -inf
    hi: Fraction | None  # None is +inf
    lo_open: bool
    hi_open: bool
    span: Span


@dataclass(frozen=True)
class Decl:
    name: str
    shape: str | None  # "K", "V" or None for one number per head
    attrs: tuple  # ("unit", "l2norm", "log", "shared")
    range: Range | None
    span: Span


@dataclass(frozen=True)
class Inputs:
    decls: tuple
    span: Span


@dataclass(frozen=True)
class ParamDecl:
    name: str
    shape: tuple | None  # ("K", span) or None for one number per head
    range: Range | None
    init: tuple | None  # ("number", c) | ("uniform" | "log_uniform", lo, hi) | ("log" | "softplus_inv", init)
    span: Span


@dataclass(frozen=True)
class Params:
    decls: tuple
    span: Span


@dataclass(frozen=True)
class StateDecl:
    name: str
    shape: str
    expr: object
    span: Span


@dataclass(frozen=True)
class Let:
    name: str
    expr: object
    span: Span


@dataclass(frozen=True)
class Update:
    expr: object
    span: Span


@dataclass(frozen=True)
class Readout:
    expr: object
    span: Span


@dataclass(frozen=True)
class Allow:
    what: str
    span: Span


@dataclass(frozen=True)
class AxisDecay:
    kind: str
    expr: object | None
    span: Span


@dataclass(frozen=True)
class AxisGain:
    kind: str
    inputs: tuple  # ((name, Range|None, Span), ...)
    span: Span


@dataclass(frozen=True)
class AxisPrecond:
    kind: str
    site: str | None
    args: tuple
    kwargs: tuple
    span: Span


@dataclass(frozen=True)
class AxisSolve:
    kind: str
    lam: tuple | None  # (name, span) of the regulariser with `solve offline lamb`
    span: Span
    steps: tuple | None = None  # (text, span) of the conjugate-gradient steps with `... steps 30`


@dataclass(frozen=True)
class AxisNormalize:
    names: tuple
    span: Span


@dataclass(frozen=True)
class Spec:
    name: str
    statements: tuple
    span: Span


def _span(meta_or_token) -> Span:
    m = meta_or_token
    if isinstance(m, Token):
        return Span(m.line, m.column, m.end_line or m.line, m.end_column or m.column + len(m))
    if getattr(m, "empty", False):
        return Span(1, 1)
    return Span(m.line, m.column, m.end_line, m.end_column)


def _number(tok: Token) -> Fraction:
    text = str(tok)
    # Fraction("1e99999999") takes minutes and a long digit string overflows int(): refuse both
    mantissa, _, exponent = text.lower().partition("e")
    if len(text) > MAX_NUMBER_CHARS or (exponent and abs(int(exponent)) > MAX_EXPONENT):
        raise SpecError(f"the number {text[:20]}{'...' if len(text) > 20 else ''} is out of range; numbers "
                        f"have at most {MAX_NUMBER_CHARS} characters and exponents within "
                        f"+-{MAX_EXPONENT}", _span(tok))
    return Fraction(text)  # exact: 0.2 is 1/5, so printing and re-parsing is lossless


@v_args(meta=True)
class _ToAst(Transformer):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    # expressions
    def number(self, meta, c):
        return Num(_number(c[0]), _span(c[0]))

    def var(self, meta, c):
        return Var(str(c[0]), _span(c[0]), self.text[c[0].end_pos:].lstrip(" \t")[:1] == "(")

    def call(self, meta, c):
        args, kwargs = c[1]
        return Call(str(c[0]), args, kwargs, _span(meta))

    def arglist(self, meta, c):
        args = tuple(x for x in c if not (isinstance(x, tuple) and x and x[0] == "kw"))
        kwargs = tuple((x[1], x[2]) for x in c if isinstance(x, tuple) and x and x[0] == "kw")
        return args, kwargs

    def kwarg(self, meta, c):
        return ("kw", str(c[0]), c[1])

    def _binop(op):
        def f(self, meta, c):
            return BinOp(op, c[0], c[1], _span(meta))
        return f

    add, sub, emul, ediv = _binop("add"), _binop("sub"), _binop("emul"), _binop("ediv")
    matmul, pow = _binop("matmul"), _binop("pow")

    def neg(self, meta, c):
        return Neg(c[0], _span(meta))

    def transpose(self, meta, c):
        return Transpose(c[0], _span(meta))

    # ranges and declarations
    def bound(self, meta, c):
        return None if c[0].type == "INF" else _number(c[0])

    def neg_inf(self, meta, c):
        return "-inf"

    def range(self, meta, c):
        lb, lo, hi, rb = c
        if hi == "-inf":
            raise SpecError("a range cannot end at -inf", _span(meta))
        lo = None if lo == "-inf" else (lo if lo is not None else "+inf")
        if lo == "+inf":
            raise SpecError("a range cannot start at inf", _span(meta))
        return Range(lo, hi, str(lb) == "(", str(rb) == ")", _span(meta))

    def shape(self, meta, c):
        return (str(c[0]), _span(c[0]))

    def attribute(self, meta, c):
        return c[0]

    def decl(self, meta, c):
        name, rest = c[0], c[1:]
        shape = None
        if rest and isinstance(rest[0], tuple):
            shape = rest[0]
            rest = rest[1:]
        elif rest and rest[0] is None:
            rest = rest[1:]
        attrs = tuple(str(a) for a in rest if isinstance(a, Token))
        ranges = [r for r in rest if isinstance(r, Range)]
        if len(ranges) > 1:
            raise SpecError(f"input '{name}' has two ranges; keep one", ranges[1].span)
        return Decl(str(name), shape, attrs, ranges[0] if ranges else None, _span(meta))

    def input(self, meta, c):
        return Inputs(tuple(c), _span(meta))

    def param_decl(self, meta, c):
        name, shape, rng, init = c
        return ParamDecl(str(name), shape, rng, init, _span(meta))

    def param(self, meta, c):
        return Params(tuple(c), _span(meta))

    def init(self, meta, c):
        return c[0]

    def init_number(self, meta, c):
        return ("number", _number(c[0]))

    def init_dist(self, meta, c):
        return (str(c[0]), _number(c[1]), _number(c[2]))

    def init_call(self, meta, c):
        return (str(c[0]), c[1])

    def state(self, meta, c):
        return StateDecl(str(c[0]), c[1], c[2], _span(meta))

    def let(self, meta, c):
        return Let(str(c[0]), c[1], _span(meta))

    def update(self, meta, c):
        return Update(c[1], _span(meta))

    def readout(self, meta, c):
        return Readout(c[1], _span(meta))

    def allow(self, meta, c):
        return Allow(str(c[0]), _span(c[0]))

    # axis form
    def decay(self, meta, c):
        return AxisDecay(str(c[0]), c[1], _span(meta))

    def gain_input(self, meta, c):
        return (str(c[0]), c[1], _span(c[0]))

    def gain(self, meta, c):
        return AxisGain(str(c[0]), tuple(x for x in c[1:] if x is not None), _span(meta))

    def precond(self, meta, c):
        args, kwargs = c[2] if c[2] is not None else ((), ())
        site = str(c[1]) if c[1] is not None else None
        return AxisPrecond(str(c[0]), site, args, kwargs, _span(meta))

    def solve(self, meta, c):
        lam = (str(c[1]), _span(c[1])) if c[1] is not None else None
        steps = (str(c[2]), _span(c[2])) if c[2] is not None else None
        return AxisSolve(str(c[0]), lam, _span(meta), steps)

    def normalize(self, meta, c):
        return AxisNormalize(tuple((str(t), _span(t)) for t in c), _span(meta))

    def mixer(self, meta, c):
        return (str(c[0]), _span(c[0]))

    def start(self, meta, c):
        (name, span), stmts = c[0], tuple(c[1:])
        return Spec(name, stmts, span)


@functools.lru_cache(maxsize=1)
def _parser() -> Lark:
    text = resources.files("lrdsl.frontend").joinpath("lrdsl.lark").read_text()
    names = sorted((*NAMES, "diag"), key=lambda n: (-len(n), n))  # longest first: log1p before log
    text = text.replace("@FUNCTIONS@", "|".join(names))
    return Lark(text, parser="lalr", strict=True, propagate_positions=True, maybe_placeholders=True)


_READABLE = {
    "NAME": "a name", "NUMBER": "a number", "SIGNED_NUMBER": "a number", "_NL": "the end of the line",
    "$END": "the end of the spec", "LPAR": "'('", "RPAR": "')'", "LSQB": "'['", "RSQB": "']'",
    "COMMA": "','", "EQUAL": "'='", "PLUS": "'+'", "MINUS": "'-'", "STAR": "'*'", "SLASH": "'/'",
    "CIRCUMFLEX": "'^'", "TRANSPOSE": "'^T'", "FUNC": "a function such as exp(...)",
    "STATE": "'S'", "OUT": "'o'", "ATTR": "an attribute (unit, l2norm, log, shared)",
    "LBOUND": "'(' or '['", "RBOUND": "')' or ']'", "INF": "'inf'",
    "DECAY_KIND": "none, constant, scalar or diagonal", "GAIN_KIND": "none, scalar or channelwise",
    "PRECOND_KIND": "none or diagonal", "PRECOND_SITE": "atk or atq", "SOLVE_KIND": "online or offline",
    "INIT_DIST": "uniform or log_uniform", "INIT_FN": "log or softplus_inv",
}


def _readable(names) -> str:
    out = []
    for n in sorted(names):
        r = _READABLE.get(n)
        if r is None:
            term = _parser().get_terminal(n) if n in {t.name for t in _parser().terminals} else None
            r = f"'{term.pattern.value}'" if term is not None and term.pattern.type == "str" else n.lower()
        if r not in out:
            out.append(r)
    if len(out) > 6:
        out = out[:6] + ["..."]
    return ", ".join(out)


def _describe(tok: Token) -> str:
    if tok.type == "$END":
        return "the end of the spec"
    if tok.type == "_NL":
        return "the end of the line"
    return f"'{tok}'"


def _preflight(text) -> str:
    if isinstance(text, (bytes, bytearray)):
        if len(text) > MAX_BYTES:
            raise SpecError(f"the spec is {len(text)} bytes; specs are at most {MAX_BYTES} bytes")
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as e:
            before = bytes(text[:e.start]).decode("utf-8", "replace")
            line = before.count("\n") + 1
            col = e.start - (bytes(text[:e.start]).rfind(b"\n") + 1) + 1
            raise SpecError(f"the spec is not UTF-8 text (byte 0x{text[e.start]:02x}); save it as UTF-8 text",
                            Span(line, col)) from None
    if len(text) > MAX_BYTES:
        raise SpecError(f"the spec has {len(text)} characters; specs are at most {MAX_BYTES}")
    text = text.removeprefix("\ufeff")  # a UTF-8 byte-order mark some editors write
    if not text.strip():
        raise SpecError("the spec is empty; it starts with a line `mixer NAME`", Span(1, 1))
    if not any(line.split("#", 1)[0].strip() for line in text.splitlines()):
        raise SpecError("the spec has only comments; it starts with a line `mixer NAME`", Span(1, 1))
    line, col, depth = 1, 0, 0
    for ch in text:
        col += 1
        if ch == "\n":
            line, col = line + 1, 0
        elif ch == "\x00" or (ord(ch) < 32 and ch not in "\t\r\f"):
            raise SpecError(f"control character U+{ord(ch):04X} in the spec; specs are plain text",
                            Span(line, col))
        elif ch in "([":
            depth += 1
            if depth > MAX_NESTING:
                raise SpecError(f"brackets nest deeper than {MAX_NESTING} levels; simplify the expression",
                                Span(line, col))
        elif ch in ")]":
            depth = max(0, depth - 1)
    return text


def parse(text, filename: str = "<spec>") -> Spec:
    """Parse spec text (str or bytes) into the AST. Raises SpecError with the place of the problem."""
    try:
        text = _preflight(text)
        try:
            tree = _parser().parse(text)
        except UnexpectedInput as e:
            raise _syntax_error(e, text) from None
        _check_depth(tree)
        try:
            return _ToAst(text).transform(tree)
        except VisitError as e:
            if isinstance(e.orig_exc, SpecError):
                raise e.orig_exc from None
            raise
    except SpecError as e:
        raise e.located(text if isinstance(text, str) else "", filename) from None


def _check_depth(tree) -> None:
    """Transforming and lowering recurse over the tree: refuse a tree too deep for Python's stack."""
    stack = [(c, 2, c) for c in tree.children if hasattr(c, "children")]  # (node, depth, its statement)
    while stack:
        node, depth, statement = stack.pop()
        if depth > MAX_DEPTH:
            raise SpecError(f"this expression is too long: it nests more than {MAX_DEPTH} levels deep; "
                            "split it with `let`", _span(statement.meta))
        stack.extend((c, depth + 1, statement) for c in node.children if hasattr(c, "children"))


def _syntax_error(e: UnexpectedInput, text: str) -> SpecError:
    span = Span(e.line, e.column) if e.line and e.line > 0 else Span(1, 1)
    if isinstance(e, UnexpectedCharacters):
        ch = text[e.pos_in_stream] if e.pos_in_stream < len(text) else ""
        msg = f"unexpected character {ch!r}"
        if ch in "{}@$!?;:&|<>~`\"'\\":
            msg += f"; the spec language has no {ch!r}"
        exp = _readable(e.allowed) if e.allowed else ""
        return SpecError(msg + (f"; expected {exp}" if exp else ""), span)
    if isinstance(e, UnexpectedEOF):
        return SpecError(f"the spec ends early; expected {_readable(e.expected)}", _end_span(text))
    assert isinstance(e, UnexpectedToken)
    tok = e.token
    if tok.type == "$END":
        span = _end_span(text)
    first = tok.line == 1 or not text[: max(0, e.token.start_pos or 0)].strip()
    if first and "MIXER" in e.expected:
        return SpecError(f"a spec starts with a line `mixer NAME`, found {_describe(tok)}", span)
    if tok.type == "NAME" and tok.column == 1:
        return SpecError(f"unknown statement {_describe(tok)}; statements are input, param, state, let, "
                         f"S = ..., o = ..., allow, or the axes decay, gain, precond, solve, normalize", span)
    if tok.type in ("$END", "_NL"):
        what = "spec" if tok.type == "$END" else "line"
        return SpecError(f"the {what} ends early; expected {_readable(e.expected)}", span)
    return SpecError(f"unexpected {_describe(tok)}; expected {_readable(e.expected)}", span)


def _end_span(text: str) -> Span:
    lines = text.rstrip("\n").split("\n")
    return Span(len(lines), len(lines[-1]) + 1)
