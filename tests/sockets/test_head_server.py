"""The head server and port assignment, on real sockets (uvicorn in a thread, 127.0.0.1 only)."""

from __future__ import annotations

import asyncio
import random
import socket
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from nemo_gym_ckpt import cli
from nemo_gym_ckpt.config import MeshConfig, load_config
from nemo_gym_ckpt.launch.child import SERVER_KEEPALIVE_S
from nemo_gym_ckpt.launch.head import ThreadedServer, bind_socket, create_head_app, server_entries
from nemo_gym_ckpt.launch.launcher import (
    PORT_RANGE,
    PORT_RANGE_ENV,
    LaunchError,
    MeshLauncher,
    assign_ports,
    find_free_port,
    wait_for_health,
)
from nemo_gym_ckpt.launch.workers import BACKLOG, bind_listener
from nemo_gym_ckpt.server import create_app

pytestmark = pytest.mark.sockets

FIXTURES = Path(__file__).parents[1] / "fixtures"


class ScriptedRandom(random.Random):
    """A ``random.Random`` whose ``randint`` answers from a script (then from the seeded stream)."""

    def __init__(self, script: list[int]) -> None:
        super().__init__(7)
        self.script = list(script)

    def randint(self, a: int, b: int) -> int:
        return self.script.pop(0) if self.script else super().randint(a, b)


@pytest.fixture
def occupied() -> Iterator[Callable[[], int]]:
    """Bind (without listening) ports in ``PORT_RANGE`` on 127.0.0.1, so nothing else can."""
    socks: list[socket.socket] = []

    def take() -> int:
        sock = socket.socket()
        socks.append(sock)
        sock.bind(("127.0.0.1", find_free_port("127.0.0.1")))
        return int(sock.getsockname()[1])

    yield take
    for sock in socks:
        sock.close()


def two_servers() -> MeshConfig:
    return load_config([FIXTURES / "two_string_match.yaml"], ["head_server.port=0"])


def test_servers_lists_every_instance(serve_app: Callable[[Any], str]) -> None:
    mesh = two_servers().with_ports({"sm": 15301, "sm_loose": 15302}, head_port=15300)
    url = serve_app(create_head_app(mesh))
    with httpx.Client(trust_env=False, timeout=5.0) as http:
        listing = http.get(f"{url}/servers")
        health = http.get(f"{url}/health")
        missing = http.get(f"{url}/servers/sm")
    assert listing.status_code == 200
    assert listing.json() == [
        {"name": "sm", "type": "resources_servers", "implementation": "string_match",
         "url": "http://127.0.0.1:15301"},
        {"name": "sm_loose", "type": "resources_servers", "implementation": "string_match",
         "url": "http://127.0.0.1:15302"},
    ]
    assert listing.json() == server_entries(mesh)
    assert health.json() == {"status": "ok", "name": "head_server"}
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def test_threaded_server_frees_its_port_and_refuses_a_taken_one() -> None:
    server = ThreadedServer(create_app("probe"), "127.0.0.1", 0)
    server.start()
    port = server.port
    wait_for_health(server.url, timeout_s=5.0, name="probe")
    with pytest.raises(OSError), ThreadedServer(create_app("second"), "127.0.0.1", port):
        pass
    server.stop()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))  # nothing listens there any more
    with pytest.raises(httpx.ConnectError), httpx.Client(trust_env=False) as http:
        http.get(f"http://127.0.0.1:{port}/health")


