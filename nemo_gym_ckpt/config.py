"""Typed mesh config in NeMo Gym's shape: sources merged (``config_sources``), interpolated, validated.

Shape (docs/architecture.md section 3, docs/nemo-gym.md)::

    policy_model:                      # instance name
      responses_api_models:            # server type key (folder model_servers/)
        policy_model:                  # implementation: the folder model_servers/policy_model/
          entrypoint: app.py           # the file in that folder that declares Config and create_app
          worker: {type: responses_api_models, name: inference_worker}
    head_server: {host: 127.0.0.1, port: 11000}
    checkpoint: {enabled: false}

The four type keys are NeMo Gym's; two of them live in folders named otherwise
(``responses_api_models`` in ``model_servers/``, ``responses_api_agents`` in ``agents/``). Each
implementation validates its block with the ``Config`` class of its entrypoint; a typo is an error,
and so is an unknown top-level key. A config in the old keys (``model_servers:``, ``agents:``) gets
an error naming the new one. Every error is a ``ConfigError`` naming the file and the key.

A resources instance whose block says ``package: nemo_gym`` is NeMo Gym's own server of that name
(``resources_servers/<implementation>/<entrypoint>`` of the installed ``nemo_gym`` package, run in
its own Python environment: docs/verifiers.md). Its block is NeMo Gym's, validated by NeMo Gym in
that server's process; here ``NemoGymServerConfig`` checks only what the mesh needs (host, port,
references to other servers) and refuses the checkpoint declaration keys, which live in code.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, ClassVar, Literal, TypeVar, cast

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from nemo_gym_ckpt.config_sources import (
    CONFIG_PATHS,
    PROJECT_ROOT,
    Origins,
    deep_copy,
    interpolation_roots,
    origin_of,
    parse_overrides,
    read_sources,
    resolve_interpolations,
)
from nemo_gym_ckpt.errors import ConfigError

__all__ = [
    "DEFAULT_FULL_COLLECTION_INTERVAL_SECONDS",
    "DEFAULT_HOST",
    "FOLDER_OF_TYPE",
    "KNOWN_TOP_LEVEL_KEYS",
    "MAX_WORKERS",
    "MIN_METRICS_EXPORT_INTERVAL_S",
    "NEMO_GYM_LAUNCHER_KEYS",
    "OLD_TYPE_KEYS",
    "PROJECT_ROOT",
    "SERVER_TYPES",
    "TOKEN_ENV",
    "BenchmarkDatasetConfig",
    "CheckpointConfig",
    "DatasetConfig",
    "Domain",
    "HeadServerConfig",
    "MeshConfig",
    "NemoGymServerConfig",
    "PortsConfig",
    "ServerConfig",
    "ServerInstance",
    "ServerRef",
    "ServerType",
    "TelemetryConfig",
    "default_host_of",
    "http_url",
    "is_nemo_gym",
    "load_config",
    "load_config_dict",
    "parse_overrides",
]

TOKEN_ENV = "GYM_CKPT_TOKEN"
"""Where the commands read a running mesh's control token (the configs interpolate it too)."""
MAX_WORKERS = 64
ServerType = Literal["responses_api_models", "responses_api_agents", "environment_servers", "resources_servers"]
SERVER_TYPES: tuple[ServerType, ...] = (
    "responses_api_models", "responses_api_agents", "environment_servers", "resources_servers",
)
FOLDER_OF_TYPE: dict[str, str] = {
    "responses_api_models": "model_servers",
    "responses_api_agents": "agents",
    "environment_servers": "environment_servers",
    "resources_servers": "resources_servers",
}
"""The folder that holds the implementations of each type key."""
OLD_TYPE_KEYS = {"model_servers": "responses_api_models", "agents": "responses_api_agents"}
"""Type keys of this project before it took NeMo Gym's, and their names now."""
HEAD_SERVER = "head_server"
CHECKPOINT = "checkpoint"
TELEMETRY = "telemetry"
PORT_KEYS = ("port_range_low", "port_range_high", "disallowed_ports")
KNOWN_TOP_LEVEL_KEYS = (HEAD_SERVER, CHECKPOINT, TELEMETRY, CONFIG_PATHS, "default_host", *PORT_KEYS)
"""Top-level keys that are not server instances (besides values that some ``${...}`` names)."""
NEMO_GYM_LAUNCHER_KEYS = frozenset({
    "entrypoint", "head_server_deps", "python_version", "pip_install_verbose", "use_absolute_ip",
    "uv_pip_set_python", "skip_venv_if_present", "hf_token", "ray_head_node_address", "dry_run",
    "server_spinup_timeout_seconds", "model_endpoint_readiness_timeout_seconds", "allow_openai_version_skew",
    "uv_cache_dir", "uv_lock_timeout_seconds", "uv_venv_dir", "results_dir", "cache_dir", "_inherit_from",
    "_copy", "nemo_gym_log_dir", "verbose", "json", "query", "observability_enabled", "model_call_capture_dir",
    "token_id_capture", "component_name", "skip_verification", "skip_verification_reward",
    "allow_unsupported_pairing", "environment_server_name", "environment_server_routes",
    "environment_routing_mode",
})
"""NeMo Gym's reserved top-level keys that this launcher does not take (docs/nemo-gym.md says why)."""
NEMO_GYM_PACKAGE = "nemo_gym"
NEMO_GYM_PYTHON_ENV = "NEMO_GYM_PYTHON"
"""The interpreter of the NeMo Gym environment, for instances that do not name one (``python:``)."""
DECLARATION_KEYS = ("checkpoint_mode", "checkpoint_verify")
MISSING = "???"
DEFAULT_ENTRYPOINT = "app.py"
_M = TypeVar("_M", bound=BaseModel)


