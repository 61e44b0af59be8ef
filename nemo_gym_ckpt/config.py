"""Typed mesh config: YAML files merged, ``${...}`` interpolated, ``key=value`` overrides, validated.

Shape (docs/architecture.md section 3)::

    policy_model:                  # instance name
      model_servers:               # server type key: a top-level folder
        policy_model:              # implementation: a folder under it
          worker: {type: model_servers, name: inference_worker}
    head_server: {host: 127.0.0.1, port: 11000}
    checkpoint: {enabled: false}

Files merge in order (later wins), then ``a.b.c=value`` overrides apply (values parsed as YAML).
``${a.b}`` refers to another value, ``${oc.env:VAR}`` / ``${oc.env:VAR,default}`` to the
environment, and ``???`` marks a required value. Each implementation validates its block with the
``Config`` class of its ``app`` module; a typo is an error. Every error is a ``ConfigError`` naming
the file and the key.

A resources instance whose block says ``package: nemo_gym`` is NeMo Gym's own server of that name
(``resources_servers/<implementation>/<entrypoint>`` of the installed ``nemo_gym`` package, run in
its own Python environment: docs/verifiers.md). Its block is NeMo Gym's, validated by NeMo Gym in
that server's process; here ``NemoGymServerConfig`` checks only what the mesh needs (host, port,
references to other servers) and refuses the checkpoint declaration keys, which live in code.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, cast

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

from nemo_gym_ckpt.errors import ConfigError

__all__ = [
    "PROJECT_ROOT",
    "SERVER_TYPES",
    "TOKEN_ENV",
    "CheckpointConfig",
    "DatasetConfig",
    "HeadServerConfig",
    "MeshConfig",
    "NemoGymServerConfig",
    "ServerConfig",
    "ServerInstance",
    "ServerRef",
    "is_nemo_gym",
    "load_config",
    "load_config_dict",
    "parse_overrides",
]

PROJECT_ROOT = Path(__file__).resolve().parent.parent
"""The folder holding ``configs/`` and the server folders: the checkout, or site-packages when installed."""
TOKEN_ENV = "GYM_CKPT_TOKEN"
"""Where the commands read a running mesh's control token (the configs interpolate it too)."""
SERVER_TYPES = ("model_servers", "environment_servers", "agents", "resources_servers")
ServerType = Literal["model_servers", "environment_servers", "agents", "resources_servers"]
NEMO_GYM_PACKAGE = "nemo_gym"
NEMO_GYM_PYTHON_ENV = "NEMO_GYM_PYTHON"
"""The interpreter of the NeMo Gym environment, for instances that do not name one (``python:``)."""
DECLARATION_KEYS = ("checkpoint_mode", "checkpoint_verify")
MISSING = "???"
COMMAND_LINE = "<command line>"
_M = TypeVar("_M", bound=BaseModel)
_INTERPOLATION = re.compile(r"\$\{([^${}]+)\}")


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class HeadServerConfig(StrictModel):
    host: str = "127.0.0.1"
    port: int = Field(11000, ge=0, le=65535)


class CheckpointConfig(StrictModel):
    """The top-level ``checkpoint:`` block (docs/protocol.md section 2)."""

    enabled: bool = False
    control_auth_token: SecretStr | None = None
    lease_grace_seconds: float = Field(600.0, gt=0)
    root: Path = Path("./checkpoints")

    @model_validator(mode="after")
    def _token_when_enabled(self) -> CheckpointConfig:
        if self.enabled and not (self.control_auth_token and self.control_auth_token.get_secret_value()):
            raise ValueError("control_auth_token is required when checkpointing is enabled")
        return self


class ServerRef(StrictModel):
    """A reference from one server to another by instance name."""

    type: ServerType
    name: str


class DatasetConfig(StrictModel):
    name: str
    type: Literal["train", "validation", "example", "benchmark"] = "example"
    jsonl_fpath: Path
    license: str | None = None


