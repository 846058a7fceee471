"""A private network for one machine's workers (Linux network namespaces).

TensorFlow's gRPC server listens on every interface of its port (the address
is fixed in its source), so a worker started with ``127.0.0.1:PORT`` in its
``TF_CONFIG`` still accepts connections from the whole network, where anyone
could join the collective or read its tensors. ``towers launch`` therefore
starts its workers in a network namespace of their own: its only interface is
its own loopback, so "every interface" is the workers' loopback and nothing
else. The namespace is made inside a user namespace that maps the caller's
own uid and gid when not root, so no privilege is needed, by a small process
the launcher forks, which ends once the launcher holds descriptors of its
namespaces; every worker joins them through those, so no worker's lifetime
(a first one that ends at once) decides whether the others can join.

The workers enter the namespaces between fork and exec (``preexec_fn``): the
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


def hold_private_network() -> list[tuple[int, int]] | None:
    """A private network, made now by a process forked to hold it: the
    descriptors of its namespaces (with their kinds), open in this process so
    the namespaces last while the workers join them (:func:`joining`), then
    :func:`release`; None where the kernel refuses one. The holder ends as
    soon as they are open, so no worker's lifetime matters.

    Example:
      >>> held = hold_private_network()
      >>> held is None or all(descriptor >= 0 for descriptor, _ in held)
      True
      >>> release(held or [])
    """
    uid, gid = os.getuid(), os.getgid()
    ready_read, ready_write = os.pipe()
    done_read, done_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the holder: no Python cleanup, nothing of the parent's
        os.close(ready_read)
        os.close(done_write)  # so the parent's close is the end of the pipe
        try:
            create(uid, gid)
            os.write(ready_write, b"1")
        except BaseException:  # noqa: BLE001 - the parent hears "refused"
            os.write(ready_write, b"0")
        os.read(done_read, 1)  # until the parent has opened the namespaces
        os._exit(0)
    os.close(ready_write)
    os.close(done_read)
    try:
        made = os.read(ready_read, 1) == b"1"
        return _open_namespaces(pid, uid) if made else None
    finally:
        os.close(done_write)  # the holder ends
        os.close(ready_read)
        os.waitpid(pid, 0)


def _open_namespaces(pid: int, uid: int) -> list[tuple[int, int]]:
    kinds = [("net", CLONE_NEWNET)] if not uid else [
        ("user", CLONE_NEWUSER), ("net", CLONE_NEWNET)]  # fmt: skip
    return [(os.open(f"/proc/{pid}/ns/{kind}", os.O_RDONLY), flag)
            for kind, flag in kinds]  # fmt: skip


def joining(held: list[tuple[int, int]]) -> Callable[[], None]:
    """The ``preexec_fn`` that moves a worker into the ``held`` namespaces."""

    def join() -> None:  # in the (single-threaded) child
        for descriptor, flag in held:
            _check(_libc.setns(descriptor, flag), "setns")

    return join


def release(held: list[tuple[int, int]]) -> None:
    """Closes the descriptors :func:`hold_private_network` opened."""
    for descriptor, _ in held:
        os.close(descriptor)