DEFAULT_MAX_DEADLINE_SECONDS = 24 * 3600.0
MAX_DEADLINE_SECONDS_BOUND = 365 * 24 * 3600.0
DEFAULT_HOST = "127.0.0.1"
"""The host of a server when neither its block nor the config's ``default_host`` names one."""
MIN_METRICS_EXPORT_INTERVAL_S = 0.1
"""The shortest ``telemetry.metrics_export_interval_s``. OpenTelemetry's own setting of it
(``OTEL_METRIC_EXPORT_INTERVAL``) is whole milliseconds (default 60000), and its SDK's reader takes any
interval above 0: at 1e-9 s it collects and exports in a busy loop, a core's worth of CPU for nothing.
A tenth of a second is already more often than any metric here changes in a way worth a point."""
DEFAULT_MAX_RECORD_BYTES = 64 * 1024 * 1024
DEFAULT_FULL_COLLECTION_INTERVAL_SECONDS = 300.0


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class HeadServerConfig(StrictModel):
    host: str = DEFAULT_HOST
    port: int = Field(11000, ge=0, le=65535)


class TelemetryConfig(StrictModel):
    """The top-level ``telemetry:`` block (NeMo Gym's key; docs/protocol.md section 9).

    Off by default, and then nothing is imported or paid. On, every server process (and the
    collector) exports with the OpenTelemetry SDK (the ``otel`` extra): ``exporter: otlp`` to
    ``otlp_endpoint`` (else ``OTEL_EXPORTER_OTLP_ENDPOINT``, else the SDK's default) over
    ``http/protobuf``, or ``console``. Checkpoint spans are the opt-in span group ``checkpoint``:
    ``span_groups: default,checkpoint``; the checkpoint metrics come whenever metrics are on.
    """

    enabled: bool = False
    span_groups: str = Field("default", max_length=256, pattern=r"^[a-z_]+(,[a-z_]+)*$")
    exporter: Literal["otlp", "console"] = "otlp"
    otlp_endpoint: str | None = Field(None, pattern=r"^https?://", max_length=2048)
    otlp_protocol: Literal["http/protobuf"] = "http/protobuf"
    otlp_headers: dict[str, str] = Field(default_factory=dict, max_length=32)
    traces_enabled: bool = True
    metrics_enabled: bool = True
    metrics_export_interval_s: float = Field(10.0, ge=MIN_METRICS_EXPORT_INTERVAL_S, le=3600)
    """Seconds between two metric exports, from ``MIN_METRICS_EXPORT_INTERVAL_S`` to an hour."""

    def groups(self) -> frozenset[str]:
        return frozenset(self.span_groups.split(","))


