"""Tampered checkpoints: every field is validated on load, errors name its JSON path (issue 14).

Real checkpoints of small loaders (a pre-tokenized source and a text source, L = 4):

* ``concat`` and ``best_fit``: one source, saved after some lanes entered epoch 1;
* ``text_concat``: the same documents as text, tokenized online: cursors name their
  ``document`` (state version 3);
* ``mix_sequence_stop``: two sources mixed by sequence, the ``stop`` source already stopped in
  some lanes (``stopped`` and ``exhausted`` true);
* ``mix_token_best_fit``: two sources mixed by token into best-fit bins (``token_sources``);
* ``rank_local``: rank 0's own state of a W = 2 run (``rank``, ``world_size``, ``rank_position``).

Walking each state's JSON tree, every node (leaf and object) is set to each wrong JSON type
(string, float, bool, null, list, object) and, where it is an integer, to out-of-range values
(-1, 2^40, 2^70, past the end: the lane's block count, the block's token count + 1, the vocabulary
size, the source count); booleans are flipped; every key is deleted; an unknown key is added
to every object. Each tampered state is loaded and resumed for a few steps, and must

* raise :class:`~loader.checkpoint.state.StateError` (at load, or at the first read for what needs the
  data) whose message contains the tampered field's JSON path, or
* deliver exactly the untampered resume's batches, and only for a field the loader genuinely
  ignores (:data:`IGNORED`): never a silent change, a bare exception or a hang.

The cases are all generated; above :data:`BUDGET` per checkpoint a deterministic sample is
loaded that keeps one case of every (field, tampering) kind. The ``LoaderStateful`` dict of
``torch.distributed.checkpoint`` gets missing, non-string, non-JSON and bad lane entries.
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
import re
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import pytest
from tokenizers import Tokenizer

from loader.samples import default_tokenizer_path
from loader.config import LoaderConfig
from loader.io.manifest import read_manifest
from loader.pipeline import ZephonLoader
from loader.checkpoint.state import StateError, dumps, loads, merge_rank_states
from loader.integrations.torch_data import LoaderStateful
from tests.dataset_factory import synthetic_texts, write_dataset
from tests.loader.settings import make_stream

NUM_LANES = 4
SEQ_LEN = 32
GLOBAL_BATCH = 8
MICRO_BATCH = 4
SEED = 13
RESUME_STEPS = 2  # steps compared after each resume
BUDGET = 80  # tampered loads per checkpoint (all cases are generated; a sample above this)

# Fields the loader ignores on load, where a well-typed tampered value must leave the batches
# identical: the header's copy of each source's exhaustion policy and max_epochs (the config
# decides, and a cursor that the config's policy cannot produce is refused), the best-fit
# ``serial`` counter (only its order against the bins' serials matters), and ``stopped``
# set false where the source has run out (the lane finds it out again on the next read) or
# true where it has run out but was not marked yet.
IGNORED = [
    r"sources\[\d+\]\.max_epochs",
    r"lanes\.\d+\.sources\.\w+\.packer\.serial",
    r"lanes\.\d+\.mixed\.serial",
    r"lanes\.\d+\.sources\.\w+\.stopped",
    # Where a best-fit piece came from: optional (version-1 bins have none), never read by the
    # stream; zephon audit checks an origin against the lane files when it resolves one.
    r"lanes\.\d+\.(sources\.\w+\.packer|mixed)\.bins\[\d+\]\.piece_origins(\[\d+\])*",
    # A text cursor's document as a whole (deleted): optional (version-2 cursors have none); the
    # block is then tokenized from its start, to the same batches. Its fields are checked.
    r"lanes\.\d+\.sources\.\w+\.packer\.stream\.document",
]


@dataclass(frozen=True)
class Datasets:
    web: str  # pre-tokenized, repeats
    code: str  # text (tokenized online), small: stops early under exhaustion "stop"
    code_tokens: str  # the same documents pre-tokenized (restores without a tokenizer: faster)
    web_text: str  # web's documents as text: cursors that name their document (state version 3)


@pytest.fixture(scope="module")
def datasets(tmp_path_factory, tokenizer) -> Datasets:  # tokenizer: the shipped one (tests/adversarial/conftest.py)
    root = tmp_path_factory.mktemp("state_validation")
    web, code, code_tokens = str(root / "web"), str(root / "code"), str(root / "code_tokens")
    web_text = str(root / "web_text")
    for path, web_tokenizer in ((web, tokenizer), (web_text, None)):
        write_dataset(path, synthetic_texts(40, seed=31, max_words=6), num_lanes=NUM_LANES, seed=2,
                      source_name="web", tokenizer=web_tokenizer, files_per_lane=2, row_group_rows=4)
    for path, code_tokenizer in ((code, None), (code_tokens, tokenizer)):
        write_dataset(path, synthetic_texts(16, seed=32, max_words=2), num_lanes=NUM_LANES, seed=2,
                      source_name="code", files_per_lane=1, row_group_rows=4, tokenizer=code_tokenizer)
    return Datasets(web, code, code_tokens, web_text)


def config_of(datasets: Datasets, scenario: str) -> LoaderConfig:
    web = {"path": datasets.web, "name": "web"}
    fields: dict[str, Any] = dict(
        seq_len=SEQ_LEN, global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH, seed=SEED,
        tokenizer=default_tokenizer_path(), num_workers=0, best_fit_open_bins=4, read_ahead=False,
    )
    if scenario in ("concat", "rank_local"):
        fields.update(datasets=[web], packing="concat")
    elif scenario == "best_fit":
        fields.update(datasets=[web], packing="best_fit")
    elif scenario == "text_concat":
        fields.update(datasets=[{"path": datasets.web_text, "name": "web"}], packing="concat")
    elif scenario == "mix_sequence_stop":
        fields.update(datasets=[dict(web, weight=0.6), {"path": datasets.code, "name": "code", "weight": 0.4,
                                                        "exhaustion": "stop"}],
                      packing="concat", mixing_unit="sequence")
    elif scenario == "mix_token_best_fit":
        fields.update(datasets=[dict(web, weight=0.6), {"path": datasets.code_tokens, "name": "code", "weight": 0.4}],
                      packing="best_fit", mixing_unit="token")
    return LoaderConfig(**fields)


SAVE_STEP = {"concat": 14, "best_fit": 14, "text_concat": 14, "mix_sequence_stop": 12, "mix_token_best_fit": 6,
             "rank_local": 5}


def take_batches(loader: ZephonLoader, steps: int) -> str:
    """A digest of every tensor of the next ``steps`` steps (fewer if the data ends)."""
    digest = hashlib.sha256()
    for _ in range(steps * loader.topology.micro_steps_per_step):
        try:
            batch = next(loader)
        except StopIteration:
            digest.update(b"end")
            break
        for name in sorted(batch):
            value = batch[name]
            digest.update(name.encode())
            digest.update(value.numpy().tobytes() if hasattr(value, "numpy") else repr(value).encode())
    return digest.hexdigest()


def saved_state(config: LoaderConfig, scenario: str) -> dict:
    world_size = 2 if scenario == "rank_local" else 1
    loader = ZephonLoader(config, rank=0, world_size=world_size)
    try:
        for _ in range(SAVE_STEP[scenario] * loader.topology.micro_steps_per_step):
            next(loader)
        state = loader.state_dict()
    finally:
        loader.close()
    if world_size == 1:
        state = merge_rank_states([state])
    return loads(dumps(state))


# -- generating the cases ------------------------------------------------------------------------


def nodes(value: Any, path: str = "", pointer: tuple = ()) -> Iterator[tuple[str, tuple, Any]]:
    """Every node of a JSON tree as ``(JSON path, key sequence, value)``, the root first."""
    yield path, pointer, value
    if isinstance(value, dict):
        for key, item in value.items():
            yield from nodes(item, f"{path}.{key}" if path else key, pointer + (key,))
    elif isinstance(value, list):
        for k, item in enumerate(value):
            yield from nodes(item, f"{path}[{k}]", pointer + (k,))


WRONG_TYPES = {"string": "x", "float": 1.5, "bool": True, "null": None, "list": [], "object": {}}
MISSING = object()


def kind_of(value: Any) -> str:
    return {str: "string", float: "float", bool: "bool", type(None): "null", list: "list", dict: "object",
            int: "int"}[type(value)]


@dataclass(frozen=True)
class Case:
    path: str  # the JSON path the error must name
    pointer: tuple
    kind: str  # what was done, e.g. "type:string", "value:-1", "delete", "unknown key"
    value: Any = None  # the new value (MISSING: delete the key)

    def apply(self, state: dict) -> Any:
        tampered = copy.deepcopy(state)
        if not self.pointer:
            return self.value
        parent = tampered
        for key in self.pointer[:-1]:
            parent = parent[key]
        if self.value is MISSING:
            del parent[self.pointer[-1]]
        else:
            parent[self.pointer[-1]] = self.value
        return tampered


class PastTheEnd:
    """Values just past the end of a field's range, from the datasets and config themselves."""

    def __init__(self, config: LoaderConfig, tokenizer: Tokenizer, state: dict) -> None:
        self.config, self.tokenizer, self.state = config, tokenizer, state
        self.names = [s["name"] for s in state["sources"]]
        self.paths = {d.name: d.path for d in config.datasets}

    def values(self, path: str, pointer: tuple, value: int) -> list[int]:
        field = pointer[-1] if pointer else None
        source = self._source_of(path)
        if field == "block" and source is not None:
            return [self._blocks(source, int(pointer[1]))]
        if field == "offset" and source is not None:
            cursor = self._at(pointer[:-1])
            return [self._block_tokens(source, int(pointer[1]), cursor["epoch"], cursor["block"]) + 1]
        if "tokens" in path and "bins" in path:
            return [self.tokenizer.get_vocab_size()]
        if "token_sources" in path or field == "current":
            return [len(self.names)]
        if "piece_starts" in path:
            return [len(self._at(pointer[:-2])["tokens"])]
        return []

    def _at(self, pointer: tuple) -> Any:
        node = self.state
        for key in pointer:
            node = node[key]
        return node

    def _source_of(self, path: str) -> Optional[str]:
        match = re.search(r"\.sources\.(\w+)\.packer\.stream\.", path)
        if match:
            return match.group(1)
        match = re.search(r"\.stream\.sources\[(\d+)\]\.", path)
        return self.names[int(match.group(1))] if match else None

    def _blocks(self, source: str, lane: int) -> int:
        return sum(f.row_groups for f in read_manifest(self.paths[source]).lane_files(lane) if f.rows > 0)

    def _block_tokens(self, source: str, lane: int, epoch: int, block: int) -> int:
        stream = make_stream(self.paths[source], self.tokenizer, lane, seed=self.config.seed)
        try:
            tokens = stream._read_block(epoch, *stream.blocks_of_epoch(epoch)[block])
            tokens.ensure(1 << 40)
            return len(tokens.tokens)
        finally:
            stream.close()


