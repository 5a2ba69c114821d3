"""Rendered source -> loaded module, cached on disk.

The cache key is the canonical spec text (printed from the IR), the plan, the lrdsl version and the
triton version. Files are written to a temporary name and renamed, so a parallel process sees a
whole module or none.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
import warnings
from pathlib import Path

from lrdsl._version import __version__
from lrdsl.codegen.generate import generate
from lrdsl.frontend import ir, printer
from lrdsl.runtime import tuning


def cache_dir() -> Path:
    root = os.environ.get("LRDSL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "lrdsl")
    return Path(root)


def module_key(m: ir.Mixer, source: str) -> str:
    import triton

    h = hashlib.sha256()
    for part in (printer.explicit(m), source, __version__, triton.__version__):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


_FALLBACK: list = []  # a private cache folder for this process, made on the first cache fault


def _cached(folder: Path, name: str, source: str) -> Path:
    """The module file in folder, (re)written unless it already holds exactly source. A file that
    is not the source (stale, truncated, not UTF-8) is rewritten; faults raise OSError."""
    path = folder / name
    try:
        current = path.read_bytes() if path.is_file() else None
    except OSError:
        current = None
    if current != source.encode():
        write_atomic(path, source)
    return path


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


def load(m: ir.Mixer):
    """Generate (or find in the cache) and import the kernels module of a mixer."""
    source = generate(m)
    key = module_key(m, source)
    mod_name = f"lrdsl_generated_{m.name}_{key}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    path = _module_file(f"{m.name}_{key}.py", source)
    spec = importlib.util.spec_from_file_location(mod_name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:  # a broken module must leave no trace: the next load tries again
        sys.modules.pop(mod_name, None)
        raise
    if os.environ.get("LRDSL_AUTOTUNE", "1") == "0" and hasattr(mod, "use_first_configs"):
        mod.use_first_configs()
    elif tuning.enabled():
        tuning.compile_spaces_at_once(mod)
        tuning.compile_ahead(mod)
    return mod
