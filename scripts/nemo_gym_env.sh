#!/usr/bin/env bash
# The one Python environment of NeMo Gym in this project (docs/verifiers.md): a Python 3.13 venv with
# nemo-gym 0.7.0 and the requirements of every one of its training verifiers that runs here
# (scripts/nemo-gym-requirements.txt), pinned by scripts/nemo-gym-constraints.txt. NeMo Gym's servers
# in our mesh run in it (the launcher's $NEMO_GYM_PYTHON), and so does the interop tier
# (tests/interop/, $NEMO_GYM_INTEROP_PYTHON). Built from the package registries on the first call and
# cached outside the checkout under a key made of those pins; a later call with the same pins reuses
# it (no install, well under a second).
#
#   export NEMO_GYM_PYTHON=$(scripts/nemo_gym_env.sh)       # .ci/run does this
#
# Prints only the interpreter's path on stdout; progress goes to stderr. Settings (environment):
#   NEMO_GYM_ENV_CACHE        cache folder (default: ${XDG_CACHE_HOME:-~/.cache}/nemo-gym-ckpt/env)
#   NEMO_GYM_BASE_PYTHON      a python3.13 to build the venv from (default: python3.13 on PATH, else
#                             the newest 3.13 under pyenv)
# The wheel declares Requires-Python >= 3.13.14; older 3.13 patch releases run it (every dependency
# has a cp313 wheel), so it is fetched for 3.13.14 and installed with --ignore-requires-python.
set -euo pipefail

NEMO_GYM_VERSION=0.7.0
NEMO_GYM_WHEEL_SHA256=cce78fc3fd048f36b4c465fe8e9fe3cc5e7afb6f6e287bfe831f156988508a70
PYTHON_SERIES=3.13
WHEEL_PYTHON_VERSION=3.13.14

here=$(cd "$(dirname "$0")" && pwd)
requirements="$here/nemo-gym-requirements.txt"
constraints="$here/nemo-gym-constraints.txt"
pins() {
    printf '%s\n' "$NEMO_GYM_VERSION" "$NEMO_GYM_WHEEL_SHA256" "$PYTHON_SERIES"
    grep -v '^#' "$requirements"
    if [ -f "$constraints" ]; then grep -v '^#' "$constraints"; fi
}
key=$(pins | sha256sum | cut -c1-12)
cache_root=${NEMO_GYM_ENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/nemo-gym-ckpt/env}
venv="$cache_root/nemo-gym-$NEMO_GYM_VERSION-py$PYTHON_SERIES-$key"

say() { echo "nemo_gym_env: $*" >&2; }

if [ -f "$venv/.complete" ]; then
    echo "$venv/bin/python"
    exit 0
fi

candidates() {
    if [ -n "${NEMO_GYM_BASE_PYTHON:-}" ]; then
        echo "$NEMO_GYM_BASE_PYTHON"
        return
    fi
    if command -v pyenv >/dev/null 2>&1; then
        ls -d "$(pyenv root)/versions/$PYTHON_SERIES".*/bin/"python$PYTHON_SERIES" 2>/dev/null | sort -rV
    fi
    command -v "python$PYTHON_SERIES" 2>/dev/null || true   # may be a pyenv shim that refuses to run
}

base_python() {
    local candidate
    for candidate in $(candidates); do
        if "$candidate" -c "import sys; assert sys.version_info[:2] == (${PYTHON_SERIES/./, })" >/dev/null 2>&1; then
            echo "$candidate"
            return
        fi
    done
}

mkdir -p "$cache_root"
exec 9>"$cache_root/.lock"
flock 9                                   # one install at a time; a waiting caller then reuses it
if [ -f "$venv/.complete" ]; then
    echo "$venv/bin/python"
    exit 0
fi

python=$(base_python)
if [ -z "$python" ]; then
    say "no Python $PYTHON_SERIES found (set NEMO_GYM_BASE_PYTHON, or put python$PYTHON_SERIES on PATH)"
    exit 1
fi

say "installing nemo-gym $NEMO_GYM_VERSION and the verifiers' requirements into $venv" \
    "(Python $("$python" -c 'import platform; print(platform.python_version())'))"
started=$SECONDS
rm -rf "$venv"
"$python" -m venv "$venv"
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
"$venv/bin/pip" download -q --no-deps --python-version "$WHEEL_PYTHON_VERSION" --only-binary=:all: \
    -d "$wheels" "nemo-gym==$NEMO_GYM_VERSION" >&2
wheel=$(ls "$wheels"/nemo_gym-"$NEMO_GYM_VERSION"-*.whl)
got=$(sha256sum "$wheel" | cut -d' ' -f1)
if [ "$got" != "$NEMO_GYM_WHEEL_SHA256" ]; then
    say "$(basename "$wheel") has sha256 $got, expected $NEMO_GYM_WHEEL_SHA256"
    exit 1
fi
pinned=()
if [ -f "$constraints" ]; then pinned=(-c "$constraints"); fi
"$venv/bin/pip" install -q --ignore-requires-python "${pinned[@]}" "$wheel" -r "$requirements" >&2
"$venv/bin/python" -c "import nemo_gym; assert nemo_gym.__version__ == '$NEMO_GYM_VERSION', nemo_gym.__version__"
touch "$venv/.complete"
say "installed in $((SECONDS - started)) s"
echo "$venv/bin/python"
