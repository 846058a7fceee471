"""What runs around the step: ``fit``, ``evaluate`` and ``predict``.

``loop.py`` is Keras' ``Trainer`` API over the engine's steps and ``epoch.py``
one epoch with its validation; ``data.py`` takes input in Keras' forms (arrays
shuffled every epoch, datasets); ``progress.py`` prints and keeps the
``History``; ``checkpoint.py`` and ``checkpoint_files.py`` save and resume
(the input position included); ``preemption.py`` stops every worker after the
same step on SIGTERM; ``summaries.py`` writes TensorBoard logs.

May import: ``towers.step``, ``towers.cluster``, ``towers.placement`` and the
top-level building blocks; never the engine or ``explain``.
"""
