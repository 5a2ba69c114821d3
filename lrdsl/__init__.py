"""lrdsl: a declarative compiler for linear-recurrence token mixers."""
import os as _os

# In a source checkout codegen/, grammar/ and templates/ stand beside lrdsl/ (the project's layout);
# a built wheel maps them into the package as lrdsl.codegen, lrdsl.grammar and lrdsl.templates.
# Let the checkout resolve the same names whether or not (or however) it was installed.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(__path__[0], "codegen")) and \
        _os.path.isfile(_os.path.join(_root, "codegen", "plan.py")):
    __path__.append(_root)

from .api import Mixer, compile  # noqa: E402
from .errors import InputError, LrdslError, SpecError  # noqa: E402
from .tensors import MixerState  # noqa: E402

__version__ = "0.1.0"
__all__ = ["compile", "Mixer", "MixerState", "SpecError", "InputError", "LrdslError", "__version__"]


def __getattr__(name):
    # lrdsl.nn imports torch: loaded on first use, so `lrdsl show` and `lrdsl check` start without it
    if name == "nn":
        import importlib
        return importlib.import_module(".nn", __name__)
    raise AttributeError(f"module 'lrdsl' has no attribute {name!r}")