class PortsConfig(StrictModel):
    """Where the launcher picks the ports nobody set: the top-level keys of the same names."""

    port_range_low: int = Field(10001, ge=1, le=65535)
    port_range_high: int = Field(20000, ge=1, le=65535)
    disallowed_ports: list[int] = Field(default_factory=list)

    @field_validator("port_range_high")
    @classmethod
    def _ordered(cls, high: int, info: ValidationInfo) -> int:
        low = info.data.get("port_range_low")
        if low is not None and low > high:
            raise ValueError(f"port_range_low {low} is above port_range_high {high}")
        return high


class CheckpointConfig(StrictModel):
    """The top-level ``checkpoint:`` block (docs/protocol.md section 2).

    ``enabled``, ``control_auth_token`` and ``lease_grace_seconds`` are upstream's keys; the others
    are this project's: ``root`` (optional; when set, every ``checkpoint_dir`` must resolve inside
    it, else any absolute one is accepted), ``max_deadline_seconds`` (how far ahead of the server's
    clock a ``deadline_ts`` may be), ``max_record_bytes`` (the largest record line a restore reads) and
    ``pause_garbage_collection`` (no automatic garbage collection in a server while a checkpoint is
    open there, at most a minute at a time: ``checkpoint/collector_pause.py``) and
    ``full_collection_interval_seconds`` (a server's full garbage collections run on this schedule,
    never while a checkpoint is open, instead of Python's own; ``null`` keeps Python's:
    ``checkpoint/collector_schedule.py``).
    """

    enabled: bool = False
    control_auth_token: SecretStr | None = None
    lease_grace_seconds: float = Field(600.0, gt=0, le=MAX_DEADLINE_SECONDS_BOUND)
    root: Path | None = None
    max_deadline_seconds: float = Field(default=DEFAULT_MAX_DEADLINE_SECONDS, gt=0, le=MAX_DEADLINE_SECONDS_BOUND)
    max_record_bytes: int = Field(default=DEFAULT_MAX_RECORD_BYTES, ge=1024, le=1 << 40)
    pause_garbage_collection: bool = True
    full_collection_interval_seconds: float | None = Field(default=DEFAULT_FULL_COLLECTION_INTERVAL_SECONDS, gt=0,
                                                           le=86_400)

    @model_validator(mode="after")
    def _token_when_enabled(self) -> CheckpointConfig:
        if self.enabled and not (self.control_auth_token and self.control_auth_token.get_secret_value()):
            raise ValueError("control_auth_token is required when checkpointing is enabled")
        return self


class ServerRef(StrictModel):
    """A reference from one server to another: the instance's type key and name."""

    type: ServerType
    name: str


class Domain(StrEnum):
    """What a server trains or evaluates (NeMo Gym's values; a resources server declares one)."""

    MATH = "math"
    CODING = "coding"
    AGENT = "agent"
    KNOWLEDGE = "knowledge"
    INSTRUCTION_FOLLOWING = "instruction_following"
    LONG_CONTEXT = "long_context"
    SAFETY = "safety"
    GAMES = "games"
    TRANSLATION = "translation"
    E2E = "e2e"
    RLHF = "rlhf"
    OTHER = "other"


DatasetLicense = Literal[
    "Apache 2.0", "MIT", "Creative Commons Attribution 4.0 International",
    "Creative Commons Attribution-ShareAlike 4.0 International", "CC BY-SA 4.0", "CC BY-NC 3.0",
    "NVIDIA Internal Use Only, Do Not Distribute", "NVIDIA Evaluation Dataset License Agreement", "TBD",
    "GNU General Public License v3.0",
]


class GitlabIdentifier(StrictModel):
    dataset_name: str
    version: str
    artifact_fpath: str


class HuggingFaceIdentifier(StrictModel):
    repo_id: str
    artifact_fpath: str | None = None


class GitlabSource(GitlabIdentifier):
    type: Literal["gitlab"]


class HuggingFaceSource(HuggingFaceIdentifier):
    type: Literal["huggingface"]


