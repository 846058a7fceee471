"""How the towers run a step's work: the way decided once from what the work
needs (``runner.py``), a tower's seat and its verbs (``seats.py``), one trace
cut into phases where the towers meet (``cut.py``, ``phases.py``), towers
traced side by side in turns (``turns.py``), XLA (``xla.py``).

May import: ``seats.py`` is imported by the rules (it imports none of this
room); the rest may import the rules and the top-level building blocks.
"""
