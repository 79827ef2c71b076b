"""The loader on real Beam output: text lanes and offline-tokenized lanes give the same batches.

The suite's corpus is sharded by ``beam_jobs.shard`` (FnApiRunner, in memory) twice, with
and without ``--tokenizer``, with the same keys, seed and lane count as the test corpus.
Fingerprints over several epochs must be equal between the two (and across W), and the
first epoch must equal the fast test-dataset writer's, which only shares the hashing. A third
run stores the token column with ``--token-compression zstd`` instead of the default lz4:
other bytes on disk, the same batches.
"""

from __future__ import annotations

import glob
import json
import os

import pyarrow.parquet as pq
import pytest

from beam_jobs import shard
from loader.commands.fingerprints import collect_fingerprints
from loader.io.manifest import read_manifest
from tests.loader.settings import DATA_SEED, NUM_DOCS, NUM_LANES

STEPS = 30


@pytest.fixture(scope="module")
def beam_datasets(tmp_path_factory, corpus, tokenizer_path) -> dict[str, str]:
    base = tmp_path_factory.mktemp("beam")
    source = base / "input" / "docs.jsonl"
    source.parent.mkdir()
    source.write_text("".join(json.dumps({"id": k, "text": t}, ensure_ascii=False) + "\n"
                              for k, t in zip(corpus.keys, corpus.texts)))
    outputs = {}
    for name, extra in (("text", []), ("pretokenized", ["--tokenizer", tokenizer_path]),
                        ("pretokenized_zstd", ["--tokenizer", tokenizer_path, "--token-compression", "zstd"])):
        out = base / name
        shard.run(["--input", str(source), "--output", str(out), "--id-field", "id", "--source-name", "synthetic",
                   "--num-lanes", str(NUM_LANES), "--seed", str(DATA_SEED), "--target-file-mb", "0.002",
                   *extra, "--runner=FnApiRunner", "--direct_running_mode=in_memory"])
        outputs[name] = str(out)
    return outputs


@pytest.mark.beam
@pytest.mark.timeout(240)
def test_beam_text_and_pretokenized_lanes_give_identical_fingerprints(beam_datasets, make_config, baseline,
                                                                      epoch_edges, packing):
    text, pre = read_manifest(beam_datasets["text"]), read_manifest(beam_datasets["pretokenized"])
    assert text.documents == pre.documents == NUM_DOCS
    assert not text.pretokenized and pre.pretokenized
    assert len(text.lane_files(0)) >= 2, "want several part files per lane, so that epochs permute files"

    online = make_config(packing, datasets=[{"path": beam_datasets["text"]}])
    offline = make_config(packing, datasets=[{"path": beam_datasets["pretokenized"]}])
    expected, _ = collect_fingerprints(online, world_size=1, end_step=STEPS)
    expected = [r.line() for r in expected]
    got, _ = collect_fingerprints(offline.replace(micro_batch_size=1), world_size=4, end_step=STEPS)
    assert [r.line() for r in got] == expected

    # Until the first lane ends its epoch 0, only the lane contents and order matter: the
    # Beam lanes must hold what the hashing says, like the test writer's lanes.
    first_edge = epoch_edges(packing)[0]
    assert expected[: first_edge - 1] == baseline(packing, STEPS)[: first_edge - 1]


def _codecs(dataset: str) -> set[tuple[str, str]]:
    found = set()
    for path in glob.glob(os.path.join(dataset, "lane=*", "*.parquet")):
        metadata = pq.ParquetFile(path).metadata
        for g in range(metadata.num_row_groups):
            for c in range(metadata.num_columns):
                column = metadata.row_group(g).column(c)
                found.add((column.path_in_schema, column.compression))
    return found


@pytest.mark.beam
def test_token_compression_changes_the_codec_of_input_ids_only_and_no_batch(beam_datasets, make_config):
    default, zstd = _codecs(beam_datasets["pretokenized"]), _codecs(beam_datasets["pretokenized_zstd"])
    assert {codec for column, codec in default if column == "input_ids"} == {"LZ4"}
    assert {codec for column, codec in zstd if column == "input_ids"} == {"ZSTD"}
    assert {codec for column, codec in default | zstd if column != "input_ids"} == {"ZSTD"}
    assert _codecs(beam_datasets["text"]) == {(c, "ZSTD") for c in ("key", "order_key", "text")}

    lz4_lines, zstd_lines = (
        [r.line() for r in collect_fingerprints(make_config("concat", datasets=[{"path": beam_datasets[name]}]),
                                                end_step=STEPS)[0]]
        for name in ("pretokenized", "pretokenized_zstd")
    )
    assert lz4_lines == zstd_lines
