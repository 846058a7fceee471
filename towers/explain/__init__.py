"""``towers explain``: where every variable and op of one training step lived.

``run.py`` runs a fresh trace of the engine's step once while TensorFlow records
the graphs it placed, then puts every variable back; ``graph.py`` reads those
graphs (stages, devices, transfers, XLA computations); ``report.py`` renders
the text report, ``diagram.py`` the picture (``--png``).

May import: ``towers.step`` and below, and the top-level building blocks; never
the engine or ``training``.
"""
