"""What runs around the step: ``fit``, ``evaluate`` and ``predict``.

``loop.py`` is Keras' ``Trainer`` API over the engine's steps, ``run.py`` one
fit's epochs and executions and the evaluate and predict loops;
``model_metrics.py`` reads and reports the model's own metrics; ``inputs.py``
takes every input form through Keras' own data adapters, and ``epochs.py``
counts steps and epochs as Keras' ``EpochIterator`` does, with a position a
checkpoint saves; ``arguments.py`` checks fit's Keras arguments;
``progress.py`` is Keras' progress bar and keeps the ``History``;
``checkpoint.py`` and ``checkpoint_files.py`` save and resume (the input
position included); ``preemption.py`` stops every worker after the
same step on SIGTERM; ``summaries.py`` writes TensorBoard logs.
``compiling.py`` compiles the model with what the engine trains it with,
``compiled.py`` holds the step as ``tf.function``\\ s and ``executions.py``
as a loop of steps (``steps_per_execution``), as Keras' trainer holds its
``train_step``.

May import: ``towers.step``, ``towers.cluster``, ``towers.placement`` and the
top-level building blocks; never the engine or ``explain``.
"""
