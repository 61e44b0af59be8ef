"""Values as JSON that keeps their types, for comparing NeMo Gym's readings with ours.

A scalar is ``[type name, repr]``; a mapping ``{"dict": [[key, value], ...]}`` and a list or tuple
``{"list": [...]}``, walked. The scripts of this folder (run by NeMo Gym's Python) and the unit
tier's tables (``tests/support/yaml_scalars.py``) both encode with it.
"""

from __future__ import annotations

__all__ = ["encode"]


def encode(value: object) -> object:
    if isinstance(value, dict):
        return {"dict": [[encode(key), encode(item)] for key, item in value.items()]}
    if isinstance(value, list | tuple):
        return {"list": [encode(item) for item in value]}
    return [type(value).__name__, repr(value)]
