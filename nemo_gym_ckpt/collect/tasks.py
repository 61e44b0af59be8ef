"""Task rows for a collection: where the input file is, and reading it.

``--input`` paths are tried against the working directory, then the project root (so
``resources_servers/<name>/data/...`` works from anywhere); without ``--input`` the environment's
first declared dataset is used (or its agent's, where NeMo Gym's configs declare them). The input
must be a regular file: a FIFO or a process substitution (``--input <(cmd)``) is refused, since the
rows are read more than once; a device is never read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nemo_gym_ckpt.collect.rows import read_jsonl
from nemo_gym_ckpt.config import PROJECT_ROOT, MeshConfig
from nemo_gym_ckpt.errors import UsageError

__all__ = ["default_input", "read_tasks", "resolve_input"]


def resolve_input(path: Path) -> Path:
    """``path`` as given if absolute; else against the working directory, then the project root."""
    candidates = [path] if path.is_absolute() else [Path.cwd() / path, PROJECT_ROOT / path]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
        if candidate.exists():
            raise UsageError(f"input {candidate} is not a regular file: the collector reads the task rows "
                             f"more than once (before and after it launches the mesh); write them to a file")
    raise UsageError(f"input file {path} not found (tried {', '.join(str(c) for c in candidates)})")

def read_tasks(path: Path, limit: int | None) -> list[dict[str, Any]]:
    try:
        tasks = list(read_jsonl(path))
    except ValueError as error:
        raise UsageError(str(error)) from None
    except OSError as error:  # replaced by a FIFO or a device since ``resolve_input``: never read
        raise UsageError(f"cannot read the input {path}: {error.strerror or error}") from None
    tasks = tasks[:limit] if limit else tasks
    if not tasks:
        raise UsageError(f"{path} holds no task rows")
    return tasks

def default_input(mesh: MeshConfig | None, environment: str) -> Path:
    """The first dataset of the environment server, else of its agent (where NeMo Gym's configs put them)."""
    if mesh is None:
        raise UsageError("pass --input, or --config so that the environment's dataset can be found")
    settings = mesh.instance(environment).settings
    datasets = settings.datasets
    agent = getattr(settings, "agent_server", None)
    if not datasets and agent is not None and agent.name in mesh.instances:
        datasets = mesh.instance(agent.name).settings.datasets
    if not datasets:
        raise UsageError(f"environment {environment} (and its agent) declares no datasets; pass --input")
    return datasets[0].jsonl_fpath
