"""Test set-up: kernels run in Triton's interpreter on CPU unless LRDSL_TEST_DEVICE=cuda.

TRITON_INTERPRET must be set before triton is first imported, hence at conftest import time.
Generated modules go to a per-session cache directory so tests never see a stale user cache.
"""
import os
import tempfile

if os.environ.get("LRDSL_TEST_DEVICE", "cpu") != "cuda":
    os.environ["TRITON_INTERPRET"] = "1"
    # the tests' tensors are tiny: a second intra-op thread only spins, and on a shared 2-core machine
    # it made the suite up to 1.7x slower (subprocesses the tests start inherit this too)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("LRDSL_CACHE_DIR", tempfile.mkdtemp(prefix="lrdsl-test-cache-"))


import pytest  # noqa: E402


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(items):
    """pyproject's addopts run the tests in two pytest-xdist workers (--dist loadgroup). A module-scoped
    fixture runs once in every worker that runs one of its tests (test_cp's spawn of the ranks,
    test_spec_errors' and test_show's subprocesses, test_compile's compiled folder): the tests of a
    module that use one go to one worker, so that each such fixture still runs once."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.values() if info is not None else ()
        if any(d and d[-1].scope == "module" for d in defs):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


@pytest.fixture(scope="session")
def compiled():
    """lrdsl.compile with a cache for the session: each spec is parsed and its kernels loaded once."""
    import lrdsl
    cache = {}

    def get(path, **kw):
        key = (str(path), tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = lrdsl.compile(path, **kw)
        return cache[key]

    return get


import interpreter_scan  # noqa: E402

interpreter_scan.install()  # the interpreter's associative_scan one slice at a time (same bits)

import interpreter_calls  # noqa: E402

interpreter_calls.install()  # a helper called inside a launch skips the interpreter's repeated re-patching

import check_memo  # noqa: E402

check_memo.install()  # the checker's facts once per spec (a pure function of the frozen IR)
