"""A private network for one machine's workers (Linux network namespaces).

TensorFlow's gRPC server listens on every interface of its port (the address
is fixed in its source), so a worker started with ``127.0.0.1:PORT`` in its
``TF_CONFIG`` still accepts connections from the whole network, where anyone
could join the collective or read its tensors. ``towers launch`` therefore
starts its workers in a network namespace of their own: its only interface is
its own loopback, so "every interface" is the workers' loopback and nothing
else. The first worker creates the namespace (inside a user namespace that
maps the caller's own uid and gid when not root, so no privilege is needed);
the others join it through descriptors the launcher opens as soon as the first
has started (``hold``), so a first worker that ends at once does not take the
namespace with it.

The namespaces are entered between fork and exec (``preexec_fn``): the
launcher itself never leaves the machine's network.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import os
import socket
import struct
from collections.abc import Callable

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_IFREQ = "16sH14x"  # struct ifreq: the interface's name, then its flags
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"{what}: {os.strerror(error)}")


def create(uid: int, gid: int) -> None:
    """Moves this (single-threaded) process into a new network namespace and
    brings its loopback up. ``uid``/``gid``: the caller's, mapped to themselves
    in a new user namespace unless ``uid`` is 0."""
    _check(_libc.unshare(CLONE_NEWNET | (CLONE_NEWUSER if uid else 0)), "unshare")
    if uid:
        for name, text in (
            ("setgroups", "deny"),
            ("uid_map", f"{uid} {uid} 1"),
            ("gid_map", f"{gid} {gid} 1"),
        ):
            with open(f"/proc/self/{name}", "w") as file:
                file.write(text)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        request = struct.pack(_IFREQ, b"lo", 0)
        flags = struct.unpack(_IFREQ, fcntl.ioctl(probe, _SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(probe, _SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", flags | _IFF_UP))


def hold(pid: int, uid: int) -> list[tuple[int, int]]:
    """Descriptors of ``pid``'s namespaces, with their kinds, opened now: they
    keep the namespaces for the workers that join later, whatever becomes of
    ``pid`` meanwhile (a worker that finished first). Close them with
    :func:`release`."""
    kinds = [("net", CLONE_NEWNET)] if not uid else [
        ("user", CLONE_NEWUSER), ("net", CLONE_NEWNET)]  # fmt: skip
    return [(os.open(f"/proc/{pid}/ns/{kind}", os.O_RDONLY), flag)
            for kind, flag in kinds]  # fmt: skip


def join(held: list[tuple[int, int]]) -> None:
    """Moves this (single-threaded) process into the ``held`` namespaces."""
    for descriptor, flag in held:
        _check(_libc.setns(descriptor, flag), "setns")


def release(held: list[tuple[int, int]]) -> None:
    for descriptor, _ in held:
        os.close(descriptor)


def private_network() -> tuple[Callable[[], None], Callable[[list], Callable]]:
    """``(first, others)``: ``preexec_fn`` for the worker that creates the
    namespace, and ``others(held)``, one for each worker that joins the
    namespaces :func:`hold` holds.

    Example:
      >>> first, others = private_network()
      >>> callable(first) and callable(others([]))
      True
    """
    uid, gid = os.getuid(), os.getgid()
    return (lambda: create(uid, gid)), (lambda held: lambda: join(held))
