"""Several processes: one engine per worker, TensorFlow's collective runtime
between them.

``cluster.py`` is the ``Cluster`` (who the workers are, starting the runtime,
``shard``) and ``tf_config.py`` reads ``TF_CONFIG``; ``workers.py`` is what one
worker exchanges with the others each step; ``faults.py`` names a worker that is
lost, stopped or not yet started. ``launch.py`` starts N local workers (in
``netns.py``'s private network namespace), and ``orphan.py`` stops a worker
whose launcher died.

May import: ``towers.placement`` and the top-level building blocks; never the
engine, ``step``, ``training`` or ``explain``. The launcher's modules
(``launch``, ``netns``, ``orphan``) import no TensorFlow: ``towers launch``
starts workers without it.
"""
