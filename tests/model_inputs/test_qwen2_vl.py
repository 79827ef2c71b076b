"""``model_inputs = "qwen2_vl"``: a tiny Qwen2-VL (default config, ``use_cache=True``) takes the
micro-batch as-is; every packed document's logits equal the document run alone, its M-RoPE
positions equal ``get_rope_index`` of the document alone, and labels are -100 on its images.

Caption pairs, two-image captions and interleaved documents (tests/vision/image_loader_data),
chat with images rendered by the Qwen2-VL template (tests/vision/image_chat_data), and image
documents mixed with text documents. Without
``use_cache=False``, or with the plain 2-D positions (the loader's own batch), the documents
differ: the equality is not vacuous.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from beam_jobs import shard  # noqa: E402
from image_datasets import write_jsonl  # noqa: E402
from image_loader_data import DYNAMIC, FIXED, IN_MEMORY, NUM_LANES, image_config, image_tokenizer, shard_images  # noqa: E402
from loader.model_inputs import ModelInputsError  # noqa: E402
from loader.model_inputs.qwen2_vl import Qwen2VL  # noqa: E402
from loader.pipeline import ZephonLoader  # noqa: E402
from tests.dataset_factory import synthetic_texts, write_dataset  # noqa: E402
from tests.model_inputs.models import documents, tiny_qwen2_vl, worst_document_difference  # noqa: E402

SEQ_LEN = 160


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from tests.vision.image_chat_data import TEMPLATE, conversations  # noqa: PLC0415 - the chat data of tests/vision

    root = tmp_path_factory.mktemp("qwen2_vl")
    tokenizer = image_tokenizer(root / "tokenizer.json")
    documents_path = shard_images(root / "docs", root / "docs_out", 30, DYNAMIC)
    chat_in = root / "chat_in"
    write_jsonl(chat_in / "chat.jsonl", conversations(chat_in))
    shard.run(["--input", str(chat_in / "chat.jsonl"), "--output", str(root / "chat"), "--messages-field", "messages",
               "--chat-template", str(TEMPLATE), "--image-policy", json.dumps(DYNAMIC), "--num-lanes", str(NUM_LANES),
               *IN_MEMORY])
    write_dataset(str(root / "text"), synthetic_texts(40, seed=2, max_words=3), num_lanes=NUM_LANES, seed=1,
                  source_name="text")  # tokenized online
    model, ids = tiny_qwen2_vl(tokenizer)
    return {"tokenizer": tokenizer, "model": model, "ids": ids, "root": root,
            "sources": {"documents": [{"path": documents_path}], "chat": [{"path": str(root / "chat")}],
                        "mixed": [{"path": documents_path}, {"path": str(root / "text"), "weight": 2.0}]}}


def batches(data, source: str, count: int) -> list[dict]:
    config = image_config(data["sources"][source], data["tokenizer"], seq_len=SEQ_LEN, model_inputs="qwen2_vl")
    with ZephonLoader(config, rank=0, world_size=1) as loader:
        return [next(loader) for _ in range(count)]


def per_document_inputs(batch: dict, image_id: int):
    """Each segment ``(row, start, end)`` with the model inputs of that document alone."""
    grids, is_image = batch["image_grid_thw"], batch["input_ids"] == image_id
    pixel_starts = [0] + torch.cumsum(grids.prod(-1), 0).tolist()
    image = 0
    for row, a, b in documents(batch["position_ids"][0]):
        ids, types = batch["input_ids"][row : row + 1, a:b], is_image[row : row + 1, a:b].int()
        runs = int(types[0, 0]) + int(((types[0, 1:] - types[0, :-1]) == 1).sum())
        inputs = {"input_ids": ids}
        if runs:
            inputs.update(pixel_values=batch["pixel_values"][pixel_starts[image] : pixel_starts[image + runs]],
                          image_grid_thw=grids[image : image + runs], mm_token_type_ids=types)
            image += runs
        yield (row, a, b), inputs
    assert image == len(grids)  # every image of the batch belongs to one document


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("source", ["documents", "chat", "mixed"])
def test_packed_image_documents_compute_as_alone(data, source):
    model, image_id = data["model"], data["ids"]["image_token_id"]
    images = 0
    for batch in batches(data, source, 2):
        assert set(batch) <= set(Qwen2VL.keys) and "cu_seqlens" not in batch
        assert batch["pixel_values"].shape[0] == int(batch["image_grid_thw"].prod(-1).sum())
        assert torch.equal(batch["mm_token_type_ids"].bool(), batch["input_ids"] == image_id)
        assert bool((batch["labels"][batch["input_ids"] == image_id] == -100).all())
        docs = list(per_document_inputs(batch, image_id))
        assert len(docs) > batch["input_ids"].shape[0]
        with torch.no_grad():
            logits = model(**batch).logits
            alone = {}
            for (row, a, b), inputs in docs:
                if "image_grid_thw" in inputs:  # M-RoPE: what transformers computes for the document alone
                    expected, _ = model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                             inputs["image_grid_thw"])
                    assert torch.equal(batch["position_ids"][1:, row, a:b], expected[:, 0])
                    images += len(inputs["image_grid_thw"])
                alone[(row, a, b)] = model(**inputs).logits[0]
            lookup = lambda r, a, b: alone[(r, a, b)]  # noqa: E731
            assert worst_document_difference(logits, lookup, alone) <= 1e-4
            cached = model(**{k: v for k, v in batch.items() if k != "use_cache"}).logits
            assert worst_document_difference(cached, lookup, alone) > 1e-3
            flat = dict(batch, position_ids=batch["position_ids"][0])  # 2-D positions: no M-RoPE, no packing
            assert worst_document_difference(model(**flat).logits, lookup, alone) > 1e-3
    assert images > 4


def test_fixed_resolution_images_are_refused(data):
    path = shard_images(data["root"] / "fixed", data["root"] / "fixed_out", 6, FIXED)
    config = image_config([{"path": path}], data["tokenizer"], seq_len=SEQ_LEN, model_inputs="qwen2_vl")
    with pytest.raises(ModelInputsError, match="needs the \"dynamic\" image policy"):
        ZephonLoader(config)


def test_causal_lm_refuses_image_sources(data):
    config = image_config(data["sources"]["documents"], data["tokenizer"], seq_len=SEQ_LEN, model_inputs="causal_lm")
    with pytest.raises(ModelInputsError, match="sources hold images; use model_inputs = \"qwen2_vl\""):
        ZephonLoader(config)
