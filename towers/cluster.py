"""The workers of a multi-process job: who they are, starting them, feeding them.

A cluster is W worker processes, each running the same script with its own towers.
``TF_CONFIG`` (set by ``towers launch``, SLURM scripts or a scheduler) names them::

    {"cluster": {"worker": ["host0:port", "host1:port"]},
     "task": {"type": "worker", "index": 1}}

A ``"chief"`` job of one task is accepted too (it becomes worker 0, the others
follow in order), as ``MultiWorkerMirroredStrategy`` reads it. Worker 0 is the
chief: it alone prints progress and writes checkpoints and summaries.

Each worker feeds its own share of every global batch (:func:`shard`); the engine
combines its towers' gradients locally, then sums them across workers on
TensorFlow's collective runtime (``towers/collective.py``), weighted by each
worker's examples, so W workers × T towers give one process's update on the
concatenated batch.
"""

from __future__ import annotations

import errno
import json
import os
import socket
from collections.abc import Mapping, Sequence
from typing import Any

import tensorflow as tf

from towers import _runtime

_started: Cluster | None = None

# Words of the line in TensorFlow's error that says why a collective failed.
_CAUSES = ("timed out", "aborted by", "Socket closed", "failed to connect")


class WorkerLostError(RuntimeError):
    """A peer worker did not take part in a collective within the timeout.

    The message names the workers that cannot be reached. TensorFlow's collective
    runtime cannot continue after this in the same process: restart every worker
    (``fit`` resumes from the last checkpoint).

    Example:
      >>> import socket
      >>> with socket.socket() as free:
      ...     free.bind(("127.0.0.1", 0))
      ...     port = free.getsockname()[1]  # closed again: nobody listens there
      >>> cluster = Cluster(["127.0.0.1:1", f"127.0.0.1:{port}"], index=0)
      >>> error = cluster.lost_error(RuntimeError("Collective ops is aborted"), 5.0)
      >>> isinstance(error, WorkerLostError), "cannot reach worker 1" in str(error)
      (True, True)
    """