def all_cases(state: dict, past_the_end: PastTheEnd) -> list[Case]:
    cases = []
    for path, pointer, value in nodes(state):
        kind = kind_of(value)
        for name, wrong in WRONG_TYPES.items():
            if name != kind:
                cases.append(Case(path, pointer, f"type:{name}", copy.deepcopy(wrong)))
        if kind == "bool":
            cases.append(Case(path, pointer, "flip", not value))
        elif kind == "int":
            for new in [-1 if value != -1 else -2, 1 << 40, 1 << 70] + past_the_end.values(path, pointer, value):
                if new != value:
                    cases.append(Case(path, pointer, f"value:{new}", new))
        elif kind == "string":
            cases.append(Case(path, pointer, "value:other string", value + "-tampered"))
        elif kind == "null":
            cases.append(Case(path, pointer, "value:7", 7))
        elif kind == "object":
            for key in value:
                cases.append(Case(f"{path}.{key}" if path else key, pointer + (key,), "delete", MISSING))
            cases.append(Case(f"{path}.zz_unknown" if path else "zz_unknown", pointer + ("zz_unknown",),
                              "unknown key", 1))
    return cases


def field_kind(case: Case) -> str:
    """The case with lane keys and list indices made generic: one of each is always loaded."""
    generic = re.sub(r"lanes\.\d{5}", "lanes.*", case.path)
    generic = re.sub(r"\[\d+\]", "[*]", generic)
    return f"{generic} {case.kind.split(':')[0]}"


