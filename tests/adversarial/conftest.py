"""The adversarial suite: bad input, tampered datasets, bad state and configs, killed processes.

Every case asserts either a named error of Zephon's own (``loader.errors.ZephonError``)
whose message names the file or field, or batches identical to the untampered run: never a
silent change, a hang or a bare library exception. It uses the loader tests' small datasets
and configs (``tests/loader/conftest.py``).
"""

from tests.loader.conftest import (  # noqa: F401 - fixtures, found by name
    baseline,
    corpus,
    epoch_edges,
    make_config,
    other_datasets,
    packing,
    tokenizer,
    tokenizer_path,
)
