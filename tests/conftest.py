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
