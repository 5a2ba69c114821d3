"""Malformed specs: every one is refused with a one-line SpecError `file:line:col: error: message`
that points at the offending place and names the problem, through the API and through the CLI
(exit code 1, the same first line on stderr, never a traceback)."""
from __future__ import annotations

import contextlib
import io
import keyword
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import lrdsl

ROOT = Path(__file__).resolve().parent.parent
HEAD = ["mixer m", "input q[K], k[K], v[V]"]
MIXER_NAME = (1, len("mixer ") + 1)  # where a spec-wide problem (a missing statement) is reported


def at(lines, line, needle, nth=1):
    """(line, column) of the nth occurrence of `needle` on 1-based `line`, columns 1-based."""
    text = lines[line - 1]
    col = -1
    for _ in range(nth):
        col = text.index(needle, col + 1)
    return line, col + 1


def spec(*lines):
    return "\n".join(lines) + "\n"


# id -> (spec text or bytes, (line, column), words the message must contain)
CASES = {}
# cases that only repeat a code path of another case skip the CLI run (each one costs a Python start-up)
API_ONLY = {"axis_twice", "unclosed_parenthesis", "normalize_other", "reversed_range", "log_with_range",
            "shape_mismatch_write", "readout_of_v", "value_decay_scalar", "update_forgets_S",
            "update_without_write", "update_twice", "q_not_a_vector", "latin1_comment", "reserved_h",
            "inject_apostrophe", "inject_semicolon", "inject_keyword_mixer", "inject_dunder_mixer",
            "inject_dunder_use", "inject_backslash", "imaginary_constant", "huge_number",
            "misspelt_function_spaced", "unknown_name_applied", "unstable_not_through_the_let"}


def case(name, text, where, *words):
    assert name not in CASES
    CASES[name] = (text, where, words)