class Cluster:
    """W worker processes that train one model together.

    Args:
      workers: every worker's ``"host:port"``, in rank order (worker 0 is the chief).
      index: this process's rank in ``workers``.
      timeout_seconds: how long a collective waits for the other workers during
        training before this worker gives up with :class:`WorkerLostError`.
      startup_timeout_seconds: the same for the first collectives, which wait for
        every worker to start (import TensorFlow, build the model).

    Example:
      >>> cluster = Cluster(["127.0.0.1:2222", "127.0.0.1:2223"], index=1)
      >>> cluster.num_workers, cluster.is_chief, cluster.address
      (2, False, '127.0.0.1:2223')
    """

    def __init__(
        self,
        workers: Sequence[str],
        index: int,
        timeout_seconds: float = 60.0,
        startup_timeout_seconds: float = 300.0,
    ):
        if isinstance(workers, str) or not workers:
            raise ValueError(
                'workers must be a non-empty list of "host:port" addresses; '
                f"received {workers!r}"
            )
        self.workers = [_check_address(a, "workers") for a in workers]
        repeated = sorted({a for a in self.workers if self.workers.count(a) > 1})
        if repeated:
            raise ValueError(
                f"worker addresses must differ; received {repeated} more than once "
                f"in {self.workers}"
            )
        if not isinstance(index, int) or not 0 <= index < len(self.workers):
            raise ValueError(
                f"the task index must be in 0..{len(self.workers) - 1} for "
                f"{len(self.workers)} workers; received {index!r}"
            )
        for name, value in [
            ("timeout_seconds", timeout_seconds),
            ("startup_timeout_seconds", startup_timeout_seconds),
        ]:
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be > 0; received {value!r}")
        self.index = index
        self.timeout_seconds = float(timeout_seconds)
        self.startup_timeout_seconds = float(startup_timeout_seconds)

    @classmethod
    def from_tf_config(
        cls, tf_config: str | Mapping[str, Any] | None = None, **options: Any
    ) -> Cluster:
        """The cluster ``TF_CONFIG`` names (default: the environment variable).

        Args:
          tf_config: the JSON text or its parsed dict; default ``$TF_CONFIG``.
          **options: ``timeout_seconds``, ``startup_timeout_seconds``.

        Raises:
          ValueError: ``TF_CONFIG`` is missing or malformed; the message says which
            part and what was received.

        Example:
          >>> c = Cluster.from_tf_config('{"cluster": {"worker": ["a:1", "b:2"]},'
          ...                            ' "task": {"type": "worker", "index": 0}}')
          >>> c.workers, c.is_chief
          (['a:1', 'b:2'], True)
        """
        if tf_config is None:
            tf_config = os.environ.get("TF_CONFIG")
            if not tf_config:
                raise ValueError("TF_CONFIG is not set; received no cluster to join")
        workers, index = _parse_tf_config(tf_config)
        return cls(workers, index, **options)

    @property
    def num_workers(self) -> int:
        """How many worker processes the cluster has.

        >>> Cluster(["h:1", "h:2", "h:3"], index=2).num_workers
        3
        """
        return len(self.workers)

    @property
    def is_chief(self) -> bool:
        """Worker 0 prints progress and writes checkpoints and summaries.

        >>> Cluster(["h:1", "h:2"], index=0).is_chief
        True
        """
        return self.index == 0

    @property
    def address(self) -> str:
        """This worker's ``"host:port"``.

        >>> Cluster(["h:1", "h:2"], index=1).address
        'h:2'
        """
        return self.workers[self.index]

    def __repr__(self) -> str:
        return f"Cluster(workers={self.workers}, index={self.index})"

    def start(self) -> Cluster:
        """Starts this worker's collective runtime (once per process).

        Must run before TensorFlow initialises (creating ``towers.Towers`` does
        it first). Starting the same cluster again does nothing.

        Raises:
          RuntimeError: another cluster was started in this process, TensorFlow
            already initialised, or this worker's port is in use.

        Example:
          In a worker script, first thing (``towers.Towers`` calls it too):
          ``towers.Cluster.from_tf_config().start()``. A taken port is named
          before anything starts:

          >>> import socket
          >>> with socket.socket() as taken:
          ...     taken.bind(("", 0))
          ...     taken.listen()
          ...     port = taken.getsockname()[1]
          ...     Cluster([f"127.0.0.1:{port}", "127.0.0.1:1"], index=0).start()
          Traceback (most recent call last):
          RuntimeError: worker 0's port ... (127.0.0.1:..., from TF_CONFIG) is in use...
        """
        global _started
        if _started is not None:
            if (_started.workers, _started.index) != (self.workers, self.index):
                raise RuntimeError(
                    f"this process already joined {_started!r}; received {self!r}. "
                    "A process can be in one cluster only."
                )
            return self
        _check_port_free(self.address, self.index)
        _runtime.start(self.workers, self.index)
        _started = self
        return self

    def unreachable(self, timeout: float = 2.0) -> list[tuple[int, str, str]]:
        """Peers that do not accept a connection: ``(rank, address, reason)``.

        Example:
          >>> import socket
          >>> with socket.socket() as listening:
          ...     listening.bind(("127.0.0.1", 0))
          ...     listening.listen()
          ...     alive = f"127.0.0.1:{listening.getsockname()[1]}"
          ...     Cluster(["127.0.0.1:1", alive], index=0).unreachable()
          []
        """
        lost = []
        for rank, address in enumerate(self.workers):
            if rank == self.index:
                continue
            host, port = _split_address(address)
            try:
                with socket.create_connection((host, port), timeout=timeout):
                    pass
            except OSError as error:
                lost.append((rank, address, error.strerror or str(error)))
        return lost

    def lost_error(self, error: Exception, waited: float) -> WorkerLostError:
        """The error a survivor raises when a collective failed or timed out.

        Example:
          >>> cluster = Cluster(["127.0.0.1:1", "127.0.0.1:2"], index=1)
          >>> error = cluster.lost_error(RuntimeError("Collective ops is aborted"), 3)
          >>> for part in str(error).split("; ")[:2]:
          ...     print(part)
          worker 1 of 2: a collective did not complete (waited 3.0 s)
          cannot reach worker 0 (127.0.0.1:1: Connection refused)
        """
        lost = self.unreachable()
        if lost:
            who = ", ".join(f"worker {r} ({a}: {why})" for r, a, why in lost)
            what = f"cannot reach {who}; it has probably died"
        else:
            what = (
                "every worker still accepts connections, so one is slow or stuck "
                "(raise timeout_seconds if a step can legitimately take longer)"
            )
        lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
        # TensorFlow's message starts with "Graph execution error:" and a
        # traceback; the cause is the line that says what happened.
        first_line = next(
            (ln for ln in lines if any(k in ln for k in _CAUSES)),
            lines[-1] if lines else "",
        )
        return WorkerLostError(
            f"worker {self.index} of {self.num_workers}: a collective did not "
            f"complete (waited {waited:.1f} s); {what}. Received: {first_line}. "
            "The job cannot continue; restart every worker (fit resumes from the "
            "last checkpoint)."
        )


def current() -> Cluster | None:
    """The cluster this process joined, if any."""
    return _started


def resolve_cluster(cluster: Any) -> Cluster | None:
    """``Towers(cluster=...)``: ``"auto"`` reads ``TF_CONFIG``; None is one process.

    A cluster of one worker is one process: nothing to start.
    """
    if cluster is None:
        return None
    if isinstance(cluster, str) and cluster == "auto":
        if not os.environ.get("TF_CONFIG"):
            return _started
        cluster = Cluster.from_tf_config()
    if not isinstance(cluster, Cluster):
        raise ValueError(
            f"cluster must be 'auto', None or a towers.Cluster; received {cluster!r}"
        )
    if cluster.num_workers == 1:
        return None
    return cluster.start()


