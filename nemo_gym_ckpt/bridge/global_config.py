"""NeMo Gym's global config for one of its servers in our mesh, made from the mesh's resolved config.

NeMo Gym's launcher hands each server the whole resolved config as YAML in ``NEMO_GYM_CONFIG_DICT``
and the server's instance name in ``NEMO_GYM_CONFIG_PATH``; the server reads its own block from the
first implementation under the first type key of that instance, and reaches another server (a
judge model) by the ``host`` and ``port`` of that server's block. Our mesh config has the same
instance -> type key -> implementation -> settings shape, so every instance is passed as it is,
except that a NeMo Gym instance loses this mesh's own keys (``package``, ``python``) and every
instance gets its ``host`` where it sets none: the config's ``default_host``, else 127.0.0.1
(``config.default_host_of``, where the launcher and our servers take it from). Added:

- ``head_server`` (NeMo Gym's servers need its address, but do not call it at startup; its ``host``
  the same default);
- ``dry_run: false`` (required);
- ``observability_enabled: true``: the server then sends its judge calls under the rollout's
  ``/ng-rollout/<key>/`` prefix, so that a judge model of the mesh sees which rollout asked.

The ``checkpoint`` block stays out: it is this mesh's, and it holds the control token. Strings
that contain ``${`` are escaped (the YAML is parsed by OmegaConf, which would interpolate them).

NeMo Gym reads that config from the environment, and Linux caps one environment string
(``NAME=value``) at ``MAX_ENV_STRING_BYTES`` (128 KiB, ``MAX_ARG_STRLEN``): past it, every program
the server's process started would fail (``E2BIG``), and NeMo Gym's own launcher could not start
the server at all. ``nemo_gym_config_env_value`` refuses such a config (a ``ConfigError`` with its
size) instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nemo_gym_ckpt.config import default_host_of
from nemo_gym_ckpt.config_yaml import dump_yaml
from nemo_gym_ckpt.errors import ConfigError

__all__ = [
    "CONFIG_DICT_ENV",
    "CONFIG_PATH_ENV",
    "MAX_ENV_STRING_BYTES",
    "OUR_KEYS",
    "WORKER_ENV",
    "nemo_gym_config",
    "nemo_gym_config_env_value",
    "nemo_gym_config_yaml",
]

CONFIG_DICT_ENV = "NEMO_GYM_CONFIG_DICT"
CONFIG_PATH_ENV = "NEMO_GYM_CONFIG_PATH"
WORKER_ENV = "IS_NEMO_GYM_FASTAPI_WORKER"
"""Set in the server's process: NeMo Gym then builds the app and hands it back instead of serving it
(its path for uvicorn workers), so that the shell can serve it."""
OUR_KEYS = ("package", "python")
MAX_ENV_STRING_BYTES = 128 << 10
"""Linux's ``MAX_ARG_STRLEN``: the bytes of one environment string, ``NAME=value`` and its NUL."""
_MESH_ONLY_KEYS = ("checkpoint",)


def nemo_gym_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The global config dict NeMo Gym's servers read, from the mesh's resolved ``raw`` config."""
    host = default_host_of(raw)
    config: dict[str, Any] = {}
    for name, block in raw.items():
        if name in _MESH_ONLY_KEYS:
            continue
        config[name] = _as_nemo_gym_block(block, host) if isinstance(block, Mapping) else block
    config["head_server"] = {"host": host, **(raw.get("head_server") or {})}
    config["dry_run"] = False
    config["observability_enabled"] = True
    return _escaped(config)


def nemo_gym_config_yaml(raw: Mapping[str, Any]) -> str:
    return dump_yaml(nemo_gym_config(raw))


def nemo_gym_config_env_value(raw: Mapping[str, Any]) -> str:
    """``nemo_gym_config_yaml(raw)``, refused when ``CONFIG_DICT_ENV=<it>`` is over Linux's bound."""
    text = nemo_gym_config_yaml(raw)
    size = len(CONFIG_DICT_ENV) + 1 + len(text.encode()) + 1
    if size > MAX_ENV_STRING_BYTES:
        raise ConfigError(
            f"NeMo Gym's servers read the mesh config from the environment variable {CONFIG_DICT_ENV}, and "
            f"here it would be {size:,} bytes: Linux caps one environment string at {MAX_ENV_STRING_BYTES:,} "
            "(MAX_ARG_STRLEN), past which every program the server started would fail (E2BIG); make the "
            "mesh config smaller (its longest values, such as a long prompt)")
    return text


def _as_nemo_gym_block(block: Mapping[str, Any], host: str) -> dict[str, Any]:
    """An instance block with ``package``/``python`` dropped from its settings and a ``host`` set
    (``host``, the config's default, where the block names none)."""
    out: dict[str, Any] = {}
    for type_key, impls in block.items():
        if not isinstance(impls, Mapping):
            out[type_key] = impls
            continue
        out[type_key] = {
            impl: {"host": host, **{k: v for k, v in settings.items() if k not in OUR_KEYS}}
            if isinstance(settings, Mapping) else settings
            for impl, settings in impls.items()
        }
    return out


def _escaped(value: Any) -> Any:
    if isinstance(value, str):
        return value.replace("${", "\\${")
    if isinstance(value, Mapping):
        return {str(key): _escaped(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_escaped(item) for item in value]
    return value
