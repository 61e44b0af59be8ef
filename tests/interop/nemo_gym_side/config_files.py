"""Config files as NeMo Gym 0.7.0 loads them and expands their directives (run by the interop tier's Python).

usage: python config_files.py TEXTS_JSON
TEXTS_JSON is a JSON list of YAML texts. Each is written to a file, read by NeMo Gym's own loader
(``_load_config_yaml``: ``OmegaConf.load``), then put through the directive pass ``parse`` runs on
the merged files (``GlobalConfigDictParser._recursively_swap_keys``: ``_inherit_from``, ``_copy``).
Prints one JSON line, a list: per text ``{"tree": <the config, unresolved>}``, or ``{"error":
"<class>: <message>", "at": "load" | "directives"}``.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from nemo_gym.global_config import GlobalConfigDictParser, _load_config_yaml
from omegaconf import OmegaConf


def read(text: str, folder: Path) -> dict[str, Any]:
    path = folder / "config.yaml"
    path.write_text(text)
    step = "load"
    try:
        config = _load_config_yaml(path)
        step = "directives"
        GlobalConfigDictParser()._recursively_swap_keys(config)
    except Exception as error:  # noqa: BLE001 - each refusal is the answer, whatever its class
        return {"error": f"{type(error).__name__}: {error}"[:600], "at": step}
    return {"tree": OmegaConf.to_container(config, resolve=False)}


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        results = [read(text, Path(folder)) for text in json.loads(sys.argv[1])]
    sys.stdout.write(json.dumps(results) + "\n")


if __name__ == "__main__":
    main()