class DatasetConfig(StrictModel):
    """A dataset of task rows (NeMo Gym's fields). Only ``jsonl_fpath`` is read here: the collector's
    default input; sources and prepare scripts are for NeMo Gym's own download and prepare commands."""

    name: str
    type: Literal["train", "validation", "example"]
    jsonl_fpath: Path
    license: DatasetLicense | None = None
    prepare_script: Path | None = None
    prepare_dependencies: list[str] = Field(default_factory=list)
    taskset: str | None = Field(None, min_length=1)
    num_repeats: int = Field(1, ge=1)
    source: Annotated[GitlabSource | HuggingFaceSource, Field(discriminator="type")] | None = None
    gitlab_identifier: GitlabIdentifier | None = None
    huggingface_identifier: HuggingFaceIdentifier | None = None

    @model_validator(mode="after")
    def _licensed_when_trained_on(self) -> DatasetConfig:
        if self.type in ("train", "validation") and self.license is None:
            raise ValueError(f"a {self.type} dataset needs a license (NeMo Gym requires one)")
        if self.source is not None and (self.gitlab_identifier or self.huggingface_identifier):
            raise ValueError("set source or the older gitlab_identifier/huggingface_identifier, not both")
        return self


class BenchmarkDatasetConfig(StrictModel):
    """A benchmark dataset (NeMo Gym's ``type: benchmark``), prepared by its script."""

    name: str
    type: Literal["benchmark"]
    jsonl_fpath: Path
    prepare_script: Path
    prompt_config: Path | None = None
    prepare_dependencies: list[str] = Field(default_factory=list)
    taskset: str | None = Field(None, min_length=1)
    num_repeats: int = Field(1, ge=1)
    agent: str | None = None


AnyDataset = Annotated[DatasetConfig | BenchmarkDatasetConfig, Field(discriminator="type")]


class ServerConfig(StrictModel):
    """Base of every implementation's settings (NeMo Gym's common keys); subclasses add their own fields.

    ``renamed_keys`` maps a key an implementation once had to its name now: the old key is an error
    that names the new one.
    """

    renamed_keys: ClassVar[Mapping[str, str]] = {}

    entrypoint: str = DEFAULT_ENTRYPOINT
    host: str = DEFAULT_HOST
    port: int | None = Field(None, ge=0, le=65535)
    num_workers: int | None = Field(None, ge=1, le=MAX_WORKERS)
    """Worker processes behind the server's one port (1 or unset: one process). More than one only on
    environment, agent and resources servers of this project (docs/architecture.md section 4)."""
    domain: Domain | None = None
    verified: bool = False
    verified_url: str | None = None
    description: str | None = None
    value: str | None = None
    datasets: list[AnyDataset] = Field(default_factory=list)
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024, le=1 << 32)  # larger request bodies: 413

    def validate_in_mesh(self, instances: Mapping[str, ServerInstance]) -> None:
        """Checks that need the other instances; raise ``ValueError`` (named after this block)."""


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
        ours = {"package", "python", "datasets", "max_body_bytes"}
        return self.model_dump(mode="json", exclude=ours, exclude_none=True)


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
    def folder(self) -> str:
        """The implementation's folder, e.g. ``model_servers/policy_model``."""
        return f"{FOLDER_OF_TYPE[self.type]}/{self.implementation}"

    @property
    def module(self) -> str:
        return entrypoint_module(self.type, self.implementation, self.settings.entrypoint)

    @property
    def url(self) -> str:
        return http_url(self.settings.host, self.settings.port)


@dataclass(frozen=True)
class MeshConfig:
    """The resolved, validated config of a whole mesh."""

    head_server: HeadServerConfig
    checkpoint: CheckpointConfig
    instances: dict[str, ServerInstance]
    raw: dict[str, Any]
    ports: PortsConfig = field(default_factory=lambda: PortsConfig.model_validate({}))
    telemetry: TelemetryConfig = field(default_factory=lambda: TelemetryConfig.model_validate({}))

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
        return http_url(self.head_server.host, self.head_server.port)

    def with_ports(self, ports: Mapping[str, int], head_port: int | None = None) -> MeshConfig:
        """A copy with the given instance ports (and the head port) filled in (the launcher's)."""
        raw = deep_copy(self.raw)
        for name, port in ports.items():
            inst = self.instances[name]
            block = raw[name][inst.type]
            block[inst.implementation] = {**(block[inst.implementation] or {}), "port": port}
        if head_port is not None:
            raw[HEAD_SERVER] = {**(raw.get(HEAD_SERVER) or {}), "port": head_port}
        return build_mesh(raw, origins={})


# ---- loading -------------------------------------------------------------------------------------


