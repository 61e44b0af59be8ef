"""Where the worker's model lives: the embedded default, or a configured ``model_path``.

The default model ships inside the package (``default_model/`` next to this file, built by
``scripts/build_default_model.py``): a Hugging Face model folder that loads offline.
"""

from __future__ import annotations

from pathlib import Path

from nemo_gym_ckpt.errors import ConfigError

__all__ = [
    "DEFAULT_MODEL_DIR",
    "REQUIRED_FILES",
    "check_model_dir",
    "model_dir_problem",
    "resolve_model_path",
]

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "default_model"
REQUIRED_FILES = ("config.json", "tokenizer_config.json")
_BUILD_HINT = "build it with: python scripts/build_default_model.py"


def model_dir_problem(path: Path) -> str | None:
    """What keeps ``path`` from being a model folder an engine can load (None: nothing)."""
    if not path.is_dir():
        return f"model folder {path} does not exist"
    missing = [name for name in REQUIRED_FILES if not (path / name).is_file()]
    if missing:
        return f"model folder {path} lacks {', '.join(missing)}"
    return None


def check_model_dir(path: Path) -> Path:
    """``path`` if it is a model folder with the files an engine needs; else ``ConfigError``."""
    problem = model_dir_problem(path)
    if problem is not None:
        raise ConfigError(problem, key="model_path")
    return path


def resolve_model_path(model_path: Path | None, *, must_exist: bool = True) -> Path:
    """The absolute model folder: ``model_path`` (relative to the working directory) or the default.

    With ``must_exist=False`` a path that is not a local folder passes unchanged (vLLM may resolve
    it as a hub name from its own cache).
    """
    if model_path is None:
        if not DEFAULT_MODEL_DIR.is_dir():
            raise ConfigError(f"the embedded default model is missing at {DEFAULT_MODEL_DIR}; {_BUILD_HINT}")
        return check_model_dir(DEFAULT_MODEL_DIR)
    path = model_path.expanduser()
    if path.exists() or must_exist:
        return check_model_dir(path.resolve())
    return model_path
