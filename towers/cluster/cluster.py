"""The workers of a multi-process job: who they are, starting them, feeding them.

A cluster is W worker processes, each running the same script with its own towers.
``TF_CONFIG`` (set by ``towers launch``, SLURM scripts or a scheduler) names them
(``towers/cluster/tf_config.py``). Worker 0 is the chief: it alone prints progress and
writes checkpoints and summaries.

Each worker feeds its own share of every global batch (:func:`shard`); the engine
combines its towers' gradients locally, then sums them across workers on
TensorFlow's collective runtime (``towers/placement/collective.py``), weighted by each
worker's examples, so W workers × T towers give one process's update on the
concatenated batch (``towers/cluster/workers.py``); a worker that stops answering is
named (``towers/cluster/faults.py``).
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Mapping, Sequence
from typing import Any

import tensorflow as tf

from towers import _runtime
from towers.cluster import orphan
from towers.cluster.tf_config import check_address, parse_tf_config, split_address
from towers.split import split_batch

# The cluster this process joined (a process joins one at most).
_started: Cluster | None = None
# The start-up timeout for a cluster read from TF_CONFIG, when the script does
# not give one: a scheduler's knob that needs no change to the script.
STARTUP_TIMEOUT_ENV = "TOWERS_STARTUP_TIMEOUT"


class Cluster:
    """W worker processes that train one model together.

    Args:
      workers: every worker's ``"host:port"``, in rank order (worker 0 is the chief).
      index: this process's rank in ``workers``.
      timeout_seconds: how long a step waits for the other workers during
        training before probing them every second: one that does not answer
        ends the step with ``towers.WorkerLostError`` naming it; a collective
        waits at most twice this long (``towers/cluster/faults.py``).
      startup_timeout_seconds: the same for the first collectives, which wait for
        every worker to start (import TensorFlow, build the model): a worker
        says within seconds, then every 15 s, which peers it is waiting for,
        and gives up after this long naming them (default 300 s; from
        ``TF_CONFIG``, ``$TOWERS_STARTUP_TIMEOUT`` when set).

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
        self.workers = [check_address(a, "workers") for a in workers]
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
          **options: ``timeout_seconds``, ``startup_timeout_seconds`` (default
            ``$TOWERS_STARTUP_TIMEOUT`` if set, else 300).

        Raises:
          ValueError: ``TF_CONFIG`` is missing or malformed, or
            ``$TOWERS_STARTUP_TIMEOUT`` is not a number; the message says which
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
        task = parse_tf_config(tf_config)
        if "startup_timeout_seconds" not in options and os.environ.get(
            STARTUP_TIMEOUT_ENV
        ):
            text = os.environ[STARTUP_TIMEOUT_ENV]
            try:
                options["startup_timeout_seconds"] = float(text)
            except ValueError:
                raise ValueError(
                    f"${STARTUP_TIMEOUT_ENV} must be a number of seconds; received "
                    f"{text!r}"
                ) from None
        return cls(task.workers, task.index, **options)

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
        orphan.watch()  # started by towers launch: stop if the launcher dies
        return self


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
        # The towers' rule, over workers: worker w's is the w-th contiguous slice.
        return split_batch(batch, num)[rank]

    return dataset.map(share)


def _check_port_free(address: str, index: int) -> None:
    """Fails early, naming the address, if this worker's port is taken."""
    _, port = split_address(address)
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
