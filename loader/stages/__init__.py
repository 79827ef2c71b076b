"""Stages: what happens to a lane's documents between read and batch.

In the order data flows: :mod:`~loader.stages.tokenizer` (text lanes),
:mod:`~loader.stages.features` (named per-token arrays that travel with the ids),
:mod:`~loader.stages.packing`, :mod:`~loader.stages.window_packing` (best fit per
``packing_window`` documents) and :mod:`~loader.stages.token_mixing` (documents into
fixed-length sequences), :mod:`~loader.stages.lane` (one lane across its sources: the unit of
state), :mod:`~loader.stages.producer` (a rank's sequences in global-index order) and
:mod:`~loader.stages.collate` (micro-batches as NumPy arrays, torch as a thin adapter).
"""
