"""Checkpoints: the loader state as JSON, typed and validated on load.

* :mod:`loader.checkpoint.state`       the versioned JSON format; merging rank states
* :mod:`loader.checkpoint.schema`      typed records, every bad field named by its JSON path
* :mod:`loader.checkpoint.step_states` lane states at the last few step boundaries handed out
"""
