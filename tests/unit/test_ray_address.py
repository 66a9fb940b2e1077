"""An unreachable Ray address fails at once with one line, instead of ``ray.init``
retrying for minutes in a thread that SIGTERM cannot interrupt (found by a new-user
trial: `rollout run --shards 2 --shard-backend ray --ray-address 127.0.0.1:1` hung)."""

from __future__ import annotations

import socket

import pytest

from engine.ray_cluster import check_ray_address


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("form", ["127.0.0.1:{port}", "ray://127.0.0.1:{port}"])
def test_an_unreachable_address_raises_connection_error_naming_it(form):
    address = form.format(port=_free_port())  # bound and closed: nothing listens there
    with pytest.raises(ConnectionError, match="cannot connect") as info:
        check_ray_address(address, timeout_s=2.0)
    assert address in str(info.value) and "ray start --head" in str(info.value)


def test_a_listening_address_passes_and_auto_is_left_to_ray():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        check_ray_address(f"127.0.0.1:{server.getsockname()[1]}", timeout_s=2.0)
    check_ray_address("auto")  # no port: Ray resolves it (returns without connecting)
