"""Rendered source -> loaded module, cached on disk.

The cache key is the canonical spec text (printed from the IR), the plan, the lrdsl version and the
triton version. The folder is platformdirs' user cache folder for lrdsl (~/.cache/lrdsl on Linux,
after XDG_CACHE_HOME) unless LRDSL_CACHE_DIR names another. Files are written to a temporary name
and renamed, so a reader sees a whole module or none; writers of one module take turns under a file
lock (filelock, in the folder's .locks/), so the first writes it and the others find it whole.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import sys
import tempfile
import uuid
import warnings
from pathlib import Path

import platformdirs
from filelock import FileLock, Timeout

from lrdsl._version import __version__
from lrdsl.codegen.generate import generate
from lrdsl.frontend import ir, printer
from lrdsl.runtime import tuning


def cache_dir() -> Path:
    return Path(os.environ.get("LRDSL_CACHE_DIR") or platformdirs.user_cache_path("lrdsl"))


def module_key(m: ir.Mixer, source: str) -> str:
    import triton

    h = hashlib.sha256()
    for part in (printer.explicit(m), source, __version__, triton.__version__):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def write_atomic(path: Path, text: str) -> None:
    """path holds text, whole: written to a fresh name beside it, then renamed over it. The file gets
    the mode a plain open() would (0666 less the umask), so a shared build or cache folder stays
    readable to the others that the umask lets read it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


LOCK_WAIT_S = 60  # writing a module takes milliseconds; a longer wait means a lock left behind
_FALLBACK: list = []  # a private cache folder for this process, made on the first cache fault


def _cached(folder: Path, name: str, source: str) -> Path:
    """The module file in folder, (re)written unless it already holds exactly source. A file that
    is not the source (stale, truncated, not UTF-8) is rewritten; faults raise OSError."""
    path = folder / name
    if _holds(path, source):  # the common case: no lock, no write
        return path
    locks = folder / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    try:
        with FileLock(locks / f"{name}.lock", timeout=LOCK_WAIT_S):
            if not _holds(path, source):  # another process may have written it while this one waited
                write_atomic(path, source)
    except Timeout:  # a soft lock left by a crash where flock is missing: the rename keeps the write whole
        write_atomic(path, source)
    return path


def _holds(path: Path, source: str) -> bool:
    try:
        return path.is_file() and path.read_bytes() == source.encode()
    except OSError:
        return False


def _module_file(name: str, source: str) -> Path:
    try:
        return _cached(cache_dir(), name, source)
    except OSError as e:  # a file in the way, no permission, a folder where the module goes
        if not _FALLBACK:
            _FALLBACK.append(Path(tempfile.mkdtemp(prefix="lrdsl-cache-")))
            warnings.warn(f"lrdsl: cannot use the kernel cache {cache_dir()} ({e.strerror or e}); "
                          f"this process uses {_FALLBACK[0]} instead (set LRDSL_CACHE_DIR to a "
                          "writable folder)", RuntimeWarning, stacklevel=3)
        return _cached(_FALLBACK[0], name, source)


def _import(mod_name: str, path: Path):
    spec = importlib.util.spec_from_file_location(mod_name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:  # a broken module must leave no trace: the next load tries again
        sys.modules.pop(mod_name, None)
        raise
    if _NARROW:
        _narrow(mod, _NARROW[-1])
    return mod


_NARROW: list = []  # narrow()'s dtypes, innermost last
_NARROWED: dict = {}  # module -> its own NARROW_DTYPES, while narrow() holds it


def _narrow(mod, dtypes: tuple) -> None:
    if hasattr(mod, "NARROW_DTYPES"):
        _NARROWED.setdefault(mod, mod.NARROW_DTYPES)
        mod.NARROW_DTYPES = dtypes


@contextlib.contextmanager
def narrow(dtypes: tuple):
    """Within: every generated module loaded, before or during, keeps the intermediates of inputs of
    `dtypes` in their own width (its NARROW_DTYPES); each gets its own back at the end. lrdsl.census
    adds fp16, the interpreter's stand-in for bf16, so that what it counts is a bf16 call's bytes."""
    _NARROW.append(dtypes)
    for mod in [m for n, m in sys.modules.items() if n.startswith("lrdsl_generated_")]:
        _narrow(mod, dtypes)
    try:
        yield
    finally:
        _NARROW.pop()
        for mod, own in list(_NARROWED.items()):
            mod.NARROW_DTYPES = _NARROW[-1] if _NARROW else own
        if not _NARROW:
            _NARROWED.clear()


def load_source(stem: str, source: str):
    """Import a generated module of no spec (keyed by its source alone), from the cache."""
    import triton
    key = hashlib.sha256(f"{source}\0{__version__}\0{triton.__version__}".encode()).hexdigest()[:24]
    mod_name = f"lrdsl_generated_{stem}_{key}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    return _import(mod_name, _module_file(f"{stem}_{key}.py", source))


def load(m: ir.Mixer):
    """Generate (or find in the cache) and import the kernels module of a mixer."""
    source = generate(m)
    key = module_key(m, source)
    mod_name = f"lrdsl_generated_{m.name}_{key}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    mod = _import(mod_name, _module_file(f"{m.name}_{key}.py", source))
    if os.environ.get("LRDSL_AUTOTUNE", "1") == "0" and hasattr(mod, "use_first_configs"):
        mod.use_first_configs()
    elif tuning.enabled():
        tuning.compile_spaces_at_once(mod)
        tuning.compile_ahead(mod)
    if os.environ.get("LRDSL_REMEMBER_CHOICES", "1") != "0":  # measured: docs/kernels/host.md
        tuning.remember_choices(mod)
    return mod
