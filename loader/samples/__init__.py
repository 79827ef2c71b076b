"""Samples for demos and tests: the shipped tokenizer fixture, and the sample corpus generator.

:func:`default_tokenizer_path` is all this package's ``__init__`` holds; the corpus generator,
:mod:`loader.samples.corpus`, is imported only by the commands that write a sample
(``zephon make-sample``, ``zephon quickstart``) and by tests, never by the loader at run time
(tests/test_layers.py checks it).
"""

from __future__ import annotations

from pathlib import Path

import beam_jobs

__all__ = ["default_tokenizer_path"]

# Package data of beam_jobs (pyproject.toml), where the job's tokenizer tests and docs name it.
_TOKENIZER_ASSET = Path(beam_jobs.__file__).resolve().parent / "assets" / "tokenizer.json"


def default_tokenizer_path() -> str:
    """Absolute path of the small byte-level BPE ``tokenizer.json`` shipped with Zephon.

    A demo fixture (vocabulary 8000, trained on the sample corpus of :mod:`loader.samples.corpus`
    by :mod:`beam_jobs.train_tokenizer`); real runs pass their own tokenizer file.
    """
    return str(_TOKENIZER_ASSET)
