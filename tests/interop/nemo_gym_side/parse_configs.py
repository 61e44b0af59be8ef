"""NeMo Gym 0.7.0's own config parser, offline, on config files (run by the interop tier's Python).

usage: python parse_configs.py CASES_JSON
CASES_JSON is a JSON list of ``{"id", "paths", "overrides"}``: each case parses those files (as
``config_paths``) with those ``key=value`` overrides, with no command line, no ``env.yaml`` and no
port probing. Prints one JSON line, ``{id: {"servers": [...], "almost": [...]}}`` per case, each
server ``{"name", "type", "implementation", "agent_server"}`` (the name of the agent an environment
server fronts, else null); a case the parser refuses gets ``{"error": "<class>: <message>"}``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from nemo_gym.config_types import ConfigError
from nemo_gym.global_config import GlobalConfigDictParser, GlobalConfigDictParserConfig
from omegaconf import OmegaConf


def parse(paths: list[str], overrides: list[str]) -> dict[str, Any]:
    parser = GlobalConfigDictParser()
    initial = OmegaConf.merge(OmegaConf.create({"config_paths": paths}), OmegaConf.from_dotlist(overrides))
    try:
        config = parser.parse(GlobalConfigDictParserConfig(
            initial_global_config_dict=initial, skip_load_from_cli=True, skip_load_from_dotenv=True, offline=True))
    except ConfigError as error:
        return {"error": f"{type(error).__name__}: {error}"[:3000]}
    servers = []
    for server in parser.filter_for_server_instance_configs(config):
        inner = server.get_inner_run_server_config_dict()
        agent = inner.get("agent_server") if server.SERVER_TYPE == "environment_servers" else None
        servers.append({"name": server.name, "type": server.SERVER_TYPE,
                        "implementation": next(iter(getattr(server, server.SERVER_TYPE))),
                        "agent_server": agent.get("name") if agent is not None else None})
    almost = [name for name, _ in parser.detect_and_report_almost_servers(config)]
    return {"servers": servers, "almost": almost}


def main() -> None:
    cases = json.loads(sys.argv[1])
    results = {case["id"]: parse(case["paths"], case.get("overrides", [])) for case in cases}
    sys.stdout.write(json.dumps(results) + "\n")


if __name__ == "__main__":
    main()
