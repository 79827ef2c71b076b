"""The Dataflow Flex Template (templates/shard/), checked offline against the job's parser."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import tomllib

import pytest

from loader.io.storage_options import StorageOptions

pytestmark = pytest.mark.timeout(60)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEMPLATE = os.path.join(ROOT, "templates", "shard")
shard = pytest.importorskip("beam_jobs.shard", reason="beam_jobs/shard.py is not there yet")


def load_template_main():
    spec = importlib.util.spec_from_file_location("zephon_template_main", os.path.join(TEMPLATE, "main.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def metadata() -> dict:
    with open(os.path.join(TEMPLATE, "metadata.json")) as fh:
        return json.load(fh)


@pytest.fixture(scope="module")
def job_actions() -> dict:
    return load_template_main().template_parameters()


def test_metadata_is_well_formed(metadata):
    assert metadata["name"] and metadata["description"]
    names = [p["name"] for p in metadata["parameters"]]
    assert len(names) == len(set(names))
    for parameter in metadata["parameters"]:
        assert parameter["label"] and parameter["helpText"], parameter["name"]
        assert re.fullmatch(r"[a-z][a-z0-9_]*", parameter["name"])
        assert isinstance(parameter.get("isOptional", False), bool)
        for pattern in parameter.get("regexes", []):
            re.compile(pattern)


def test_parameters_are_exactly_the_job_options(metadata, job_actions):
    declared = {p["name"] for p in metadata["parameters"]}
    assert declared - set(job_actions) == set(), "metadata.json names options the job does not accept"
    assert set(job_actions) - declared == set(), "job options missing from metadata.json"
    for parameter in metadata["parameters"]:
        action = job_actions[parameter["name"]]
        assert parameter.get("isOptional", False) == (not action.required), parameter["name"]


def _shown(default) -> str:
    return str(default).lower() if isinstance(default, bool) else str(default)


def test_defaults_and_choices_match_the_job(metadata, job_actions):
    for parameter in metadata["parameters"]:
        action = job_actions[parameter["name"]]
        if action.default not in (None, False) or action.nargs == 0:
            assert f"(default: {_shown(action.default)})" in parameter["helpText"], parameter["name"]
        else:
            assert "(default: " in parameter["helpText"] or action.required, parameter["name"]
        regexes = [re.compile(p) for p in parameter.get("regexes", [])]
        if action.default not in (None, False) or action.nargs == 0:
            assert all(r.fullmatch(_shown(action.default)) for r in regexes), parameter["name"]
        for choice in action.choices or ():
            assert all(r.fullmatch(choice) for r in regexes), (parameter["name"], choice)
        if action.choices:
            assert not all(r.fullmatch("not-a-choice") for r in regexes)


EXAMPLE = {
    "input": "gs://my-bucket/raw/a-*.jsonl,gs://my-bucket/raw/b-*.jsonl.gz",
    "output": "gs://my-bucket/datasets/web-v1",
    "format": "jsonl", "text_field": "body", "id_field": "id", "keep_fields": "url,lang",
    "source_name": "web", "num_lanes": "256", "lane_balance": "documents", "kind": "utf8-bytes",
    "kind_module": "tests.kinds.utf8_bytes_kind", "seed": "7", "tokenizer": "gs://my-bucket/tok/tokenizer.json",
    "token_compression": "zstd", "target_file_mb": "128", "overwrite": "true", "max_reject_fraction": "0.05",
    "messages_field": "messages", "chat_template": "gs://my-bucket/tok/tokenizer_config.json",
    "chat_loss_on": "last", "chat_max_tokens": "4096", "chat_overflow": "truncate",
    "image_field": "image", "image_root": "gs://my-bucket/images", "image_policy": "dynamic", "max_image_mb": "16",
    "max_image_pixels": "16777216", "max_image_aspect_ratio": "50", "max_images_per_document": "32",
    "transform": 'drop_regex:{"pattern": "lorem"}', "dedup": "exact",
    "s3_endpoint_url": "https://minio.internal:9000", "s3_region": "eu-central-1", "s3_profile": "datasets",
    "storage_retry_max_attempts": "12", "storage_retry_deadline_s": "300", "storage_request_timeout_s": "30.5",
}


def test_every_example_value_passes_its_regex(metadata):
    assert set(EXAMPLE) == {p["name"] for p in metadata["parameters"]}
    for parameter in metadata["parameters"]:
        for pattern in parameter.get("regexes", []):
            assert re.fullmatch(pattern, EXAMPLE[parameter["name"]]), parameter["name"]


def test_launcher_arguments_reach_the_job(monkeypatch):
    main = load_template_main()
    image_keys = {k for k in EXAMPLE if k.startswith(("image_", "max_image"))}  # not with a chat job: below
    curation_keys = {"transform", "dedup"}  # a text job's: below
    kind_keys = {"kind", "kind_module"}  # a job of a plug-in kind, without tokenizer or chat: below
    argv = [f"--{k}={v}" for k, v in EXAMPLE.items() if k not in image_keys | curation_keys | kind_keys] + [
        "--project=p", "--region=europe-west4"]
    options, pipeline_args = shard.parse_args(main.to_job_argv(argv))
    assert options.inputs == ("gs://my-bucket/raw/a-*.jsonl", "gs://my-bucket/raw/b-*.jsonl.gz")
    assert (options.num_lanes, options.seed, options.overwrite, options.keep_fields) == (256, 7, True, ("url", "lang"))
    assert (options.text_field, options.id_field, options.target_file_mb) == ("body", "id", 128.0)
    assert options.token_compression == "zstd"
    assert pipeline_args == ["--project=p", "--region=europe-west4", "--runner=DataflowRunner"]
    assert options.storage == StorageOptions(s3_endpoint_url="https://minio.internal:9000", s3_region="eu-central-1",
                                             s3_profile="datasets", retry_max_attempts=12, retry_deadline_s=300.0,
                                             request_timeout_s=30.5)
    images, _ = shard.parse_args(main.to_job_argv(
        ["--input=gs://b/x", "--output=gs://b/y"] + [f"--{k}={EXAMPLE[k]}" for k in sorted(image_keys)]))
    assert (images.images.image_field, images.images.image_root, images.images.policy["kind"]) == (
        "image", "gs://my-bucket/images", "dynamic")
    assert images.images.limits.max_images_per_document == 32 and images.images.limits.max_bytes == 16 << 20
    curated, _ = shard.parse_args(main.to_job_argv(
        ["--input=gs://b/x", "--output=gs://b/y"] + [f"--{k}={EXAMPLE[k]}" for k in sorted(curation_keys)]))
    assert len(curated.transforms) == 1 and curated.dedup == "exact"
    plug_in, _ = shard.parse_args(main.to_job_argv(
        ["--input=gs://b/x", "--output=gs://b/y"] + [f"--{k}={EXAMPLE[k]}" for k in sorted(kind_keys)]))
    assert plug_in.kind == "utf8-bytes"
    options, _ = shard.parse_args(main.to_job_argv(["--input=gs://b/x", "--output=gs://b/y", "--overwrite=false"]))
    assert options.overwrite is False and options.num_lanes == shard.DEFAULT_NUM_LANES

    calls = []
    monkeypatch.setattr(shard, "run_shard", lambda options, args, wait=True: calls.append(wait))
    assert main.main(["--input=gs://b/x", "--output=gs://b/y"]) == 0
    assert calls == [False]  # a template must not wait for the job


def test_dockerfile_paths_exist():
    with open(os.path.join(TEMPLATE, "Dockerfile")) as fh:
        lines = [line.strip() for line in fh if line.strip() and not line.lstrip().startswith("#")]
    assert lines[0].startswith("FROM gcr.io/dataflow-templates-base/python311-template-launcher-base")
    workdir = next(line.split("=", 1)[1] for line in lines if line.startswith("ARG WORKDIR="))
    copied = {}
    for line in lines:
        if line.startswith("COPY") and "--from=" not in line:
            *sources, destination = line.split()[1:]
            for source in sources:
                assert os.path.exists(os.path.join(ROOT, source)), (
                    f"templates/shard/Dockerfile copies {source}, which does not exist"
                    + (" (pyproject.toml names it as readme: `pip install .` fails without it)"
                       if source == "README.md" else ""))
                copied[os.path.normpath(os.path.join(workdir, destination if len(sources) == 1 else
                                                     os.path.join(destination, os.path.basename(source))))] = source
    py_file = next(re.search(r'FLEX_TEMPLATE_PYTHON_PY_FILE="?([^"\s]+)', line).group(1)
                   for line in lines if "FLEX_TEMPLATE_PYTHON_PY_FILE" in line)
    assert copied.get(os.path.normpath(py_file.replace("${WORKDIR}", workdir))) == "templates/shard/main.py"
    assert "wait_until_finish" not in open(os.path.join(TEMPLATE, "main.py")).read().split('"""')[-1]


