"""towers: data-parallel training with towers on TensorFlow 2.

Public names load on first use, so ``towers --help`` and ``towers.virtual_devices``
callers can set TensorFlow's environment before TensorFlow is imported.
"""

import importlib

__all__ = [
    "Cluster",
    "Towers",
    "WorkerLostError",
    "combine_gradients",
    "shard",
    "split_batch",
    "split_sizes",
    "virtual_devices",
]
__version__ = "0.1.0"

# public name -> module that defines it
_HOME = {
    "Cluster": "towers.cluster",
    "Towers": "towers.engine",
    "WorkerLostError": "towers.cluster",
    "shard": "towers.cluster",
    "combine_gradients": "towers.combine",
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
            "pip install 'towers[cpu]' (CPU only) or 'towers[gpu]' (NVIDIA GPUs)."
        ) from error
    return getattr(module, name)


def __dir__():
    return sorted([*globals(), *__all__])
