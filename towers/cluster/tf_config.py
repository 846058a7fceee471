"""``TF_CONFIG``: the cluster a scheduler (or ``towers launch``) describes.

::

    {"cluster": {"worker": ["host0:port", "host1:port"]},
     "task": {"type": "worker", "index": 1}}

A ``"chief"`` job of one task is accepted too (it becomes worker 0, the others
follow in order), as ``MultiWorkerMirroredStrategy`` reads it. Every part that is
missing or malformed is named, with what was received.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

_WHERE = "TF_CONFIG"
_EXPECTED = (
    '{"cluster": {"worker": ["host:port", ...]}, "task": {"type": "worker", '
    '"index": i}}'
)


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """What ``TF_CONFIG`` says: every worker in rank order, and this one's rank."""

    workers: list[str]
    index: int


def parse_tf_config(text: str | Mapping[str, Any]) -> TaskConfig:
    """Reads ``TF_CONFIG`` (its JSON text, or the parsed dict).

    Raises:
      ValueError: it is not JSON, or a part is missing or malformed; the message
        names the part and what was received.

    Example:
      >>> parse_tf_config({"cluster": {"chief": ["c:1"], "worker": ["w:1"]},
      ...                  "task": {"type": "worker", "index": 0}})
      TaskConfig(workers=['c:1', 'w:1'], index=1)
    """
    config = _load(text)
    jobs = config["cluster"]
    chief = jobs.get("chief", [])
    workers = [*chief, *jobs.get("worker", [])]
    if not workers:
        raise ValueError(f"{_WHERE} names no workers; received cluster {dict(jobs)}")
    job, index = _task(config, jobs)
    rank = index if job == "chief" else len(chief) + index
    return TaskConfig([check_address(a, _WHERE) for a in workers], rank)


def _load(text: str | Mapping[str, Any]) -> Mapping[str, Any]:
    """The parsed config, with a well-formed 'cluster' object."""
    config = text
    if isinstance(text, str):
        try:
            config = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"{_WHERE} must be JSON; received {text!r} ({error.msg} at "
                f"character {error.pos})"
            ) from None
    if not isinstance(config, Mapping) or not isinstance(
        config.get("cluster"), Mapping
    ):
        raise ValueError(
            f"{_WHERE} must have a 'cluster' object, as in {_EXPECTED}; received "
            f"{config!r}"
        )
    jobs = config["cluster"]
    unknown = sorted(set(jobs) - {"chief", "worker"})
    if unknown:
        raise ValueError(
            f"{_WHERE}'s cluster may have 'chief' and 'worker' jobs (every task "
            f"trains); received jobs {unknown}"
        )
    for job, addresses in jobs.items():
        if isinstance(addresses, str) or not isinstance(addresses, list):
            raise ValueError(
                f"{_WHERE}'s cluster['{job}'] must be a list of \"host:port\"; "
                f"received {addresses!r}"
            )
    if len(jobs.get("chief", [])) > 1:
        raise ValueError(
            f"{_WHERE}'s cluster may have one chief; received "
            f"{len(jobs['chief'])}: {jobs['chief']}"
        )
    return config


def _task(config: Mapping[str, Any], jobs: Mapping[str, list]) -> tuple[str, int]:
    """This process's job and its index in that job."""
    task = config.get("task")
    if not isinstance(task, Mapping):
        raise ValueError(
            f"{_WHERE} must have a 'task' object naming this process, as in "
            f"{_EXPECTED}; received task={task!r}"
        )
    job, index = task.get("type"), task.get("index", 0)
    if job not in jobs:
        raise ValueError(
            f"{_WHERE}'s task type must be one of the cluster's jobs "
            f"{sorted(jobs)}; received {job!r}"
        )
    if isinstance(index, bool) or not isinstance(index, int):
        raise ValueError(
            f"{_WHERE}'s task index must be an integer; received {index!r}"
        )
    if not 0 <= index < len(jobs[job]):
        raise ValueError(
            f"{_WHERE}'s task index must be in 0..{len(jobs[job]) - 1} for the "
            f"{len(jobs[job])} '{job}' tasks; received {index}"
        )
    return job, index


def check_address(address: Any, where: str) -> str:
    """Returns ``address`` if it is ``"host:port"`` with a valid port.

    Raises:
      ValueError: it is not; ``where`` says which setting held it.

    Example:
      >>> check_address("localhost:70000", "workers")
      Traceback (most recent call last):
      ValueError: workers: every worker address must be ... 'localhost:70000'
    """
    try:
        split_address(address)
    except (ValueError, TypeError, AttributeError):
        raise ValueError(
            f'{where}: every worker address must be "host:port" with a port in '
            f"1..65535; received {address!r}"
        ) from None
    return address


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``; brackets of an IPv6 host dropped.

    >>> split_address("[::1]:2222")
    ('::1', 2222)
    """
    host, _, port_text = address.rpartition(":")
    port = int(port_text)
    if not host or not 0 < port < 65536:
        raise ValueError(address)
    return host.strip("[]"), port