def shard(dataset: tf.data.Dataset, cluster: Cluster | None = None) -> tf.data.Dataset:
    """This worker's share of every global batch of ``dataset``.

    Batch first, then shard: every worker gets the same number of steps, and
    worker w takes the w-th contiguous slice of each batch (sizes differ by at
    most one, so a last batch of 13 over 2 workers is 7 + 6). The workers' shares
    in rank order are the global batch: W workers train exactly as one process on
    ``dataset``. Every worker must iterate the same batches in the same order (a
    fixed shuffle seed).

    Args:
      dataset: ``(x, y)`` global batches, e.g. ``ds.batch(global_batch)``.
      cluster: default, the cluster this process joined; with none, the dataset
        is returned as it is.

    Example:
      >>> ds = tf.data.Dataset.range(5).batch(5)
      >>> c = Cluster(["a:1", "b:2"], index=1)
      >>> [b.numpy().tolist() for b in shard(ds, c)]
      [[3, 4]]
    """
    cluster = cluster if cluster is not None else _started
    if not isinstance(dataset, tf.data.Dataset):
        raise ValueError(
            f"shard takes a batched tf.data.Dataset; received {type(dataset).__name__}"
        )
    if cluster is None or cluster.num_workers == 1:
        return dataset
    rank, num = cluster.index, cluster.num_workers

    def share(*batch):
        batch = batch[0] if len(batch) == 1 else batch
        size = tf.shape(tf.nest.flatten(batch)[0], out_type=tf.int64)[0]
        base, extra = size // num, size % num
        start = rank * base + tf.minimum(tf.constant(rank, tf.int64), extra)
        length = base + tf.cast(rank < extra, tf.int64)
        return tf.nest.map_structure(lambda a: a[start : start + length], batch)

    return dataset.map(share)


def _parse_tf_config(text: str | Mapping[str, Any]) -> tuple[list[str], int]:
    where = "TF_CONFIG"
    if isinstance(text, str):
        try:
            config = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"{where} must be JSON; received {text!r} ({error.msg} at "
                f"character {error.pos})"
            ) from None
    else:
        config = text
    expected = (
        '{"cluster": {"worker": ["host:port", ...]}, "task": {"type": "worker", '
        '"index": i}}'
    )
    if not isinstance(config, Mapping) or not isinstance(
        config.get("cluster"), Mapping
    ):
        raise ValueError(
            f"{where} must have a 'cluster' object, as in {expected}; received "
            f"{config!r}"
        )
    jobs = config["cluster"]
    unknown = sorted(set(jobs) - {"chief", "worker"})
    if unknown:
        raise ValueError(
            f"{where}'s cluster may have 'chief' and 'worker' jobs (every task "
            f"trains); received jobs {unknown}"
        )
    for job, addresses in jobs.items():
        if isinstance(addresses, str) or not isinstance(addresses, list):
            raise ValueError(
                f"{where}'s cluster['{job}'] must be a list of \"host:port\"; "
                f"received {addresses!r}"
            )
    chief = jobs.get("chief", [])
    if len(chief) > 1:
        raise ValueError(
            f"{where}'s cluster may have one chief; received {len(chief)}: {chief}"
        )
    workers = [*chief, *jobs.get("worker", [])]
    if not workers:
        raise ValueError(f"{where} names no workers; received cluster {dict(jobs)}")
    task = config.get("task")
    if not isinstance(task, Mapping):
        raise ValueError(
            f"{where} must have a 'task' object naming this process, as in "
            f"{expected}; received task={task!r}"
        )
    job, index = task.get("type"), task.get("index", 0)
    if job not in jobs:
        raise ValueError(
            f"{where}'s task type must be one of the cluster's jobs {sorted(jobs)}; "
            f"received {job!r}"
        )
    if isinstance(index, bool) or not isinstance(index, int):
        raise ValueError(f"{where}'s task index must be an integer; received {index!r}")
    if not 0 <= index < len(jobs[job]):
        raise ValueError(
            f"{where}'s task index must be in 0..{len(jobs[job]) - 1} for the "
            f"{len(jobs[job])} '{job}' tasks; received {index}"
        )
    rank = index if job == "chief" else len(chief) + index
    return [_check_address(a, where) for a in workers], rank


def _check_address(address: Any, where: str) -> str:
    try:
        _split_address(address)
    except (ValueError, TypeError, AttributeError):
        raise ValueError(
            f'{where}: every worker address must be "host:port" with a port in '
            f"1..65535; received {address!r}"
        ) from None
    return address


def _split_address(address: str) -> tuple[str, int]:
    host, _, port_text = address.rpartition(":")
    port = int(port_text)
    if not host or not 0 < port < 65536:
        raise ValueError(address)
    return host.strip("[]"), port


def _check_port_free(address: str, index: int) -> None:
    """Fails early, naming the address, if this worker's port is taken."""
    _, port = _split_address(address)
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        probe.bind(("", port))
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            raise RuntimeError(
                f"worker {index}'s port {port} ({address}, from TF_CONFIG) is in use "
                "by another process; received a cluster whose address cannot be "
                "served. Free the port or give this worker another one."
            ) from None
    finally:
        probe.close()
