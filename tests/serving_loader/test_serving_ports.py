"""`evstore serve` checks its ports before it loads anything: a port it cannot listen on is one
line at once, naming the API (REST, admin, gRPC), the address and the flag that moves it. Each
test serves an export that does not exist: had the model been loaded first, the error would be
about the export."""
import socket

import pytest

from serve_proc import evstore, last_line
from serving_loader.server import PortError, serve


@pytest.fixture
def taken():
    """A port another process listens on."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    try:
        yield s.getsockname()[1]
    finally:
        s.close()


def test_a_rest_port_in_use_is_one_line_naming_the_flag_before_the_model_loads(taken, tmp_path):
    p = evstore("serve", "--export", str(tmp_path / "no-export"), "--rest_api_port", str(taken), "--port", "0")
    assert p.returncode == 1 and not p.stdout
    assert last_line(p.stderr) == (f"evstore serve: REST port {taken} on 127.0.0.1 is in use (another server?): "
                                   "--rest_api_port chooses another, -1 turns REST off")


def test_an_admin_port_in_use_names_the_admin_flag(taken, tmp_path):
    with pytest.raises(PortError) as e:
        serve(str(tmp_path / "no-export"), port=None, rest_api_port=0, admin_port=taken)
    assert str(e.value) == (f"admin port {taken} on 127.0.0.1 is in use (another server?): --admin_port chooses "
                            "another, -1 turns admin off")


def test_a_grpc_port_in_use_names_the_grpc_flag(taken, tmp_path):
    from serving_loader.native import grpc_frontend_built

    if not grpc_frontend_built():
        pytest.skip("this build has no gRPC front end (libnghttp2 missing): serve answers REST only")
    with pytest.raises(PortError) as e:
        serve(str(tmp_path / "no-export"), port=taken, rest_api_port=0, admin_port=-1)
    assert str(e.value) == (f"gRPC port {taken} on 127.0.0.1 is in use (another server?): --port chooses another, "
                            "-1 turns gRPC off")
