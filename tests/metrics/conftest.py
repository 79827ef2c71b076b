"""The metrics tests reuse the audit tests' two small pre-tokenized sources, plus one with a loss mask."""

from __future__ import annotations

import numpy as np
import pytest

from tests.audit.conftest import make_config, sources, tokenizer, tokenizer_path  # noqa: F401 - fixtures
from tests.dataset_factory import synthetic_texts, write_dataset


@pytest.fixture(scope="session")
def masked_source(tmp_path_factory, tokenizer) -> str:
    """A source whose documents supervise a random half of their tokens (loss_mask column)."""
    path = tmp_path_factory.mktemp("masked") / "chat"
    texts = synthetic_texts(80, seed=13, max_words=12)
    rng = np.random.default_rng(4)
    masks = [rng.integers(0, 2, size=len(e.ids)) for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
    write_dataset(str(path), texts, tokenizer=tokenizer, source_name="chat", num_lanes=4, seed=3, files_per_lane=2,
                  row_group_rows=4, loss_masks=masks, keys=[f"chat-{k:05d}" for k in range(len(texts))])
    return str(path)