def sample(cases: list[Case], budget: int) -> list[Case]:
    if len(cases) <= budget:
        return cases
    rng = random.Random(14)
    shuffled = cases[:]
    rng.shuffle(shuffled)
    chosen, kinds = [], set()
    for case in shuffled:  # one of every kind first
        if field_kind(case) not in kinds:
            kinds.add(field_kind(case))
            chosen.append(case)
    rest = [c for c in shuffled if c not in chosen]
    return chosen + rest[: max(0, budget - len(chosen))]


# -- the test ------------------------------------------------------------------------------------


def outcome(loader: ZephonLoader, state: Any) -> tuple[str, str]:
    """``("error", message)`` for a StateError (at load or while resuming), else ``("ok", digest)``."""
    try:
        loader.load_state_dict(state)
        return "ok", take_batches(loader, RESUME_STEPS)
    except StateError as exc:
        return "error", str(exc)


@pytest.mark.timeout(100)
@pytest.mark.parametrize("scenario", list(SAVE_STEP))
def test_every_tampered_field_is_refused_by_path_or_changes_nothing(datasets, tokenizer, scenario):
    config = config_of(datasets, scenario)
    state = saved_state(config, scenario)
    world_size = 2 if scenario == "rank_local" else 1
    with ZephonLoader(config, rank=0, world_size=world_size) as loader:
        kind, expected = outcome(loader, state)
        assert kind == "ok", f"the untampered checkpoint does not load: {expected}"
        assert_scenario_is_what_it_says(scenario, state)
        cases = all_cases(state, PastTheEnd(config, tokenizer, state))
        chosen = sample(cases, BUDGET)
        failures, ignored = [], []
        for case in chosen:
            try:
                kind, result = outcome(loader, case.apply(state))
            except Exception as exc:  # a bare library error: the very thing this suite forbids
                failures.append(f"{case.path} {case.kind}: bare {type(exc).__name__}: {exc}")
                continue
            if kind == "error":
                if case.path and case.path not in result:
                    failures.append(f"{case.path} {case.kind}: the error does not name the path:\n{result}")
            elif result != expected:
                failures.append(f"{case.path} {case.kind}: loaded and SILENTLY CHANGED the batches")
            elif not any(re.fullmatch(p, case.path) for p in IGNORED):
                failures.append(f"{case.path} {case.kind}: loaded with identical batches, but the field is not "
                                "one the loader ignores (IGNORED): is it validated?")
            else:
                ignored.append(case)
        # The untampered state still resumes identically after all that.
        assert outcome(loader, state) == ("ok", expected)
    assert not failures, f"{len(failures)} of {len(chosen)} cases ({len(cases)} generated):\n" + "\n".join(failures[:30])
    assert len(chosen) >= min(len(cases), BUDGET)


