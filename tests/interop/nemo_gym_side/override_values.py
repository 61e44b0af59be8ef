"""What NeMo Gym 0.7.0's command line makes of overrides (run by the interop tier's Python).

usage: python override_values.py CASES_JSON
CASES_JSON is a JSON list of argument lists (``["++k=0x1F"]``, ``["++a={x: 1}", "++a.y=2"]``). Prints
one JSON line, ``{"cases": [...], "nemo_gym": ...}``:

- ``cases``, one entry per argument list: what Hydra's composition does with command-line
  overrides, step by step (its ``OverridesParser``, its check that a sweep needs ``--multirun``,
  ``ConfigLoaderImpl._apply_overrides_to_config`` on an empty config in struct mode, overrides of
  Hydra's own settings left out, as they never reach the task's config; each override's text kept
  in a list of strings, as Hydra keeps it), or
  ``{"error": "<class>"}`` when Hydra refuses them;
- ``nemo_gym``: NeMo Gym's own command-line reader
  (``GlobalConfigDictParser.parse_global_config_dict_from_cli``, ``hydra.main`` over ``sys.argv``),
  run once over every argument list that Hydra accepted, each list's keys put under ``c<index>.``
  (``++a=1`` of list 3 is ``++c3.a=1``), so that one run checks the steps above against it.

Values are ``OmegaConf.to_container(cfg, resolve=False)`` encoded as
``tests/support/yaml_scalars.encode`` encodes (``[type name, repr]`` per scalar, containers walked).
One NeMo Gym run (about a second), not one per list (each ``hydra.main`` run takes a few tenths).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys

from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from nemo_gym.global_config import GlobalConfigDictParser
from omegaconf import OmegaConf
from typed_json import encode  # this folder: the script's own directory is on sys.path


def composed(arguments: list[str]) -> object:
    try:
        overrides = OverridesParser.create().parse_overrides(overrides=arguments)
        ConfigLoaderImpl.validate_sweep_overrides_legal(overrides, run_mode=RunMode.RUN, from_shell=True)
        config = OmegaConf.create({})
        OmegaConf.set_struct(config, True)
        ConfigLoaderImpl._apply_overrides_to_config([o for o in overrides if not o.is_hydra_override()], config)
        recorded = OmegaConf.create({"task": []})  # Hydra keeps each override's text in a list of strings,
        for override in overrides:  # which OmegaConf refuses when it holds a malformed ${...}
            recorded.task.append(override.input_line)
        return encode(OmegaConf.to_container(config, resolve=False))
    except Exception as error:  # noqa: BLE001 - any refusal is the answer
        return {"error": type(error).__name__}


def nemo_gyms_reading(arguments: list[str]) -> object:
    sys.argv = ["gym", *arguments]
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        config = GlobalConfigDictParser().parse_global_config_dict_from_cli()
    return encode(OmegaConf.to_container(config, resolve=False))


def main() -> None:
    cases = json.loads(sys.argv[1])
    results = [composed(arguments) for arguments in cases]
    together = [re.sub(r"^(\+*)(?!\+|hydra[./])", rf"\g<1>c{index}.", argument)
                for index, (arguments, result) in enumerate(zip(cases, results, strict=True))
                if "error" not in result for argument in arguments]
    sys.stdout.write(json.dumps({"cases": results, "nemo_gym": nemo_gyms_reading(together)}) + "\n")


if __name__ == "__main__":
    main()