# -- bytes and size
case("binary_garbage", b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe", (1, 1), "UTF-8", "0x89")
case("empty_file", "", (1, 1), "empty", "mixer NAME")
case("only_comments", "# a spec\n   # with nothing in it\n\n", (1, 1), "only comments", "mixer NAME")
L = [*HEAD, "S = " + "(" * 10000 + "S" + ")" * 10000 + " + k v^T", "o = S^T q"]
case("deep_parentheses", spec(*L), (3, len("S = ") + 65), "nest deeper than 64")
L = [*HEAD, "S = (" + " + ".join(["1"] * 1500) + ") S + k v^T", "o = S^T q"]
case("very_long_expression", spec(*L), (3, 1), "too long", "let")
case("nul_byte", b"mixer m\ninput q[K],\x00 k[K], v[V]\n", (2, 12), "control character", "U+0000")
case("non_utf8", b"mixer m\ninput q[K], k\xff[K], v[V]\n", (2, 14), "not UTF-8", "0xff")
case("latin1_comment", "mixer m  # caf\xe9\n".encode("latin-1"), (1, 15), "not UTF-8", "0xe9")

# -- names
L = [*HEAD, "S = S + kk v^T", "o = S^T q"]
case("unknown_name", spec(*L), at(L, 3, "kk"), "unknown name 'kk'", "did you mean 'k'")
L = [*HEAD, "let m = exp(zz)", "S = S + k v^T", "o = S^T q"]
case("let_undefined_name", spec(*L), at(L, 3, "zz"), "unknown name 'zz'", "input zz")
L = [*HEAD, "input b", "let beta = sigmod(b)", "S = (I - beta k k^T) S + beta k v^T", "o = S^T q"]
case("misspelt_function", spec(*L), at(L, 4, "sigmod"), "unknown function 'sigmod'", "did you mean sigmoid(...)")
L = [*HEAD, "input a", "let g = -softplu (a)", "S = exp(g) S + k v^T", "o = S^T q"]
case("misspelt_function_spaced", spec(*L), at(L, 4, "softplu"), "unknown function 'softplu'", "softplus(...)")
L = [*HEAD, "input b", "let beta = zz(b)", "S = S + beta k v^T", "o = S^T q"]
case("unknown_name_applied", spec(*L), at(L, 4, "zz"), "unknown name 'zz'", "input zz")
L = ["mixer m", "input q[K], k[K], v[V], q[K]", "S = S + k v^T", "o = S^T q"]
case("duplicate_input", spec(*L), at(L, 2, "q[K]", 2), "'q'", "already defined", "line 2")
for nm, word in (("S", "S"), ("lambda", "lambda"), ("__class__", "__class__"), ("exp", "exp"), ("h", "h")):
    L = ["mixer m", f"input q[K], k[K], v[V], {nm}", "S = S + k v^T", "o = S^T q"]
    case(f"reserved_{nm.strip('_')}", spec(*L), (2, len("input q[K], k[K], v[V], ") + 1), f"'{word}'", "reserved")

# -- structure
L = ["mixer m", "foo bar"]
case("unknown_statement", spec(*L), (2, 1), "unknown statement 'foo'")
L = [*HEAD, "S = S + k v^T"]
case("missing_readout", spec(*L), MIXER_NAME, "no readout", "o = S^T q")
L = [*HEAD, "o = S^T q"]
case("missing_update", spec(*L), MIXER_NAME, "no update")
L = ["mixer m", "input q[K], k[K]", "S = S + k k^T", "o = S^T q"]
case("missing_v", spec(*L), MIXER_NAME, "input v[V]")
L = ["mixer m", "input q, k[K], v[V]", "S = S + k v^T", "o = S^T q"]
case("q_not_a_vector", spec(*L), at(L, 2, "q"), "input q[K]")
L = [*HEAD, "S = S + k v^T", "S = S + k v^T", "o = S^T q"]
case("update_twice", spec(*L), (4, 1), "updated twice")
L = ["mixer m", "decay none", "input q[K], k[K], v[V]", "S = S + k v^T", "o = S^T q"]
case("mixed_axis_explicit", spec(*L), (4, 1), "mixes the axis form")  # inputs may stand beside axes
L = ["mixer m", "decay none", "gain none", "solve offline"]
case("solve_offline", spec(*L), (4, 1), "offline", "solve online")
L = ["mixer m", "decay scalar", "gain none"]
case("decay_scalar_without_name", spec(*L), (2, 1), "decay scalar", "log-decay input")
L = ["mixer m", "decay diagonal g", "decay none"]
case("axis_twice", spec(*L), (3, 1), "decay axis is given twice")
L = [*HEAD, "S = S + k v^T", "o = S^T q", "allow everything"]
case("unknown_allowance", spec(*L), at(L, 5, "everything"), "unknown allowance 'everything'", "allow unstable")
L = [*HEAD, "S = (S + k v^T", "o = S^T q"]
case("unclosed_parenthesis", spec(*L), (3, len(L[2]) + 1), "ends early", "')'")
L = ["mixer m", "normalize g"]
case("normalize_other", spec(*L), at(L, 2, "g"), "normalize", "'g'")

# -- ranges
L = ["mixer m", "input q[K], k[K], v[V], beta in (1, 1)", "S = S + k v^T", "o = S^T q"]
case("empty_range", spec(*L), at(L, 2, "in ("), "range of 'beta' is empty")
L = ["mixer m", "input q[K], k[K], v[V], beta in [2, 1]", "S = S + k v^T", "o = S^T q"]
case("reversed_range", spec(*L), at(L, 2, "in ["), "range of 'beta' is empty")
L = ["mixer m", "input q[K], k[K], v[V], g log in (0, 1)", "S = exp(g) S + k v^T", "o = S^T q"]
case("log_with_range", spec(*L), at(L, 2, "in ("), "log-decay", "either")

# -- shapes and forms
L = [*HEAD, "S = (I - k v^T) S + k v^T", "o = S^T q"]
case("shape_mismatch_erase", spec(*L), at(L, 3, "I - k"), "cannot subtract", "[K, V]", "[K, K]")
L = [*HEAD, "S = S + v k^T", "o = S^T q"]
case("shape_mismatch_write", spec(*L), at(L, 3, "v k^T"), "shape mismatch", "[V, K]")
L = [*HEAD, "S = S + k v^T", "o = S^T v"]
case("readout_of_v", spec(*L), at(L, 4, "S^T"), "shape mismatch", "[K] vector")
L = [*HEAD, "S = (k k^T) (k k^T) S + k v^T", "o = S^T q"]
case("outer_times_outer", spec(*L), at(L, 3, "(k k^T) (k"), "two outer products", "dot product")
L = ["mixer m", "input q[K], k[K], v[V], a[K]", "S = (I - k k^T - a a^T) S + k v^T", "o = S^T q"]
case("rank2_transition", spec(*L), (3, 1), "2 independent rank-1 terms")
L = [*HEAD, "S = (k^T q) S + k v^T", "o = S^T q"]
case("dot_product", spec(*L), at(L, 3, "(k^T q)"), "dot product")
L = ["mixer m", "input q[K], k[K], v[V], g[V] log", "S = diag(exp(g)) S + k v^T", "o = S^T q"]
case("value_decay_diag", spec(*L), at(L, 3, "diag"), "[V, V] matrix", "from the left", "S diag(exp(gv))")
L = ["mixer m", "input q[K], k[K], v[V], g[V] log", "S = exp(g) S + k v^T", "o = S^T q"]
case("value_decay_scalar", spec(*L), at(L, 3, "exp"), "[V] vector times S")
L = [*HEAD, "state P[K] = P * P + k * k", "S = S + k v^T", "o = S^T q"]
case("aux_not_first_order", spec(*L), (3, 1), "first order", "P")
L = [*HEAD, "S = k v^T", "o = S^T q"]
case("update_forgets_S", spec(*L), (3, 1), "forgets S")
L = [*HEAD, "S = S", "o = S^T q"]
case("update_without_write", spec(*L), (3, 1), "no write term")

# -- constants
L = [*HEAD, "S = (1/0) S + k v^T", "o = S^T q"]
case("division_by_zero", spec(*L), at(L, 3, "1/0"), "division by zero")
L = [*HEAD, "S = sqrt(-1) S + k v^T", "o = S^T q"]
case("imaginary_constant", spec(*L), at(L, 3, "sqrt"), "not a finite real number")
L = [*HEAD, "S = 2^1000000 S + k v^T", "o = S^T q"]
case("huge_power", spec(*L), at(L, 3, "2^"), "exponent", "too large")
L = [*HEAD, "S = 1e99999999 S + k v^T", "o = S^T q"]
case("huge_number", spec(*L), at(L, 3, "1e9"), "out of range")

# -- stability (the checker)
L = ["mixer m", "decay none", "gain scalar beta in (0, 3)", "normalize q, k"]
case("unstable_axis", spec(*L), (3, 1), "eigenvalues", "outside [-1, 1]", "allow unstable")
L = ["mixer m", "input q[K] l2norm, k[K] l2norm, v[V], beta in (0, 3)", "S = (I - beta k k^T) S + beta k v^T",
     "o = S^T q"]
case("unstable_explicit", spec(*L), (3, 1), "eigenvalues", "beta", "allow unstable")
# found through a let: the error points at the let the blamed part reads, not the mixer or update line
L = ["mixer m", "input a", "let g = softplus(a)", "decay diagonal g"]
case("unstable_decay_let", spec(*L), (3, 1), "eigenvalues", "decay exp(softplus(a))", "range of a")
L = ["mixer m", "input a in (0, 1), b in (0, 1)", "let z = -a", "let beta = 3 * b", "decay scalar z",
     "gain scalar beta", "normalize q, k"]  # the erase is too strong, not the decay (read through z)
case("unstable_erase_let", spec(*L), (4, 1), "eigenvalues", "3*b ranges over [0, 3]", "range of b")
L = ["mixer m", "input a in (0, 1), c", "let u = sigmoid(c)", "decay diagonal a"]  # u is read by no transition
case("unstable_not_through_the_let", spec(*L), MIXER_NAME, "eigenvalues", "decay exp(a)", "range of a")

# -- names that try to reach generated code
L = ["mixer m", 'input q[K], k[K], v[V], "x"']
case("inject_quote", spec(*L), at(L, 2, '"'), "unexpected character", '\'"\'')
L = ["mixer m", "input q[K], k[K], v[V], x'"]
case("inject_apostrophe", spec(*L), at(L, 2, "'"), "unexpected character")
L = ["mixer m; import os"]
case("inject_semicolon", spec(*L), at(L, 1, ";"), "unexpected character ';'")
L = ["mixer m", "input q[K], k[K], v[V], be", "ta"]
case("inject_newline", spec(*L), (3, 1), "unknown statement 'ta'")
L = [*HEAD, "let __import__ = k", "S = S + k v^T", "o = S^T q"]
case("inject_dunder_let", spec(*L), (3, 1), "'__import__'", "reserved")
L = [*HEAD, "state class[K] = class + k", "S = S + k v^T", "o = S^T q"]
case("inject_keyword_state", spec(*L), (3, 1), "'class'", "reserved")
L = ["mixer import", *HEAD[1:], "S = S + k v^T", "o = S^T q"]
case("inject_keyword_mixer", spec(*L), at(L, 1, "import"), "'import'", "reserved", "mixer name")
L = ["mixer __init__"]
case("inject_dunder_mixer", spec(*L), at(L, 1, "__init__"), "'__init__'", "reserved")
L = [*HEAD, "S = S + k v^T", "o = S^T q", "let x = __builtins__"]
case("inject_dunder_use", spec(*L), at(L, 5, "__builtins__"), "unknown name '__builtins__'")
L = ["mixer m", "input q[K], k[K], v[V], x\\", "S = S + k v^T"]
case("inject_backslash", spec(*L), at(L, 2, "\\"), "unexpected character")


CLI_CASES = {k: v for k, v in CASES.items() if k not in API_ONLY}


def message(err: str) -> str:
    return err.split(": error: ", 1)[1]


@pytest.mark.parametrize("name", sorted(CASES))
def test_api_error(name):
    text, (line, col), words = CASES[name]
    with pytest.raises(lrdsl.SpecError) as e:
        lrdsl.compile(text=text)
    s = str(e.value)
    assert "\n" not in s and "\r" not in s
    assert s.startswith(f"<spec>:{line}:{col}: error: "), s
    msg = message(s).lower()
    for w in words:
        assert w.lower() in msg, (w, s)
    assert (e.value.span.line, e.value.span.column) == (line, col)


def test_there_are_many_distinct_cases():
    assert len(CASES) >= 25 and len(set(CASES) - API_ONLY) >= 25
    assert API_ONLY <= set(CASES)
    texts = [t if isinstance(t, bytes) else t.encode() for t, _, _ in CASES.values()]
    assert len(set(texts)) == len(texts)


# Every CLI case runs `lrdsl check FILE` through cli.main in this process (test_cli_error); a real
# `python -m lrdsl.cli` process (exit code, stderr) costs a Python start-up each, so pytest -q starts
# one for these cases (bytes that are not a spec, a caret, a checker's refusal) and -m slow for all.
SUBPROCESS_DEFAULT = ("binary_garbage", "unknown_name", "unstable_axis")


def write_specs(folder) -> dict:
    paths = {}
    for name, (text, _, _) in CLI_CASES.items():
        p = folder / f"{name}.lr"
        p.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
        paths[name] = p
    return paths


@pytest.fixture(scope="module")
def spec_files(tmp_path_factory):
    return write_specs(tmp_path_factory.mktemp("specs"))


@pytest.fixture(scope="module")
def cli_results(spec_files, request):
    """Run `python -m lrdsl.cli check FILE` for every case this session runs, a few at a time."""
    wanted = {item.callspec.params["name"] for item in request.session.items
              if getattr(item, "originalname", "") == "test_cli_subprocess_error"}
    wanted.add("unknown_name")  # test_cli_context_has_a_caret

    def run(name):
        r = subprocess.run([sys.executable, "-m", "lrdsl.cli", "check", str(spec_files[name])], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
        return name, (str(spec_files[name]), r.returncode, r.stdout, r.stderr)

    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as ex:
        return dict(ex.map(run, sorted(wanted)))


def in_process(path) -> tuple:
    """cli.main(["check", path]) in this process: (path, exit code, stdout, stderr)."""
    from lrdsl import cli
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(["check", str(path)])
    return str(path), rc, out.getvalue(), err.getvalue()


def check_cli_result(name, result):
    text, (line, col), words = CASES[name]
    path, rc, out, err = result
    assert "Traceback" not in err and "Traceback" not in out
    assert rc == 1, (rc, err)
    first = err.splitlines()[0]
    assert first.startswith(f"{path}:{line}:{col}: error: "), first
    for w in words:
        assert w.lower() in message(first).lower(), (w, first)
    with pytest.raises(lrdsl.SpecError) as e:
        lrdsl.compile(text=text)
    assert first == str(e.value).replace("<spec>", path, 1)  # the CLI says what the API says


@pytest.mark.parametrize("name", sorted(CLI_CASES))
def test_cli_error(spec_files, name):
    check_cli_result(name, in_process(spec_files[name]))


@pytest.mark.parametrize("name", [n if n in SUBPROCESS_DEFAULT else pytest.param(n, marks=pytest.mark.slow)
                                  for n in sorted(CLI_CASES)])
def test_cli_subprocess_error(cli_results, name):
    check_cli_result(name, cli_results[name])


def test_cli_context_has_a_caret(cli_results):
    path, rc, out, err = cli_results["unknown_name"]
    lines = err.splitlines()
    assert lines[1].strip() == "S = S + kk v^T"
    caret = lines[2]
    assert caret.index("^") - lines[1].index("S") == len("S = S + ")


def test_compile_from_path_names_the_file(tmp_path):
    p = tmp_path / "bad.lr"
    p.write_text(spec(*HEAD, "S = S + kk v^T", "o = S^T q"))
    with pytest.raises(lrdsl.SpecError) as e:
        lrdsl.compile(p)
    assert str(e.value).startswith(f"{p}:3:9: error: unknown name 'kk'")


def test_missing_file_is_a_spec_error(tmp_path):
    with pytest.raises(lrdsl.SpecError) as e:
        lrdsl.compile(tmp_path / "nope.lr")
    assert "cannot read" in str(e.value) and "nope.lr" in str(e.value)


@pytest.mark.parametrize("kw", keyword.kwlist + ["__import__", "_private", "__class__"])
def test_python_keywords_and_dunders_are_refused_as_input_names(kw):
    with pytest.raises(lrdsl.SpecError) as e:
        lrdsl.compile(text=spec("mixer m", f"input q[K], k[K], v[V], {kw}", "S = S + k v^T", "o = S^T q"))
    assert str(e.value).startswith("<spec>:2:25: error: ")
    assert kw in str(e.value) or kw == "in"  # `in` opens a range, so the parser refuses it


@pytest.mark.parametrize("kw", ["class", "def", "import", "__init__", "None"])
def test_python_keywords_are_refused_as_mixer_names(kw):
    with pytest.raises(lrdsl.SpecError) as e:
        lrdsl.compile(text=spec(f"mixer {kw}", *HEAD[1:], "S = S + k v^T", "o = S^T q"))
    assert f"'{kw}'" in str(e.value) and "reserved" in str(e.value)


def test_accepted_names_are_plain_identifiers():
    """The other side: what is accepted, and a byte-order mark is not an error."""
    m = lrdsl.compile(text="\ufeff" + spec("mixer my_mixer2", "input q[K], k[K], v[V], beta_1 in (0, 1)",
                                           "S = (I - beta_1 k k^T) S + beta_1 k v^T", "o = S^T q"),
                      check_stability=False)
    assert m.name == "my_mixer2" and "beta_1" in m.inputs


def test_unstable_spec_is_accepted_with_allow():
    m = lrdsl.compile(text=spec("mixer m", "decay none", "gain scalar beta in (0, 3)", "normalize q, k",
                                "allow unstable"))
    assert m.ir.allow_unstable


def test_mixer_named_like_a_python_module_is_refused():
    """`lrdsl compile` writes <mixer>.py; `random.py` would shadow the standard library."""
    import lrdsl
    for name in ("random", "os", "numpy"):
        with pytest.raises(lrdsl.SpecError, match="name of a Python module") as e:
            lrdsl.compile(text=f"mixer {name}\ndecay none\n", load_kernels=False)
        assert str(e.value).startswith("<spec>:1:7: error:")
