"""A kind's config table (loader.config_tables): the image kind registers ``images``, the config
names no kind, and reading a config without the table imports none."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from loader import config_tables
from loader.config import ConfigError, LoaderConfig
from loader.validation import Problems

BASE = dict(datasets=[{"path": "data/web"}], seq_len=64, global_batch_size=16, micro_batch_size=4, seed=0,
            tokenizer="tokenizer.json")


def _modules_after(code: str) -> set:
    script = code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    return set(json.loads(subprocess.run([sys.executable, "-c", script], check=True, capture_output=True,
                                         text=True).stdout))


def test_reading_a_config_without_the_table_imports_no_kind():
    loaded = _modules_after("from loader.config import LoaderConfig\n"
                            f"LoaderConfig.from_dict({BASE!r})")
    assert not {m for m in loaded if m.startswith(("loader.vision", "loader.chat", "loader.kinds"))}
    assert "pyarrow" not in loaded


def test_the_built_in_tables_register_themselves_and_stay_light():
    for name, module in config_tables.BUILTIN_TABLES.items():
        loaded = _modules_after(f"from loader.config_tables import config_table\nconfig_table({name!r})")
        assert module in loaded
        assert not {"pyarrow", "PIL", "torch", "loader.kinds"} & loaded, f"{module} is not light"


def test_the_images_table_is_the_image_kinds_record():
    config = LoaderConfig.from_dict(dict(BASE, packing="best_fit", images={"overflow": "truncate"}))
    assert type(config.images).__module__ == "loader.vision.options"
    assert (config.images.overflow, config.images.max_images_per_sequence) == ("truncate", None)
    assert LoaderConfig.FIELD_RULES["images"].record is type(config.images)
    assert LoaderConfig.from_dict(BASE).images is None


def test_a_bad_images_table_names_its_field():
    with pytest.raises(ConfigError) as raised:
        LoaderConfig.from_dict(dict(BASE, packing="best_fit", images={"overflow": "drop"}))
    assert str(raised.value) == "config: images.overflow must be one of 'reject', 'truncate' (got 'drop')"


def test_an_unregistered_table_is_an_error_listing_the_registered_ones():
    config_tables.config_table("images")
    rule = config_tables.KindTable("audio")
    assert rule.check(None, "audio", Problems()) is None  # absent: nothing to look up
    with pytest.raises(ValueError, match=r"no config table 'audio' is registered \(registered: images\)"):
        rule.check({"rate": 16000}, "audio", Problems())
