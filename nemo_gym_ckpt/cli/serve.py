"""Entry point of one server process: ``python -m nemo_gym_ckpt.cli.serve <instance>``.

The launcher starts it (``nemo_gym_ckpt.launch.child`` says with what); it serves the instance's app
with uvicorn (uvloop and httptools) and exits with ``ExitCode.USAGE`` on a config error.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import cast

import uvicorn

from nemo_gym_ckpt.cli.exit_codes import ExitCode
from nemo_gym_ckpt.errors import ConfigError
from nemo_gym_ckpt.launch.child import PARENT_ENV, SERVE_MODULE, build_app, exit_orphaned, load_mesh, watch_parent

__all__ = ["SERVER_KEEPALIVE_S", "main"]

SERVER_KEEPALIVE_S = 60

logger = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {SERVE_MODULE}")
    parser.add_argument("instance")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request blocks the event loop
    if PARENT_ENV in os.environ:
        watch_parent(int(os.environ[PARENT_ENV]), exit_orphaned)
    try:
        mesh = load_mesh()
        instance = mesh.instance(args.instance)
    except ConfigError as error:
        logger.error("config error: %s", error)
        raise SystemExit(ExitCode.USAGE) from None
    app = build_app(mesh, args.instance)
    uvicorn.run(
        app,
        host=instance.settings.host,
        port=cast(int, instance.settings.port),
        loop="uvloop",
        http="httptools",
        log_level="warning",
        timeout_graceful_shutdown=5,
        # The mesh client drops an idle pooled connection after KEEPALIVE_S (2 s); a server that
        # closed idle ones after uvicorn's 5 s left a starved client (an event loop seconds late on
        # 2 busy cores) reusing connections already closed: the scale bench lost rollouts that way.
        timeout_keep_alive=SERVER_KEEPALIVE_S,
    )


if __name__ == "__main__":
    main()