def load_config(paths: Sequence[str | Path], overrides: Sequence[str] = ()) -> MeshConfig:
    """Read the files (and their ``config_paths``), apply overrides and directives, interpolate, validate."""
    try:
        raw, origins = read_sources(paths, overrides)
        variables = _variables(raw, origins)
        resolved = resolve_interpolations(raw, origins)
        for name in variables:
            del resolved[name]
        return build_mesh(resolved, origins)
    except RecursionError:  # each file is at most MAX_DEPTH deep; blocks that ${...} names inside others deeper
        raise ConfigError("nested too deeply to read (${...} of blocks that nest copies of each other)") from None


def load_config_dict(raw: Mapping[str, Any]) -> MeshConfig:
    """Validate an already resolved config dict (what the launcher hands its children)."""
    return build_mesh(deep_copy(dict(raw)), origins={})


def _variables(raw: Mapping[str, Any], origins: Origins) -> list[str]:
    """Top-level keys that only hold values for ``${...}``: kept while interpolating, then dropped."""
    named = interpolation_roots(raw)
    variables = []
    for key, value in raw.items():
        if key in KNOWN_TOP_LEVEL_KEYS or _looks_like_a_server(value):
            continue
        if key not in named:
            _refuse_top_level_key(key, value, origins)
        variables.append(key)
    return variables


def _looks_like_a_server(value: Any) -> bool:
    return isinstance(value, dict) and any(key in value for key in (*SERVER_TYPES, *OLD_TYPE_KEYS))


def _refuse_top_level_key(key: str, value: Any, origins: Mapping[tuple[str, ...], str]) -> None:
    file = origin_of(origins, (key,))
    if key in NEMO_GYM_LAUNCHER_KEYS:
        raise ConfigError("a NeMo Gym launcher setting that this launcher does not take (docs/nemo-gym.md)",
                          file=file, key=key)
    got = f"; got a mapping with {sorted(value)}" if isinstance(value, dict) else ""
    raise ConfigError(
        f"unknown top-level key: expected a server instance (a mapping with one type key, one of "
        f"{', '.join(SERVER_TYPES)}), one of {', '.join(KNOWN_TOP_LEVEL_KEYS)}, or a value some ${{...}} "
        f"names{got}", file=file, key=key,
    )


# ---- validation ----------------------------------------------------------------------------------


def build_mesh(raw: dict[str, Any], origins: Mapping[tuple[str, ...], str]) -> MeshConfig:
    _refuse_missing(raw, origins, ())
    default_host = _default_host(raw, origins)
    head_block = _settings_block(raw.get(HEAD_SERVER), (HEAD_SERVER,), origins)
    head = _validate(HeadServerConfig, {"host": default_host, **head_block}, (HEAD_SERVER,), origins)
    checkpoint = _validate(CheckpointConfig, raw.get(CHECKPOINT) or {}, (CHECKPOINT,), origins)
    ports = _validate(PortsConfig, {key: raw[key] for key in PORT_KEYS if key in raw}, (), origins)
    telemetry = _validate(TelemetryConfig, raw.get(TELEMETRY) or {}, (TELEMETRY,), origins)
    instances = {}
    for name, block in raw.items():
        if name in KNOWN_TOP_LEVEL_KEYS:
            continue
        if not _looks_like_a_server(block):
            _refuse_top_level_key(name, block, origins)
        instances[name] = _build_instance(name, block, default_host, origins)
    if not instances:
        raise ConfigError("the config defines no server instance")
    _check_refs(instances, origins)
    _check_in_mesh(instances, origins)
    _check_ports(head, instances, origins)
    return MeshConfig(head, checkpoint, instances, raw, ports, telemetry)


def http_url(host: str, port: int | None) -> str:
    """``http://host:port``, an IPv6 address in brackets (``::1`` -> ``http://[::1]:port``); a port not
    yet given (None) is written as it is, as before the launcher fills it in."""
    return f"http://[{host}]:{port}" if ":" in host and not host.startswith("[") else f"http://{host}:{port}"


def default_host_of(raw: Mapping[str, Any]) -> str:
    """The host of every server (and of the head) whose block names none: the top-level
    ``default_host``, else ``DEFAULT_HOST``, as NeMo Gym's launcher reads it. The launcher, our
    servers and the bridge (a NeMo Gym server's block and its global config) all take it from here."""
    return _default_host(raw, {})


def _default_host(raw: Mapping[str, Any], origins: Mapping[tuple[str, ...], str]) -> str:
    host = raw.get("default_host") or DEFAULT_HOST
    if not isinstance(host, str):
        raise ConfigError(f"expected a host name, got {host!r}", file=origin_of(origins, ("default_host",)),
                          key="default_host")
    return host


