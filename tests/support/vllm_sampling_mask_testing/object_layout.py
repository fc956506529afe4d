"""Whether an object's attributes left CPython 3.11-3.12's inline layout.

Reading ``obj.__dict__`` or assigning ``obj.__class__`` moves an object's attributes into a dict
of its own, and every later attribute read on it is slower. The plugin never does either to
vLLM's objects; tests check it from outside, without reading ``obj.__dict__`` (which would itself
move them): through the garbage collector's view of the object.
"""

from __future__ import annotations

import gc


def attributes_in_a_dict_of_their_own(obj: object, name: str) -> bool:
    """Whether ``obj``'s attributes (``name``, one it has, among them) sit in a dict of its own."""
    return any(isinstance(ref, dict) and name in ref for ref in gc.get_referents(obj))
