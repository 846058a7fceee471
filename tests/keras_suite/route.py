"""Keras' own tests with every ``fit``, ``evaluate`` and ``predict`` of a
Keras model routed through ``towers.Towers(model, devices=[2 logical CPUs])``:
a pytest plugin, not part of ``make test`` (``make keras-tests`` runs it on
the test files Keras ships in its wheel).

    python -m pytest -p tests.keras_suite.route <keras test files>

A model keeps one engine (made at its first call); a call made while towers
runs (towers' own use of the model) goes to Keras' own method.
"""

from __future__ import annotations

import functools
import threading
import weakref

import towers

_inside = threading.local()
_engines: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
ROUTED = ("fit", "evaluate", "predict")
DEVICES: list[str] = []  # set when the plugin is configured


def _engine(model) -> towers.Towers:
    engine = _engines.get(model)
    if engine is None:
        engine = _engines[model] = towers.Towers(model, devices=DEVICES)
    return engine


def _routed(name: str, own):
    @functools.wraps(own)
    def method(self, *args, **kwargs):
        if getattr(_inside, "on", False):
            return own(self, *args, **kwargs)
        _inside.on = True
        try:
            return getattr(_engine(self), name)(*args, **kwargs)
        finally:
            _inside.on = False

    return method


def pytest_configure(config):
    # Only as a plugin (-p): the devices are split before TensorFlow starts.
    DEVICES[:] = towers.virtual_devices(2)
    import keras

    for name in ROUTED:
        setattr(keras.Model, name, _routed(name, getattr(keras.Model, name)))