def assert_scenario_is_what_it_says(scenario: str, state: dict) -> None:
    """Guards against a vacuous pass: the checkpoint holds what the scenario needs to tamper with."""
    lanes = state["lanes"].values()
    if scenario in ("concat", "best_fit"):
        assert any(l["sources"]["web"]["packer"]["stream"]["epoch"] >= 1 for l in lanes)
    if scenario == "best_fit":
        assert any(l["sources"]["web"]["packer"]["bins"] for l in lanes)
    if scenario == "text_concat":  # text cursors past their block's first document name it
        assert any(l["sources"]["web"]["packer"]["stream"].get("document", {}).get("index", 0) > 0 for l in lanes)
    if scenario == "mix_sequence_stop":
        assert any(l["sources"]["code"]["stopped"] for l in lanes)
        assert any(l["sources"]["code"]["packer"]["stream"]["exhausted"] for l in lanes)
    if scenario == "mix_token_best_fit":
        assert any(b.get("token_sources") for l in lanes for b in l["mixed"]["bins"])
        assert any(l["mixed"]["stream"]["current"] >= 0 for l in lanes)
    if scenario == "rank_local":
        assert state["rank"] == 0 and state["world_size"] == 2


def test_many_bad_fields_are_reported_at_once(datasets):
    config = config_of(datasets, "best_fit")
    state = saved_state(config, "best_fit")
    tampered = copy.deepcopy(state)
    for key, lane in tampered["lanes"].items():
        lane["sources"]["web"]["packer"]["stream"]["block"] = "3"
        lane["sources"]["web"]["packer"]["serial"] = -1
    with ZephonLoader(config) as loader, pytest.raises(StateError) as info:
        loader.load_state_dict(tampered)
    message = str(info.value)
    for key in tampered["lanes"]:
        assert f"lanes.{key}.sources.web.packer.stream.block" in message
        assert f"lanes.{key}.sources.web.packer.serial" in message
    assert f"{2 * NUM_LANES} bad fields" in message