class ServerConfig(StrictModel):
    """Base of every implementation's settings; subclasses add their own fields."""

    host: str = "127.0.0.1"
    port: int | None = Field(None, ge=0, le=65535)
    datasets: list[DatasetConfig] = Field(default_factory=list)


class NemoGymServerConfig(ServerConfig):
    """The block of an instance that runs NeMo Gym's own server (``package: nemo_gym``).

    The other keys are that server's own settings, passed to it as they are (NeMo Gym validates
    them in the server's process); a ``{type, name}`` block among them is a reference, checked like
    ours. ``python`` is the interpreter of the environment it runs in (default: ``$NEMO_GYM_PYTHON``).
    """

    model_config = ConfigDict(extra="allow")

    package: Literal["nemo_gym"]
    entrypoint: str = Field("app.py", pattern=r"^[A-Za-z_][A-Za-z0-9_]*(/[A-Za-z_][A-Za-z0-9_]*)*\.py$")
    python: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _declarations_live_in_code(cls, data: Any) -> Any:
        for key in DECLARATION_KEYS:
            if isinstance(data, dict) and key in data:
                raise ValueError(f"{key} is declared in code (docs/verifiers.md), never in config")
        return data

    @model_validator(mode="after")
    def _references(self) -> NemoGymServerConfig:
        extra = self.__pydantic_extra__ or {}
        for key, value in extra.items():
            extra[key] = _as_refs(value)
        return self

    def nemo_gym_settings(self) -> dict[str, Any]:
        """The block as NeMo Gym's server reads it: its own keys, without ours (``package``, ``python``)."""
        return self.model_dump(mode="json", exclude={"package", "python", "datasets"}, exclude_none=True)