def test_requirements_are_pinned_within_pyproject():
    from packaging.requirements import Requirement

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        project = {Requirement(r).name: Requirement(r) for r in tomllib.load(fh)["project"]["dependencies"]}
    with open(os.path.join(TEMPLATE, "requirements.txt")) as fh:
        pinned = [Requirement(line.strip()) for line in fh if line.strip() and not line.startswith("#")]
    names = {r.name for r in pinned}
    assert "torch" not in names
    assert names == set(project) - {"torch"}
    for requirement in pinned:
        (spec,) = requirement.specifier
        assert spec.operator == "==", f"{requirement} is not pinned"
        assert project[requirement.name].specifier.contains(spec.version), f"{requirement} is outside pyproject"
    beam = next(r for r in pinned if r.name == "apache-beam")
    assert "gcp" in beam.extras
    dockerfile = open(os.path.join(TEMPLATE, "Dockerfile")).read()
    assert f"apache/beam_python3.11_sdk:{next(iter(beam.specifier)).version}" in dockerfile


def test_metadata_and_options_come_from_the_option_table(metadata):
    """One table (beam_jobs.job_options) makes the parser, ShardOptions and this metadata: every
    table option is a parameter, every other parameter one of the image or storage tables', and
    every ShardOptions field is filled by exactly one table, with the table's default."""
    import dataclasses

    from beam_jobs import job_options, storage_flags

    declared = {p["name"] for p in metadata["parameters"]}
    table = set(job_options.template_names())
    storage = {flag.flag[2:].replace("-", "_") for flag in storage_flags.STORAGE_FLAGS}
    assert table <= declared and storage <= declared
    others = declared - table - storage
    assert others and all(name.startswith(("image_", "max_image")) for name in others), others
    fields = {f.name: f for f in dataclasses.fields(shard.ShardOptions)}
    assert set(fields) == set(job_options.table_fields()) | {"images", "storage"}
    for name in job_options.table_fields():
        if fields[name].default is not dataclasses.MISSING:
            assert fields[name].default == job_options.field_default(name), name
