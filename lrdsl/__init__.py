"""lrdsl: a declarative compiler for linear-recurrence token mixers."""
from lrdsl._version import __version__
from lrdsl.api import Mixer, compile
from lrdsl.errors import InputError, LrdslError, SpecError
from lrdsl.runtime.tensors import MixerState

__all__ = ["compile", "Mixer", "MixerState", "SpecError", "InputError", "LrdslError", "__version__"]


def __getattr__(name):
    # lrdsl.nn imports torch: loaded on first use, so `lrdsl show` and `lrdsl check` start without it
    if name == "nn":
        import importlib
        return importlib.import_module(".nn", __name__)
    raise AttributeError(f"module 'lrdsl' has no attribute {name!r}")
