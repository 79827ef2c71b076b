"""Tests for the sample-corpus generator and the shipped tokenizer fixture."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import zstandard
from hypothesis import given
from hypothesis import strategies as st

from beam_jobs import train_tokenizer
from loader.samples import corpus as sample_data
from loader.stages.tokenizer import BOS_CANDIDATES, EOS_CANDIDATES, load_tokenizer, resolve_special_token

REPO_ROOT = Path(__file__).resolve().parents[2]
SMALL_DOCS = 400  # enough for every kind in every source (documents 1..4 are forced)


def read_records(path: str) -> list[dict]:
    """Read one part file back with the reader its extension calls for."""
    if path.endswith(".parquet"):
        return pq.read_table(path).to_pylist()
    with open(path, "rb") as raw:
        data = raw.read()
    if path.endswith(".jsonl.gz"):
        data = gzip.decompress(data)
    elif path.endswith(".jsonl.zst"):
        data = zstandard.ZstdDecompressor().decompressobj().decompress(data)
    return [json.loads(line) for line in data.decode("utf-8").splitlines()]


def file_bytes(root: Path) -> dict[str, bytes]:
    return {str(path.relative_to(root)): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()}


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> sample_data.SampleSummary:
    out = tmp_path_factory.mktemp("sample")
    return sample_data.make_sample(str(out), num_docs=SMALL_DOCS, seed=7, with_bad_records=True)


@pytest.fixture(scope="module")
def records_by_source(sample) -> dict[str, list[dict]]:
    return {source: [r for path in summary.paths for r in read_records(path)] for source, summary in sample.sources.items()}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(sample_data.default_tokenizer_path())


# --- determinism ---------------------------------------------------------------------


def test_same_arguments_give_byte_identical_files_across_processes(sample, tmp_path):
    # A second run in a fresh interpreter with a different hash seed: catches any use of
    # hash(), set order or other per-process state.
    env = dict(os.environ, PYTHONHASHSEED="12345")
    command = [sys.executable, "-m", "loader.samples.corpus", str(tmp_path), "--docs", str(SMALL_DOCS), "--seed", "7", "--with-bad-records"]
    subprocess.run(command, cwd=REPO_ROOT, env=env, check=True, capture_output=True)
    first, second = file_bytes(Path(sample.out_dir)), file_bytes(tmp_path)
    assert sorted(first) == sorted(second)
    assert len(first) == 3 * 4 + 1  # 3 sources x 4 formats + the bad-records file
    for name in first:
        assert first[name] == second[name], name


def test_a_different_seed_gives_different_documents():
    docs_a = [d.text for d in sample_data.iter_documents("prose", num_docs=20, seed=1)]
    docs_b = [d.text for d in sample_data.iter_documents("prose", num_docs=20, seed=2)]
    assert docs_a[0] != docs_b[0]
    assert sum(a == b for a, b in zip(docs_a, docs_b)) <= 2  # only empty docs may coincide


@pytest.mark.parametrize("source", sample_data.SOURCES)
def test_documents_are_prefix_stable(source):
    short = list(sample_data.iter_documents(source, num_docs=30, seed=3))
    long = list(sample_data.iter_documents(source, num_docs=sample_data.BLOCK_DOCS + 10, seed=3))
    assert short == long[:30]
    assert [d.id for d in long] == [f"{source}-{n}" for n in range(len(long))]


@given(st.integers(min_value=0, max_value=10**7))
def test_docs_per_source_sums_exactly_and_follows_shares(num_docs):
    counts = sample_data.docs_per_source(num_docs)
    assert list(counts) == list(sample_data.SOURCES)
    assert sum(counts.values()) == num_docs
    for source, count in counts.items():
        assert abs(count - num_docs * sample_data.SOURCE_SHARES[source]) < 1


# --- formats and layout --------------------------------------------------------------


def test_layout_rotates_formats_over_part_files(sample):
    for source, summary in sample.sources.items():
        names = [os.path.relpath(path, sample.out_dir) for path in summary.paths]
        assert names == [f"{source}/part-{k:04d}.{fmt}" for k, fmt in enumerate(sample_data.FORMATS)]
    assert sample.num_docs == SMALL_DOCS


def test_every_format_reads_back_to_the_generated_documents(sample, records_by_source):
    for source, summary in sample.sources.items():
        expected = [d.to_record() for d in sample_data.iter_documents(source, num_docs=summary.num_docs, seed=7)]
        assert records_by_source[source] == expected
        # Each format must contribute rows, or a broken writer could hide behind the others.
        assert all(len(read_records(path)) > 0 for path in summary.paths)


def test_parquet_schema(sample):
    schema = pq.read_schema(sample.sources["prose"].paths[3])
    assert schema.names == ["id", "text", "source", "meta"]
    assert str(schema.field("text").type) == "string"
    assert [f.name for f in schema.field("meta").type] == ["kind", "lang"]


def test_jsonl_is_real_utf8_not_ascii_escapes(sample):
    text = Path(sample.sources["multilingual"].paths[0]).read_text(encoding="utf-8")
    assert re.search(r"[\u4e00-\u9fff]", text)
    assert "\\u" not in text.replace("\\\\u", "")  # ensure_ascii=False


# --- content ---------------------------------------------------------------------------


@pytest.mark.parametrize("source", sample_data.SOURCES)
def test_every_kind_is_present_and_has_its_shape(records_by_source, source):
    by_kind: dict[str, list[str]] = {}
    for record in records_by_source[source]:
        by_kind.setdefault(record["meta"]["kind"], []).append(record["text"])
    assert set(by_kind) == set(sample_data.KINDS)
    assert all(text == "" for text in by_kind["empty"])
    assert all(text and text.isspace() for text in by_kind["whitespace"])
    assert all(len(text.split()) == 1 and text == text.strip() for text in by_kind["one_word"])
    assert all(len(text) >= sample_data.LONG_MIN_CHARS for text in by_kind["long"])
    assert all(text.strip() for text in by_kind["normal"])


@pytest.mark.parametrize("source", sample_data.SOURCES)
def test_lengths_are_long_tailed(records_by_source, source):
    lengths = sorted(len(r["text"]) for r in records_by_source[source] if r["meta"]["kind"] == "normal")
    median, p95 = lengths[len(lengths) // 2], lengths[int(len(lengths) * 0.95)]
    mean = sum(lengths) / len(lengths)
    assert mean > median  # right-skewed, as a lognormal is
    assert p95 > 2.5 * median  # a long tail (a uniform or constant length would fail)
    assert lengths[0] < median / 4


def test_sources_have_their_character(records_by_source):
    prose = "".join(r["text"] for r in records_by_source["prose"])
    code = "".join(r["text"] for r in records_by_source["code"])
    multilingual = "".join(r["text"] for r in records_by_source["multilingual"])
    assert prose.isascii() and " the " in prose
    assert "def " in code and "return " in code and "function " in code and "{" in code
    for pattern in (r"[\u4e00-\u9fff]", r"[\u3040-\u309f]", r"[\uac00-\ud7a3]", r"[\u0400-\u04ff]", r"[\u0600-\u06ff]", r"[éèäöüñ]", r"[\U0001F300-\U0001FAFF]"):
        assert re.search(pattern, multilingual), pattern
    langs = {r["meta"]["lang"] for r in records_by_source["multilingual"]}
    assert set(sample_data.MULTILINGUAL_WEIGHTS) <= langs
    assert any("+" in lang for lang in langs)  # some documents switch language


def test_bad_records_file_has_exactly_the_advertised_bad_lines(sample):
    def is_valid(line: bytes) -> bool:
        try:
            record = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return False
        return isinstance(record, dict) and isinstance(record.get("text"), str) and record["text"] != ""

    lines = Path(sample.bad_records_path).read_bytes().splitlines()
    valid = [line for line in lines if is_valid(line)]
    assert len(lines) - len(valid) == sample.num_bad_records == 8
    assert len(valid) == sample.num_good_records_in_bad_file == 2
    with pytest.raises(UnicodeDecodeError):
        Path(sample.bad_records_path).read_bytes().decode("utf-8")


# --- validation and CLI -----------------------------------------------------------------


def test_unknown_format_is_refused_with_the_choices(tmp_path):
    with pytest.raises(ValueError, match="jsonl.zst"):
        sample_data.make_sample(str(tmp_path), num_docs=10, formats=("csv",))


def test_stale_part_files_are_refused_before_anything_is_written(tmp_path):
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "part-0009.parquet").write_bytes(b"old")
    with pytest.raises(FileExistsError, match="part-0009.parquet"):
        sample_data.make_sample(str(tmp_path), num_docs=10)
    assert not (tmp_path / "prose").exists()


def test_cli_prints_one_line_per_source(tmp_path, capsys):
    assert sample_data.main([str(tmp_path), "--docs", "40", "--formats", "parquet,jsonl.gz", "--files-per-source", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for source in sample_data.SOURCES:
        assert sum(line.startswith(f"{source}: ") for line in lines) == 1
    assert sorted(p.name for p in (tmp_path / "prose").iterdir()) == ["part-0000.parquet", "part-0001.jsonl.gz", "part-0002.parquet"]


def test_cli_rejects_unknown_format(tmp_path):
    with pytest.raises(SystemExit):
        sample_data.main([str(tmp_path), "--formats", "jsonl,xml"])


# --- tokenizer fixture ------------------------------------------------------------------


def test_tokenizer_fixture_loads_and_names_its_special_tokens(tokenizer):
    assert Path(sample_data.default_tokenizer_path()).is_absolute()
    assert 7500 <= tokenizer.get_vocab_size() <= 8500
    assert resolve_special_token(tokenizer, None, EOS_CANDIDATES, "eos_token") == 0
    assert tokenizer.token_to_id("<|endoftext|>") == 0
    assert resolve_special_token(tokenizer, None, BOS_CANDIDATES, "bos_token") == 1
    assert tokenizer.token_to_id("<pad>") == 2


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! The data loader is deterministic.\n",
        "def f(x):\n\treturn {'a': x}  # trailing spaces   \r\n",
        "東京で日本語のテキストを学習する。数据和模型。한국어 문장입니다.",
        "👩‍💻 🇯🇵 🏳️‍🌈 👍🏽 ❤️ 🚀🚀",
        "naïve café, Straße, señor, ещё, في",
        " leading space and\x00control\x7fbytes\ufffd",
    ],
)
def test_tokenizer_round_trips_text(tokenizer, text):
    ids = tokenizer.encode(text).ids
    assert ids and 0 not in ids
    assert tokenizer.decode(ids) == text


def test_tokenizer_round_trips_the_sample_and_long_documents_exceed_16k_tokens(tokenizer):
    for source in sample_data.SOURCES:
        docs = list(sample_data.iter_documents(source, num_docs=40, seed=0))
        encodings = tokenizer.encode_batch([d.text for d in docs])
        for doc, encoding in zip(docs, encodings):
            assert tokenizer.decode(encoding.ids) == doc.text, doc.id
            if doc.kind == "long":
                assert len(encoding.ids) > 16_384, doc.id


def test_training_is_deterministic_on_a_small_corpus():
    texts = list(train_tokenizer.training_texts(num_docs=300))
    first = train_tokenizer.train(texts, vocab_size=1000).to_str()
    second = train_tokenizer.train(iter(texts), vocab_size=1000).to_str()
    assert first == second


@pytest.mark.slow
def test_shipped_fixture_is_what_train_tokenizer_writes():
    assert train_tokenizer.main(["--check", "--out", sample_data.default_tokenizer_path()]) == 0