def _as_refs(value: Any) -> Any:
    """``value`` with every ``{type, name}`` block of a known server type as a ``ServerRef``."""
    if isinstance(value, dict):
        if set(value) == {"type", "name"} and value["type"] in SERVER_TYPES:
            return ServerRef.model_validate(value)
        return {key: _as_refs(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_as_refs(item) for item in value]
    return value


def is_nemo_gym(settings: ServerConfig) -> bool:
    """Whether the instance runs NeMo Gym's own server (in its own environment)."""
    return isinstance(settings, NemoGymServerConfig)


@dataclass(frozen=True)
class ServerInstance:
    name: str
    type: ServerType
    implementation: str
    settings: ServerConfig

    @property
    def module(self) -> str:
        return f"{self.type}.{self.implementation}.app"

    @property
    def url(self) -> str:
        return f"http://{self.settings.host}:{self.settings.port}"


@dataclass(frozen=True)
class MeshConfig:
    """The resolved, validated config of a whole mesh."""

    head_server: HeadServerConfig
    checkpoint: CheckpointConfig
    instances: dict[str, ServerInstance]
    raw: dict[str, Any]

    def instance(self, name: str) -> ServerInstance:
        try:
            return self.instances[name]
        except KeyError:
            raise ConfigError(f"no server instance named {name!r}") from None

    def url_of(self, ref: ServerRef | str) -> str:
        return self.instance(ref if isinstance(ref, str) else ref.name).url

    def of_type(self, server_type: ServerType) -> list[ServerInstance]:
        return [inst for inst in self.instances.values() if inst.type == server_type]

    @property
    def head_url(self) -> str:
        return f"http://{self.head_server.host}:{self.head_server.port}"

    def with_ports(self, ports: Mapping[str, int], head_port: int | None = None) -> MeshConfig:
        """A copy with the given instance ports (and the head port) filled in (the launcher's)."""
        raw = _deep_copy(self.raw)
        for name, port in ports.items():
            inst = self.instances[name]
            block = raw[name][inst.type]
            block[inst.implementation] = {**(block[inst.implementation] or {}), "port": port}
        if head_port is not None:
            raw["head_server"] = {**(raw.get("head_server") or {}), "port": head_port}
        return build_mesh(raw, origins={})


# ---- loading -------------------------------------------------------------------------------------


def load_config(paths: Sequence[str | Path], overrides: Sequence[str] = ()) -> MeshConfig:
    """Load, merge, override, interpolate and validate the config files."""
    raw, origins = merge_sources(paths, overrides)
    resolved = resolve_interpolations(raw, origins)
    return build_mesh(resolved, origins)


def load_config_dict(raw: Mapping[str, Any]) -> MeshConfig:
    """Validate an already resolved config dict (what the launcher hands its children)."""
    return build_mesh(_deep_copy(dict(raw)), origins={})


def merge_sources(
    paths: Sequence[str | Path], overrides: Sequence[str]
) -> tuple[dict[str, Any], dict[tuple[str, ...], str]]:
    merged: dict[str, Any] = {}
    origins: dict[tuple[str, ...], str] = {}
    if not paths:
        raise ConfigError("no config file given")
    for path in paths:
        _merge_into(merged, _read_yaml(Path(path)), str(path), origins, ())
    for key, value in parse_overrides(overrides):
        _set_path(merged, key, value, origins)
    return merged, origins


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError("file not found", file=str(path)) from None
    except yaml.YAMLError as error:
        raise ConfigError(f"not valid YAML: {error}".replace("\n", " "), file=str(path)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("expected a mapping at the top level", file=str(path))
    return data


def _merge_into(
    dst: dict[str, Any], src: Mapping[str, Any], origin: str, origins: dict[tuple[str, ...], str],
    prefix: tuple[str, ...],
) -> None:
    for key, value in src.items():
        key = str(key)
        path = (*prefix, key)
        if isinstance(value, Mapping) and isinstance(dst.get(key), dict):
            origins.setdefault(path, origin)
            _merge_into(dst[key], value, origin, origins, path)
            continue
        dst[key] = _deep_copy(value)
        for sub in _leaf_paths(value, path):
            origins[sub] = origin


def _leaf_paths(value: Any, path: tuple[str, ...]) -> Iterator[tuple[str, ...]]:
    yield path
    if isinstance(value, Mapping):
        for key, sub in value.items():
            yield from _leaf_paths(sub, (*path, str(key)))


def parse_overrides(overrides: Sequence[str]) -> list[tuple[tuple[str, ...], Any]]:
    """``a.b=1`` -> ((a, b), 1); a leading ``+`` (Hydra style) is accepted and ignored."""
    parsed = []
    for item in overrides:
        key, eq, text = item.lstrip("+").partition("=")
        if not eq or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r} is not key=value", file=COMMAND_LINE)
        try:
            value = yaml.safe_load(text) if text else ""
        except yaml.YAMLError:
            value = text
        parsed.append((tuple(key.split(".")), value))
    return parsed


def _set_path(
    tree: dict[str, Any], path: tuple[str, ...], value: Any, origins: dict[tuple[str, ...], str]
) -> None:
    node = tree
    for depth, part in enumerate(path[:-1]):
        if node.get(part) is None:
            node[part] = {}
        child = node[part]
        if not isinstance(child, dict):
            where = ".".join(path[: depth + 1])
            raise ConfigError(f"cannot set {'.'.join(path)}: {where} is not a mapping", file=COMMAND_LINE)
        node = child
    node[path[-1]] = value
    for sub in _leaf_paths(value, path):
        origins[sub] = COMMAND_LINE


# ---- interpolation -------------------------------------------------------------------------------


def resolve_interpolations(raw: dict[str, Any], origins: dict[tuple[str, ...], str]) -> dict[str, Any]:
    resolver = _Resolver(raw, origins)
    return {key: resolver.value(value, (key,)) for key, value in raw.items()}


class _Resolver:
    def __init__(self, root: dict[str, Any], origins: dict[tuple[str, ...], str]) -> None:
        self.root = root
        self.origins = origins
        self.active: list[tuple[str, ...]] = []

    def value(self, value: Any, path: tuple[str, ...]) -> Any:
        if isinstance(value, dict):
            return {k: self.value(v, (*path, str(k))) for k, v in value.items()}
        if isinstance(value, list):
            return [self.value(v, (*path, str(i))) for i, v in enumerate(value)]
        if isinstance(value, str):
            return self.string(value, path)
        return value

    def string(self, text: str, path: tuple[str, ...]) -> Any:
        whole = _INTERPOLATION.fullmatch(text)
        if whole:
            return self.expression(whole[1], path)
        return _INTERPOLATION.sub(lambda m: str(self.expression(m[1], path)), text)

    def expression(self, expr: str, path: tuple[str, ...]) -> Any:
        expr = expr.strip()
        if expr.startswith("oc.env:"):
            name, comma, default = expr[len("oc.env:") :].partition(",")
            value = os.environ.get(name.strip())
            if value is None and not comma:
                self.fail(f"environment variable {name.strip()} is not set", path)
            return value if value is not None else _yaml_scalar(default.strip())
        target = tuple(expr.split("."))
        if target in self.active:
            self.fail(f"interpolation cycle through ${{{expr}}}", path)
        node: Any = self.root
        for part in target:
            if isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
                continue
            if not isinstance(node, dict) or part not in node:
                self.fail(f"${{{expr}}} refers to a key that does not exist", path)
            node = node[part]
        self.active.append(target)
        try:
            return self.value(node, target)
        finally:
            self.active.pop()

    def fail(self, message: str, path: tuple[str, ...]) -> None:
        raise ConfigError(message, file=origin_of(self.origins, path), key=".".join(path))


def _yaml_scalar(text: str) -> Any:
    try:
        return yaml.safe_load(text) if text else ""
    except yaml.YAMLError:
        return text


def origin_of(origins: Mapping[tuple[str, ...], str], path: Sequence[str]) -> str | None:
    """The file that set ``path`` (or its nearest ancestor)."""
    key = tuple(path)
    while key:
        if key in origins:
            return origins[key]
        key = key[:-1]
    return None


# ---- validation ----------------------------------------------------------------------------------


def build_mesh(raw: dict[str, Any], origins: Mapping[tuple[str, ...], str]) -> MeshConfig:
    _refuse_missing(raw, origins, ())
    head = _validate(HeadServerConfig, raw.get("head_server") or {}, ("head_server",), origins)
    checkpoint = _validate(CheckpointConfig, raw.get("checkpoint") or {}, ("checkpoint",), origins)
    instances = {}
    for name, block in raw.items():
        if name in ("head_server", "checkpoint") or not isinstance(block, dict):
            continue
        instances[name] = _build_instance(name, block, origins)
    if not instances:
        raise ConfigError("the config defines no server instance")
    _check_refs(instances, origins)
    _check_ports(head, instances, origins)
    return MeshConfig(head, checkpoint, instances, raw)


def _refuse_missing(node: Any, origins: Mapping[tuple[str, ...], str], path: tuple[str, ...]) -> None:
    if node == MISSING:
        raise ConfigError(
            "required value is missing (???)", file=origin_of(origins, path), key=".".join(path)
        )
    if isinstance(node, dict):
        for key, value in node.items():
            _refuse_missing(value, origins, (*path, str(key)))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            _refuse_missing(value, origins, (*path, str(index)))


def _build_instance(
    name: str, block: dict[str, Any], origins: Mapping[tuple[str, ...], str]
) -> ServerInstance:
    file = origin_of(origins, (name,))
    if len(block) != 1 or next(iter(block)) not in SERVER_TYPES:
        raise ConfigError(
            f"expected exactly one server type key, one of {', '.join(SERVER_TYPES)}; got {sorted(block)}",
            file=file, key=name,
        )
    server_type, impls = next(iter(block.items()))
    if not isinstance(impls, dict) or len(impls) != 1:
        raise ConfigError("expected exactly one implementation block", file=file, key=f"{name}.{server_type}")
    implementation, settings = next(iter(impls.items()))
    path = (name, server_type, implementation)
    settings = settings or {}
    if isinstance(settings, dict) and "package" in settings:
        if server_type != "resources_servers":
            raise ConfigError(f"only resources servers of the {NEMO_GYM_PACKAGE} package run in this mesh",
                              file=file, key=".".join((*path, "package")))
        config_class: type[ServerConfig] = NemoGymServerConfig
    else:
        config_class = config_class_for(server_type, implementation, file, ".".join(path))
    validated = _validate(config_class, settings, path, origins)
    return ServerInstance(name, cast(ServerType, server_type), implementation, validated)


def config_class_for(server_type: str, implementation: str, file: str | None, key: str) -> type[ServerConfig]:
    """The ``Config`` class declared by ``<server_type>/<implementation>/app.py``."""
    module_name = f"{server_type}.{implementation}.app"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name and (module_name == error.name or module_name.startswith(error.name + ".")):
            raise ConfigError(f"unknown implementation {implementation!r} under {server_type}", file=file,
                              key=key) from None
        raise
    config_class = getattr(module, "Config", None)
    if not (isinstance(config_class, type) and issubclass(config_class, ServerConfig)):
        raise ConfigError(f"{module_name} declares no Config(ServerConfig) class", file=file, key=key)
    return config_class


def _validate(
    model: type[_M], data: Any, path: tuple[str, ...], origins: Mapping[tuple[str, ...], str]
) -> _M:
    try:
        return model.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        loc = tuple(str(part) for part in first["loc"])
        full = (*path, *loc)
        raise ConfigError(
            _describe(first), file=origin_of(origins, full) or origin_of(origins, path), key=".".join(full)
        ) from None


def _describe(error: Any) -> str:
    if error["type"] == "extra_forbidden":
        return "unknown key"
    if error["type"] == "missing":
        return "required value is missing"
    return f"{error['msg']} (got {error.get('input')!r})"


def _check_refs(instances: dict[str, ServerInstance], origins: Mapping[tuple[str, ...], str]) -> None:
    for inst in instances.values():
        for field_path, ref in _refs_in(inst.settings, ()):
            path = (inst.name, inst.type, inst.implementation, *field_path)
            target = instances.get(ref.name)
            if target is None:
                raise ConfigError(f"refers to server {ref.name!r}, which is not defined",
                                  file=origin_of(origins, path), key=".".join(path))
            if target.type != ref.type:
                raise ConfigError(f"refers to {ref.name!r} as {ref.type}, but it is {target.type}",
                                  file=origin_of(origins, path), key=".".join(path))


def _check_ports(
    head: HeadServerConfig, instances: dict[str, ServerInstance], origins: Mapping[tuple[str, ...], str]
) -> None:
    """Two servers never share a port (0 or unset: the launcher picks a free one)."""
    owners = {head.port: "head_server"} if head.port else {}
    for inst in instances.values():
        port = inst.settings.port
        if not port:
            continue
        path = (inst.name, inst.type, inst.implementation, "port")
        if port in owners:
            raise ConfigError(f"port {port} is also the port of {owners[port]}",
                              file=origin_of(origins, path), key=".".join(path))
        owners[port] = inst.name


def _refs_in(value: Any, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], ServerRef]]:
    if isinstance(value, ServerRef):
        yield path, value
    elif isinstance(value, BaseModel):
        for field in type(value).model_fields:
            yield from _refs_in(getattr(value, field), (*path, field))
        for key, item in (value.model_extra or {}).items():
            yield from _refs_in(item, (*path, key))
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from _refs_in(item, (*path, str(index)))
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _refs_in(item, (*path, str(key)))


def _deep_copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value
