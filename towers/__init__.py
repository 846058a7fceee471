"""towers: data-parallel training with towers on TensorFlow 2.

A tower is one device's share of a training step. ``towers.Towers`` keeps a Keras
model's variables on one variable device, runs each tower's forward and backward
pass on its own device, combines the gradients and applies them once per step;
T towers give the update one device gives on the whole batch.

Start with ``Towers`` (``towers.engine``), ``split_batch`` and
``combine_gradients``; ``docs/how-towers-work.md`` walks one batch through a step.

Public names load on first use, so ``towers --help`` and ``towers.virtual_devices``
callers can set TensorFlow's environment before TensorFlow is imported.

.. include:: ../docs/glossary.md
"""

import importlib

__all__ = [
    "Cluster",
    "Towers",
    "WorkerLostError",
    "combine_gradients",
    "gather",
    "shard",
    "split_batch",
    "split_sizes",
    "virtual_devices",
]
__version__ = "0.1.0"

# public name -> module that defines it
_HOME = {
    "Cluster": "towers.cluster.cluster",
    "Towers": "towers.engine",
    "WorkerLostError": "towers.cluster.faults",
    "shard": "towers.cluster.cluster",
    "combine_gradients": "towers.combine",
    "gather": "towers.step.rules.gather",
    "split_batch": "towers.split",
    "split_sizes": "towers.split",
    "virtual_devices": "towers.devices",
}


def __getattr__(name):
    if name not in _HOME:
        raise AttributeError(f"module 'towers' has no attribute {name!r}")
    try:
        module = importlib.import_module(_HOME[name])
    except ModuleNotFoundError as error:
        if error.name != "tensorflow":
            raise
        raise ImportError(
            "towers needs TensorFlow. Install it with the extra for your machine: "
            "pip install 'tf-towers[cpu]' (CPU only) or 'tf-towers[gpu]' (NVIDIA GPUs)."
        ) from error
    value = getattr(module, name)
    globals()[name] = value  # later lookups (and pdoc) find it directly
    return value


def __dir__():
    return sorted([*globals(), *__all__])
