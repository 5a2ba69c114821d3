"""lrdsl: a declarative compiler for linear-recurrence token mixers."""
from .api import Mixer, compile
from .errors import InputError, LrdslError, SpecError

__version__ = "0.1.0"
__all__ = ["compile", "Mixer", "SpecError", "InputError", "LrdslError", "__version__"]
