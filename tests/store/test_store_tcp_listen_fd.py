"""TCPStore(master_listen_fd=...): the store serves on a socket the caller bound, holding a
descriptor of its own, and a number that is not a listening-capable socket is a clear error."""

import socket
from datetime import timedelta

import pytest

import elastix


def test_serves_on_the_given_socket_and_keeps_its_own_descriptor():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    master = elastix.TCPStore(
        "127.0.0.1", port, is_master=True, master_listen_fd=sock.fileno(), timeout=timedelta(seconds=10)
    )
    sock.close()  # ours to close: the store duplicated it
    client = elastix.TCPStore("127.0.0.1", port, timeout=timedelta(seconds=10))
    client.set("k", b"v")
    assert master.get("k") == b"v"


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: (None, 2**20), "not an open descriptor"),
        (lambda: (f := open(__file__), f.fileno()), "not a socket"),
        (lambda: (s := socket.socket(type=socket.SOCK_DGRAM), s.fileno()), "not a stream socket"),
        (lambda: (s := socket.socket(), s.fileno()), "not bound to a port"),
    ],
)
def test_a_bad_descriptor_is_a_value_error(make, message):
    owner, fd = make()
    try:
        with pytest.raises(ValueError, match=message):
            elastix.TCPStore("127.0.0.1", 0, is_master=True, master_listen_fd=fd, timeout=timedelta(seconds=5))
    finally:
        if owner is not None:
            owner.close()
