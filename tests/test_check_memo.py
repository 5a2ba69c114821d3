"""conftest.py's memo of the checker (tests/check_memo.py) gives what a fresh check gives, and a
caller editing its facts does not change what the next caller gets."""
from pathlib import Path

import pytest

import lrdsl
from lrdsl.checks import checker

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", ["gated_deltanet", "precond_kda", "mesa"])
def test_memo_gives_a_fresh_checks_facts(name):
    assert getattr(checker.check, "_lrdsl_tests", False)
    ir = lrdsl.compile(ROOT / "examples" / f"{name}.lr", load_kernels=False).ir
    first, again = checker.check(ir), checker.check(ir)
    assert first == again == checker.check.fresh(ir)
    first["stable"] = "edited"
    first["notes"].append("edited")
    assert checker.check(ir) == again and "edited" not in checker.check(ir)["notes"]
