"""Bring your own trainer: tidal's worker library for training frameworks (docs/frameworks.md).

One callback added to a framework's trainer gives it what
:class:`checkpoints.Checkpointer` gives a hand-written loop: progress and pace
reported to the node agent, and one agreed stop step on SIGTERM with a
checkpoint in the framework's own format.

* :mod:`checkpoints.frameworks.hf`: ``TidalCallback`` for the Hugging Face
  ``transformers.Trainer``.
* :mod:`checkpoints.frameworks.lightning`: ``TidalCallback`` and
  ``TidalEnvironment`` for Lightning's ``Trainer``.
* :mod:`checkpoints.frameworks.boundary`: the framework-neutral step boundary
  both use.

Neither framework is a dependency of tidal: each module imports its framework
only when one of its classes is first used, so importing :mod:`checkpoints`
(or this package) never imports either.
"""