def _settings_block(value: Any, path: tuple[str, ...], origins: Mapping[tuple[str, ...], str]) -> dict[str, Any]:
    """A block of settings: a mapping, or nothing (no settings)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"expected a mapping of settings, got a {type(value).__name__}: {value!r:.60}",
                          file=origin_of(origins, path), key=".".join(path))
    return value


def _refuse_missing(node: Any, origins: Mapping[tuple[str, ...], str], path: tuple[str, ...]) -> None:
    if node == MISSING:
        override = f"++{'.'.join(path)}=<value>"
        raise ConfigError(f"required value is missing (???): set it, e.g. {override}",
                          file=origin_of(origins, path), key=".".join(path))
    if isinstance(node, dict):
        for key, value in node.items():
            _refuse_missing(value, origins, (*path, str(key)))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            _refuse_missing(value, origins, (*path, str(index)))


def _build_instance(
    name: str, block: dict[str, Any], default_host: str, origins: Mapping[tuple[str, ...], str]
) -> ServerInstance:
    file = origin_of(origins, (name,))
    for old, new in OLD_TYPE_KEYS.items():
        if old in block:
            raise ConfigError(f"{old!r} is the old type key: write {new!r} (NeMo Gym's name; the folder "
                              f"{FOLDER_OF_TYPE[new]}/ keeps its name)", file=file, key=f"{name}.{old}")
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
    settings = {"host": default_host, **_settings_block(settings, path, origins)}
    _refuse_old_refs(settings, path, origins)
    config_class: type[ServerConfig]
    if "package" in settings:
        if server_type != "resources_servers":
            raise ConfigError(f"only resources servers of the {NEMO_GYM_PACKAGE} package run in this mesh",
                              file=file, key=".".join((*path, "package")))
        config_class = NemoGymServerConfig
    else:
        entrypoint = settings.get("entrypoint", DEFAULT_ENTRYPOINT)
        config_class = config_class_for(server_type, implementation, entrypoint, origins, path)
    _refuse_renamed_keys(config_class, settings, path, origins)
    validated = _validate(config_class, settings, path, origins)
    _refuse_workers_where_unsupported(validated, server_type, path, origins)
    return ServerInstance(name, cast(ServerType, server_type), implementation, validated)


def _refuse_workers_where_unsupported(
    settings: ServerConfig, server_type: str, path: tuple[str, ...], origins: Mapping[tuple[str, ...], str]
) -> None:
    """``num_workers`` > 1 is for our environment, agent and resources servers: a model server holds
    one engine and one capture ledger, and NeMo Gym's own servers run in their own launcher."""
    if (settings.num_workers or 1) == 1:
        return
    key = ".".join((*path, "num_workers"))
    if server_type == "responses_api_models":
        raise ConfigError("num_workers > 1 is refused on a model server (the policy model's capture ledger and "
                          "the worker's engine live in one process): leave it unset or 1",
                          file=origin_of(origins, path), key=key)
    if is_nemo_gym(settings):
        raise ConfigError(f"num_workers > 1 is refused on a {NEMO_GYM_PACKAGE} package server: leave it unset or 1",
                          file=origin_of(origins, path), key=key)


def _refuse_old_refs(node: Any, path: tuple[str, ...], origins: Mapping[tuple[str, ...], str]) -> None:
    if isinstance(node, dict):
        old = node.get("type")
        if set(node) == {"type", "name"} and isinstance(old, str) and old in OLD_TYPE_KEYS:
            key = (*path, "type")
            raise ConfigError(f"reference type {old!r} is the old type key: write type: {OLD_TYPE_KEYS[old]}",
                              file=origin_of(origins, key), key=".".join(key))
        for key, value in node.items():
            _refuse_old_refs(value, (*path, str(key)), origins)
    elif isinstance(node, list):
        for index, value in enumerate(node):
            _refuse_old_refs(value, (*path, str(index)), origins)


def _refuse_renamed_keys(config_class: type[ServerConfig], settings: Mapping[str, Any], path: tuple[str, ...],
                         origins: Mapping[tuple[str, ...], str]) -> None:
    for old, new in config_class.renamed_keys.items():
        if old in settings:
            key = (*path, old)
            raise ConfigError(f"{old!r} is now {new!r} (NeMo Gym's name)", file=origin_of(origins, key),
                              key=".".join(key))


