"""The server's public ports, claimed by the supervisor before any child starts.

The frontends share each port among themselves with SO_REUSEPORT, which also lets any other process of the
same user that sets it (a second infercache) join them, and take a share of the new connections, without a
word. So the supervisor first binds each port without SO_REUSEPORT (with SO_REUSEADDR, as the frontends:
connections of an earlier run left in TIME_WAIT do not count). That bind fails while anything listens
there, whatever its options, and the server refuses to start, saying so in one line.

The port is then held for the server's life by a socket bound with SO_REUSEPORT and never listening: it
takes no connections, the frontends (and a restarted one, while its siblings hold the port or all are
down) still bind beside it, and another server's first bind, or any program's bind without SO_REUSEPORT,
fails against it. Held without SO_REUSEADDR where it can be (then even a bind with SO_REUSEADDR fails
against it); where TIME_WAIT connections of a program without SO_REUSEPORT refuse that, with it.
"""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass


class PortUnavailable(Exception):
    """A port the server cannot take: the one line to say why."""


@dataclass(frozen=True)
class Port:
    host: str
    port: int
    setting: str   # the setting that names it (server.port)
    option: str    # how to choose another (--port)
    hold: bool = True  # False: only checked (the supervisor binds it itself at once: /metrics)


def _addresses(host: str, port: int) -> list[tuple]:
    """(family, sockaddr) for each address the frontends bind for `host` (a name may have several)."""
    found = socket.getaddrinfo(host.strip("[]") or None, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0,
                               socket.AI_PASSIVE)
    return list(dict.fromkeys((family, sockaddr) for family, _, _, _, sockaddr in found))


def _bind(family: int, sockaddr: tuple, *, reuse_address: bool, reuse_port: bool) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if reuse_address:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6 and sockaddr[0] == "::":
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # gRPC's [::] takes IPv4 too
        sock.bind(sockaddr)
        return sock
    except BaseException:
        sock.close()
        raise


def _refusal(port: Port, exc: OSError) -> PortUnavailable:
    if exc.errno == errno.EADDRINUSE:
        return PortUnavailable(f"port {port.port} is already in use (another infercache or another program); "
                               f"choose another with {port.option}")
    return PortUnavailable(f"cannot listen on {port.host}:{port.port} ({port.setting}): {exc.strerror or exc}")


def claim(ports: list[Port]) -> list[socket.socket]:
    """Checks that nothing listens on any of `ports` and holds each (PortUnavailable if one is taken or
    cannot be bound). The caller closes the sockets returned when the server stops."""
    held: list[socket.socket] = []
    try:
        for port in ports:
            try:
                addresses, unusable = [], None
                for family, sockaddr in _addresses(port.host, port.port):
                    try:
                        _bind(family, sockaddr, reuse_address=True, reuse_port=False).close()
                        addresses.append((family, sockaddr))
                    except OSError as exc:  # (a name's IPv6 address on a host without IPv6: gRPC skips it too)
                        if exc.errno not in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                            raise
                        unusable = exc
                if not addresses and unusable is not None:
                    raise unusable
                for family, sockaddr in addresses if port.hold else ():
                    try:
                        held.append(_bind(family, sockaddr, reuse_address=False, reuse_port=True))
                    except OSError as exc:
                        if exc.errno != errno.EADDRINUSE:
                            raise
                        held.append(_bind(family, sockaddr, reuse_address=True, reuse_port=True))
            except socket.gaierror as exc:
                raise PortUnavailable(f"cannot listen on {port.host}:{port.port} ({port.setting}): {exc}") from None
            except OSError as exc:
                raise _refusal(port, exc) from None
    except BaseException:
        release(held)
        raise
    return held


def release(held: list[socket.socket]) -> None:
    for sock in held:
        sock.close()
    held.clear()