def test_a_repeat_source_is_never_stopped_or_exhausted(datasets):
    """``exhausted`` / ``stopped`` on an endless source would end its stream silently."""
    config = config_of(datasets, "concat")
    state = saved_state(config, "concat")
    for field in ("stopped", "exhausted"):
        tampered = copy.deepcopy(state)
        lane = tampered["lanes"]["00002"]["sources"]["web"]
        lane["stopped"] = True
        lane["packer"]["stream"]["exhausted"] = field == "exhausted"
        with ZephonLoader(config) as loader, pytest.raises(StateError, match="never") as info:
            loader.load_state_dict(tampered)
        assert "lanes.00002.sources.web." in str(info.value)


# -- torch.distributed.checkpoint entries --------------------------------------------------------


def test_loader_stateful_refuses_bad_entries_naming_the_key(datasets):
    config = config_of(datasets, "concat")
    with ZephonLoader(config) as loader:
        for _ in range(3 * loader.topology.micro_steps_per_step):
            next(loader)
        good = LoaderStateful(loader).state_dict()
        expected = take_batches(loader, RESUME_STEPS)
    meta = json.loads(good["zephon_meta"])
    bad_meta = dict(meta, num_lanes="4")
    bad_lane = json.loads(good["lane_00001"])
    bad_lane["sources"]["web"]["packer"]["stream"]["offset"] = -5
    cases = {
        "missing meta": ({k: v for k, v in good.items() if k != "zephon_meta"}, "'zephon_meta'"),
        "meta not a string": (dict(good, zephon_meta=b"\x80\x04pickle"), "'zephon_meta'"),
        "meta not JSON": (dict(good, zephon_meta="{not json"), "'zephon_meta'"),
        "meta not an object": (dict(good, zephon_meta="[1, 2]"), "'zephon_meta'"),
        "meta with lanes": (dict(good, zephon_meta=json.dumps(dict(meta, lanes={}))), "'zephon_meta'"),
        "meta field": (dict(good, zephon_meta=json.dumps(bad_meta)), "num_lanes"),
        "lane missing": ({k: v for k, v in good.items() if k != "lane_00003"}, "'lane_00003'"),
        "lane not a string": (dict(good, lane_00001=7), "'lane_00001'"),
        "lane not JSON": (dict(good, lane_00001="outputs: 3"), "'lane_00001'"),
        "lane field": (dict(good, lane_00001=json.dumps(bad_lane)), "lanes.00001.sources.web.packer.stream.offset"),
        "not a dict": ([good], "LoaderStateful"),
    }
    with ZephonLoader(config) as loader:
        for name, (entries, phrase) in cases.items():
            with pytest.raises(StateError) as info:
                LoaderStateful(loader).load_state_dict(entries)
            assert phrase in str(info.value), f"{name}: {phrase!r} not in {info.value}"
        LoaderStateful(loader).load_state_dict(good)  # nothing above changed the loader
        assert take_batches(loader, RESUME_STEPS) == expected


def test_state_text_is_parsed_as_json_only():
    import pickle

    for text in ("{", "null", "[]", pickle.dumps({"format": "zephon.loader_state"}).decode("latin-1")):
        with pytest.raises(StateError):
            loads(text)
