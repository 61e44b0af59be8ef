"""Which strings NeMo Gym 0.7.0's OmegaConf (2.3.1) takes as config strings (run by the interop tier's Python).

usage: python interpolations.py TEXTS_JSON
TEXTS_JSON is a JSON list of strings. Prints one JSON line, a list of booleans: whether assigning the
string to a config node passes OmegaConf's interpolation check (``get_value_kind`` with strict
validation, which a node runs on every string it is given).
"""

from __future__ import annotations

import json
import sys

from omegaconf._utils import get_value_kind
from omegaconf.errors import GrammarParseError


def taken(text: str) -> bool:
    try:
        get_value_kind(text, strict_interpolation_validation=True)
    except GrammarParseError:
        return False
    return True


def main() -> None:
    sys.stdout.write(json.dumps([taken(text) for text in json.loads(sys.argv[1])]) + "\n")


if __name__ == "__main__":
    main()
