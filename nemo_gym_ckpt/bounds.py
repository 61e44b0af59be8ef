"""The bounds every field of a request body carries: the types request models are built from.

No number, string or list that arrives from outside is unbounded: a body is first capped as a
whole (``server.DEFAULT_MAX_BODY_BYTES``, 413), then each field by these types (400 when out of
range). The bounds are generous for real traffic (a text of 8 million characters, 4 million token
ids in one list, 64-bit seeds) and small enough that no value can break what uses it later (a
64-bit integer column, a token id of the engine, a JSON encoder).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

__all__ = [
    "MAX_INT64",
    "MAX_ITEMS",
    "MAX_TEXT",
    "MAX_TOKENS",
    "MAX_TOKEN_ID",
    "Count",
    "Float",
    "Id",
    "Int64",
    "LogProb",
    "Name",
    "PolicyVersion",
    "Seed",
    "Text",
    "TokenId",
    "TokenLimit",
]

MAX_TEXT = 8_000_000
MAX_ITEMS = 100_000
MAX_TOKENS = 4_194_304
MAX_TOKEN_ID = 2**31 - 1
MAX_INT64 = 2**63 - 1

Text = Annotated[str, Field(max_length=MAX_TEXT)]
"""Free text: a message, a tool's arguments or output, an instruction."""
Name = Annotated[str, Field(max_length=256)]
"""A model name, a function name, a role-like label."""
Id = Annotated[str, Field(max_length=512)]
"""An identifier a client chose (a call id, an item id)."""
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
TokenLimit = Annotated[int, Field(ge=1, le=MAX_TOKENS)]
"""A number of tokens to generate."""
Count = Annotated[int, Field(ge=0, le=MAX_INT64)]
Int64 = Annotated[int, Field(ge=-MAX_INT64 - 1, le=MAX_INT64)]
Seed = Annotated[int, Field(ge=-(2**63), lt=2**64)]
"""A sampling seed: any signed or unsigned 64-bit integer."""
LogProb = Annotated[float, Field(ge=-1e30, le=1e30, allow_inf_nan=False)]
Float = Annotated[float, Field(ge=-1e300, le=1e300, allow_inf_nan=False)]
PolicyVersion = Annotated[int, Field(ge=0, le=MAX_INT64)] | Annotated[str, Field(min_length=1, max_length=256)]
"""The version of the served weights: a non-negative 64-bit integer, or a short string."""
