"""The values OmegaConf (NeMo Gym 0.7.0's config loader) reads from YAML texts (run by the interop tier's Python).

usage: python yaml_values.py TEXTS_JSON
TEXTS_JSON is a JSON list of YAML documents. Prints one JSON line, a list with one entry per text:
``OmegaConf.to_container(OmegaConf.create(text), resolve=False)`` encoded as
``tests/support/yaml_scalars.encode`` encodes (``[type name, repr]`` per scalar, containers walked),
or ``{"error": "<class>"}`` when OmegaConf refuses the text.
"""

from __future__ import annotations

import json
import sys

from omegaconf import OmegaConf
from typed_json import encode  # this folder: the script's own directory is on sys.path


def read(text: str) -> object:
    try:
        return encode(OmegaConf.to_container(OmegaConf.create(text), resolve=False))
    except Exception as error:  # noqa: BLE001 - any refusal is the answer
        return {"error": type(error).__name__}


def main() -> None:
    sys.stdout.write(json.dumps([read(text) for text in json.loads(sys.argv[1])]) + "\n")


if __name__ == "__main__":
    main()
