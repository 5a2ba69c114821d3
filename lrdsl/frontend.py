"""Text -> IR: the front end as one pure function."""
from __future__ import annotations

from .errors import SpecError
from .ir import Mixer
from .lower import lower
from .syntax import MAX_BYTES, parse


def spec_to_ir(text, filename: str = "<spec>") -> Mixer:
    if isinstance(text, (bytes, bytearray)) and len(text) <= MAX_BYTES:
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError:
            pass  # parse() reports where the bad byte is
    source = text if isinstance(text, str) else ""
    try:
        return lower(parse(text, filename))
    except SpecError as e:
        raise e.located(source, filename) from None