def entrypoint_module(server_type: str, implementation: str, entrypoint: str) -> str:
    """The module of ``<folder>/<implementation>/<entrypoint>``, e.g. ``agents.simple_agent.app``."""
    parts = PurePosixPath(entrypoint).with_suffix("").parts
    return ".".join((FOLDER_OF_TYPE[server_type], implementation, *parts))


def _entrypoint_problem(entrypoint: Any) -> str | None:
    if not isinstance(entrypoint, str):
        return f"expected a file name such as app.py, got {entrypoint!r}"
    path = PurePosixPath(entrypoint)
    if path.is_absolute() or path.suffix != ".py" or any(not p.isidentifier() for p in path.with_suffix("").parts):
        return (f"expected a .py file inside the implementation folder (e.g. app.py), got {entrypoint!r}")
    return None


def config_class_for(
    server_type: str, implementation: str, entrypoint: Any, origins: Mapping[tuple[str, ...], str],
    path: tuple[str, ...],
) -> type[ServerConfig]:
    """The ``Config`` class declared by ``<folder>/<implementation>/<entrypoint>``."""
    file = origin_of(origins, (*path, "entrypoint")) or origin_of(origins, path)
    problem = _entrypoint_problem(entrypoint)
    if problem:
        raise ConfigError(problem, file=file, key=".".join((*path, "entrypoint")))
    folder = f"{FOLDER_OF_TYPE[server_type]}/{implementation}"
    module_name = entrypoint_module(server_type, implementation, entrypoint)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name and (module_name == error.name or module_name.startswith(error.name + ".")):
            if error.name.count(".") >= 2:
                raise ConfigError(f"no entrypoint {entrypoint} in {folder}/", file=file,
                                  key=".".join((*path, "entrypoint"))) from None
            raise ConfigError(f"unknown implementation {implementation!r} under {server_type} (no folder "
                              f"{folder}/)", file=file, key=".".join(path)) from None
        raise
    config_class = getattr(module, "Config", None)
    if not (isinstance(config_class, type) and issubclass(config_class, ServerConfig)):
        raise ConfigError(f"{module_name} declares no Config(ServerConfig) class", file=file, key=".".join(path))
    return config_class


def _validate(
    model: type[_M], data: Any, path: tuple[str, ...], origins: Mapping[tuple[str, ...], str]
) -> _M:
    try:
        return model.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        loc = tuple(str(part) for part in first["loc"])
        if first["type"] == "union_tag_not_found":  # the discriminator (a dataset's type) is missing
            loc, first = (*loc, "type"), {**first, "type": "missing"}
        full = (*path, *_without_union_tags(loc))
        raise ConfigError(
            _describe(first), file=origin_of(origins, full) or origin_of(origins, path), key=".".join(full)
        ) from None


def _without_union_tags(loc: tuple[str, ...]) -> tuple[str, ...]:
    """Pydantic names the union member in a location (``datasets.0.example.license``); the key has none."""
    tags = {"train", "validation", "example", "benchmark", "gitlab", "huggingface"}
    return tuple(part for index, part in enumerate(loc)
                 if not (part in tags and index and (loc[index - 1].isdigit() or loc[index - 1] == "source")))


def _describe(error: Any) -> str:
    if error["type"] == "extra_forbidden":
        return "unknown key"
    if error["type"] == "missing":
        return "required value is missing"
    message = str(error["msg"]).removeprefix("Value error, ")
    return f"{message} (got {error.get('input')!r})"


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


def _check_in_mesh(instances: dict[str, ServerInstance], origins: Mapping[tuple[str, ...], str]) -> None:
    for inst in instances.values():
        path = (inst.name, inst.type, inst.implementation)
        try:
            inst.settings.validate_in_mesh(instances)
        except ValueError as error:
            raise ConfigError(str(error), file=origin_of(origins, path), key=".".join(path)) from None


def _check_ports(
    head: HeadServerConfig, instances: dict[str, ServerInstance], origins: Mapping[tuple[str, ...], str]
) -> None:
    """Two servers never share a port (0 or unset: the launcher picks a free one)."""
    owners = {head.port: HEAD_SERVER} if head.port else {}
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
