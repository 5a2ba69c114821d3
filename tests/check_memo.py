"""The checker's facts once per spec for the test session, installed by conftest.py.

lrdsl.checks.checker.check(ir) (sympy analysis and a seeded witness search) is a pure function of the IR,
which is frozen and compares by value (not by its source spans). The tests compile the same specs
many times (the examples in most files, each test's own spec text more than once): of ~300 checks
in `pytest -q` only ~100 were of different specs, ~20 s of repeated sympy. The memo hands out a
deep copy of the first result, so a caller that edits its facts cannot reach another's;
tests/test_check_memo.py compares it with a fresh check.
"""
from __future__ import annotations

import copy

_FACTS: dict = {}


def install():
    """Wrap lrdsl.checks.checker.check with the memo (idempotent)."""
    from lrdsl.checks import checker
    if getattr(checker.check, "_lrdsl_tests", False):
        return
    fresh = checker.check

    def check(mixer):
        try:
            facts = _FACTS.get(mixer)
        except TypeError:  # an IR that cannot be hashed: never cached
            return fresh(mixer)
        if facts is None:
            facts = _FACTS[mixer] = fresh(mixer)
        return copy.deepcopy(facts)

    check._lrdsl_tests = True
    check.fresh = fresh
    checker.check = check