@pytest.mark.parametrize("bind", [bind_socket, bind_listener], ids=["threaded_server", "worker"])
async def test_connections_to_our_listeners_send_without_waiting_for_acks(
    bind: Callable[[str, int], socket.socket],
) -> None:
    """uvicorn writes a reply's head and its body apart: with Nagle's algorithm on, the body waited for
    the client's delayed ACK (about 40 ms a reply). asyncio turns it off (``TCP_NODELAY``) on the
    connections it accepts, as uvicorn serves our listeners, when the socket is made as TCP."""
    loop = asyncio.get_running_loop()
    accepted: asyncio.Future[asyncio.BaseTransport] = loop.create_future()

    class Accept(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            if not accepted.done():
                accepted.set_result(transport)

    listener = bind("127.0.0.1", 0)
    server = await loop.create_server(Accept, sock=listener)
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", listener.getsockname()[1])
        try:
            transport = await asyncio.wait_for(accepted, 10.0)
            nodelay = transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            transport.close()
        finally:
            writer.close()
            await writer.wait_closed()
    finally:
        server.close()
        await server.wait_closed()
    assert nodelay != 0


def test_wait_for_health_has_a_deadline(serve_app: Callable[[Any], str], occupied: Callable[[], int]) -> None:
    url = serve_app(create_app("somebody"))
    wait_for_health(url, timeout_s=5.0, name="somebody")
    with pytest.raises(TimeoutError, match=r"did not answer within 0\.3 s"):
        wait_for_health(url, timeout_s=0.3, name="somebody_else")
    with pytest.raises(TimeoutError):
        wait_for_health(f"http://127.0.0.1:{occupied()}", timeout_s=0.3)


def test_assign_ports_fills_every_unset_port_with_a_distinct_free_one() -> None:
    placed = assign_ports(two_servers())
    ports = [placed.head_server.port, *(inst.settings.port for inst in placed.instances.values())]
    assert all(port is not None and PORT_RANGE[0] <= port <= PORT_RANGE[1] for port in ports)
    assert len(set(ports)) == 3
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_assign_ports_keeps_configured_ports_and_avoids_them() -> None:
    mesh = load_config([FIXTURES / "two_string_match.yaml"],
                       ["head_server.port=15400", "sm.resources_servers.string_match.port=15401"])
    free = find_free_port("127.0.0.1", avoid={15400, 15401})  # a fixed third port was in use once in CI
    placed = assign_ports(mesh, rng=ScriptedRandom([15400, 15401, free]))
    assert placed.head_server.port == 15400
    assert placed.url_of("sm") == "http://127.0.0.1:15401"
    assert placed.url_of("sm_loose") == f"http://127.0.0.1:{free}"


def test_assign_ports_skips_ports_in_use(occupied: Callable[[], int]) -> None:
    busy, other_busy = occupied(), occupied()
    free = find_free_port("127.0.0.1", avoid={busy, other_busy})
    placed = assign_ports(two_servers(), rng=ScriptedRandom([busy, free, other_busy, busy]))
    ports = {placed.head_server.port, *(inst.settings.port for inst in placed.instances.values())}
    assert free in ports and busy not in ports and other_busy not in ports and len(ports) == 3


def test_assign_ports_avoids_the_ports_of_meshes_not_started_yet() -> None:
    first = find_free_port("127.0.0.1")
    second = find_free_port("127.0.0.1", avoid={first})
    third = find_free_port("127.0.0.1", avoid={first, second})
    fourth = find_free_port("127.0.0.1", avoid={first, second, third})
    placed = assign_ports(two_servers(), rng=ScriptedRandom([first, second, first, third, second, fourth]),
                          avoid={first, second})  # free now, but another mesh's once it starts
    ports = {placed.head_server.port, *(inst.settings.port for inst in placed.instances.values())}
    assert first not in ports and second not in ports and len(ports) == 3


def test_the_port_range_variable_applies_where_the_config_sets_no_range(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PORT_RANGE_ENV, "17001-17040")
    placed = assign_ports(two_servers())
    ports = [placed.head_server.port, *(inst.settings.port for inst in placed.instances.values())]
    assert all(port is not None and 17001 <= port <= 17040 for port in ports), ports
    configured = load_config([FIXTURES / "two_string_match.yaml"],
                             ["head_server.port=0", "+port_range_low=12001", "+port_range_high=12010"])
    ports = [inst.settings.port for inst in assign_ports(configured).instances.values()]
    assert all(port is not None and 12001 <= port <= 12010 for port in ports), ports  # the config wins
    for text in ("17001", "17040-17001", "a-b", "1-70000"):
        monkeypatch.setenv(PORT_RANGE_ENV, text)
        with pytest.raises(LaunchError, match=f"{PORT_RANGE_ENV}=.*expected LOW-HIGH"):
            assign_ports(two_servers())


def test_find_free_port_gives_up_when_nothing_is_free(occupied: Callable[[], int]) -> None:
    busy = occupied()
    with pytest.raises(LaunchError, match="found no free port"):
        find_free_port("127.0.0.1", rng=ScriptedRandom([busy] * 200))


def test_the_launcher_fails_fast_when_the_head_port_is_taken(occupied: Callable[[], int]) -> None:
    busy = occupied()
    mesh = load_config([FIXTURES / "string_match.yaml"], [f"head_server.port={busy}"])
    launcher = MeshLauncher(mesh)
    with pytest.raises(LaunchError, match=f"head server cannot listen on 127.0.0.1:{busy}"):
        launcher.start(ready_timeout_s=5.0)
    assert launcher.pids == {}, "no server process may be started without a head server"
    assert launcher.stop() == []


def test_run_exits_1_with_one_line_when_the_mesh_cannot_start(
    occupied: Callable[[], int], capsys: pytest.CaptureFixture[str]
) -> None:
    busy = occupied()
    assert cli.main(["run", str(FIXTURES / "string_match.yaml"), f"head_server.port={busy}"]) == 1
    err = capsys.readouterr().err
    reason = f"head server cannot listen on 127.0.0.1:{busy}: Address already in use"
    assert err == f"nemo-gym-ckpt run: {reason}\n"


def _listen_queue(sock: socket.socket) -> int:
    """The kernel's bound on ``sock``'s queue of connections not yet accepted (a listening socket's
    ``tcp_info.tcpi_sacked`` on Linux: what ``ss -ltn`` shows as Send-Q)."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    return struct.unpack_from("I", info, 28)[0]


def test_the_head_listens_with_every_servers_queue() -> None:
    """uvicorn listens again on a socket it is handed, with its own ``backlog`` (2,048 unless told)."""
    expected = min(BACKLOG, int(Path("/proc/sys/net/core/somaxconn").read_text()))
    with ThreadedServer(create_app("probe"), "127.0.0.1", 0) as server:
        assert server._socket is not None
        assert _listen_queue(server._socket) == expected
        assert server._server is not None and server._server.config.timeout_keep_alive == SERVER_KEEPALIVE_S
