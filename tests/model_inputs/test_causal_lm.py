"""``model_inputs = "causal_lm"``: a tiny Llama (default config, ``use_cache=True``) takes the
micro-batch as-is, and every packed document's logits equal the document run alone (1e-4, float32).

Over text tokenized online and pre-tokenized lanes, concat and best-fit packing, sdpa and eager
attention. The same batch without ``use_cache=False`` differs (documents attend across), so
the equality is not vacuous.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tokenizers import Tokenizer  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

from loader.samples import default_tokenizer_path  # noqa: E402
from loader.commands.fingerprints import collect_fingerprints  # noqa: E402
from loader.config import ConfigError, LoaderConfig  # noqa: E402
from loader.model_inputs import LAYOUTS  # noqa: E402
from loader.model_inputs.causal_lm import CausalLM  # noqa: E402
from loader.pipeline import ZephonLoader  # noqa: E402
from tests.dataset_factory import synthetic_texts, write_dataset  # noqa: E402
from tests.model_inputs.models import documents, tiny_llama, worst_document_difference  # noqa: E402

SEQ_LEN = 128


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("causal_lm")
    texts = synthetic_texts(60, seed=5, max_words=4)
    tokenizer = Tokenizer.from_file(default_tokenizer_path())
    write_dataset(str(root / "text"), texts, num_lanes=4, seed=2)
    write_dataset(str(root / "pre"), texts, num_lanes=4, seed=2, tokenizer=tokenizer)
    return {"text": str(root / "text"), "pretokenized": str(root / "pre")}


def config(path: str, **overrides) -> LoaderConfig:
    fields = dict(datasets=[{"path": path}], seq_len=SEQ_LEN, global_batch_size=4, micro_batch_size=2, seed=7,
                  tokenizer=default_tokenizer_path(), model_inputs="causal_lm")
    fields.update(overrides)
    return LoaderConfig(**fields)


def first_batch(cfg: LoaderConfig) -> dict:
    with ZephonLoader(cfg, rank=0, world_size=1) as loader:
        return next(loader)


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("packing", ["concat", "best_fit"])
@pytest.mark.parametrize("source", ["text", "pretokenized"])
def test_packed_documents_compute_as_alone(datasets, source, packing, attn):
    batch = first_batch(config(datasets[source], packing=packing))
    assert set(batch) == set(CausalLM.keys)
    docs = documents(batch["position_ids"])
    assert len(docs) > batch["input_ids"].shape[0]  # packed: more documents than rows
    model = tiny_llama(attn)
    with torch.no_grad():
        out = model(**batch)
        alone = lambda r, a, b: model(input_ids=batch["input_ids"][r : r + 1, a:b]).logits[0]  # noqa: E731
        assert worst_document_difference(out.logits, alone, docs) <= 1e-4
        if attn == "sdpa":  # the same batch with the model's default use_cache attends across documents
            leaky = model(**{k: v for k, v in batch.items() if k != "use_cache"}).logits
            assert worst_document_difference(leaky, alone, docs) > 1e-3
    assert torch.isfinite(out.loss)
    # labels: -100 on each document's first token and on padding, the next token's id elsewhere
    labels, ids = batch["labels"], batch["input_ids"]
    for row, a, b in docs:
        assert labels[row, a] == -100
        rest = labels[row, a + 1 : b]
        assert torch.equal(rest, ids[row, a + 1 : b]) or bool((rest == -100).all())


def test_model_inputs_leave_the_stream_alone(datasets):
    """The laid-out batch holds the same tokens and labels as the loader's own batch."""
    plain = first_batch(config(datasets["pretokenized"], model_inputs=None))
    laid_out = first_batch(config(datasets["pretokenized"]))
    for key in ("input_ids", "labels", "position_ids"):
        assert torch.equal(plain[key], laid_out[key])
    assert torch.equal(laid_out["cu_seq_lens_q"].long(), plain["cu_seqlens"].long())
    assert laid_out["max_length_q"] == int(torch.diff(plain["cu_seqlens"]).max())  # flash varlen kwargs
    assert "step" in plain and "step" not in laid_out  # only forward's arguments
    with ZephonLoader(config(datasets["pretokenized"]), rank=0, world_size=1, output="numpy") as loader:
        as_numpy = next(loader)  # the same layout, as NumPy arrays
    assert set(as_numpy) == set(laid_out)
    for key, value in laid_out.items():
        assert (value == as_numpy[key]) if not torch.is_tensor(value) else bool((value.numpy() == as_numpy[key]).all())


def test_unknown_layout_and_missing_fields_are_refused(datasets):
    with pytest.raises(ConfigError, match=r"model_inputs.*'causal_lm', 'qwen2_vl'.*got 'llama'"):
        config(datasets["text"], model_inputs="llama")
    with pytest.raises(ConfigError, match=r"model_inputs = 'causal_lm' reads batch fields \['position_ids', "
                                          r"'cu_seqlens'\]"):
        config(datasets["text"], batch_fields=("input_ids", "labels"))
    assert {"causal_lm", "qwen2_vl"} <= set(LAYOUTS)


def test_fingerprints_of_a_model_inputs_config_are_the_streams(datasets):
    laid_out = config(datasets["pretokenized"])
    got, _ = collect_fingerprints(laid_out, world_size=2, end_step=3)
    expected, _ = collect_fingerprints(laid_out.replace(model_inputs=None), world_size=1, end_step=3)
    assert [r.line() for r in got] == [r.line() for r in expected]


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_gpt2_takes_the_same_batch(datasets, attn):
    """Not only Llama: GPT-2 (learned absolute positions) computes each packed document as alone."""
    batch = first_batch(config(datasets["pretokenized"]))
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=SEQ_LEN, vocab_size=8000,
                                       bos_token_id=None, eos_token_id=None, attn_implementation=attn)).eval()
    with torch.no_grad():
        out = model(**batch)
        alone = lambda r, a, b: model(input_ids=batch["input_ids"][r : r + 1, a:b]).logits[0]  # noqa: E731
        assert worst_document_difference(out.logits, alone, documents(batch["position_ids"])) <= 1e-4
