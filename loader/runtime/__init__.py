"""The jobs of :class:`~loader.pipeline.ZephonLoader` beside its constructor, one module each.

- :mod:`loader.runtime.session`: the checkpoint session (``state_dict``, ``global_state_dict``,
  ``load_state_dict``, the states kept at step boundaries).
- :mod:`loader.runtime.steps`: a micro-batch's items and steps produced ahead (finite data,
  filled tails, ``model_inputs``' loss tokens), with the ranks' end-of-step agreement.
- :mod:`loader.runtime.handover`: the run that produces items (in-process lanes or the worker
  pool), the warm start and its hand-over to the workers.

Each is a base class of ``ZephonLoader`` working on the attributes its constructor sets (the
names each base reads are listed in its docstring); none imports :mod:`loader.pipeline`.
"""
