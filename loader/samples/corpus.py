"""A deterministic sample corpus for demos and tests (``zephon make-sample``, ``zephon quickstart``).

Out of the trainer's import path: only those commands (and the tokenizer's training script,
:mod:`beam_jobs.train_tokenizer`) import it; the shipped tokenizer fixture's path is
:func:`loader.samples.default_tokenizer_path`.

``zephon make-sample OUT`` (or :func:`make_sample`) writes three sources of different
character, each split into several part files whose formats rotate through the requested
ones (by default one ``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst`` and ``.parquet`` per source)::

    OUT/prose/part-0000.jsonl           English-like prose, Zipf vocabulary
    OUT/prose/part-0001.jsonl.gz
    OUT/prose/part-0002.jsonl.zst
    OUT/prose/part-0003.parquet
    OUT/code/part-000{0..3}.*           Python- and JavaScript-like source files
    OUT/multilingual/part-000{0..3}.*   CJK, Hangul, Cyrillic, Arabic, accented Latin, emoji
    OUT/bad_records/part-0000.jsonl     only with --with-bad-records

Every record is ``{"id": "<source>-<n>", "text": str, "source": str, "meta": {"kind": str,
"lang": str}}`` (Parquet: the same columns, ``meta`` a struct). ``kind`` is ``normal``,
``empty``, ``whitespace`` (whitespace-only), ``one_word`` or ``long`` (>= 100,000
characters, i.e. well over 16k tokens for any usual tokenizer). Normal lengths are
lognormal, so the corpus has a realistic long tail.

Guarantees:

* Same arguments and same library versions (NumPy, pyarrow, zstandard) give byte-identical
  files. Randomness comes from NumPy ``PCG64`` generators seeded through
  :func:`loader.order.hashing.stable_hash64`; no timestamps or paths go into any file.
* Prefix stability: document ``<source>-<n>`` depends only on (seed, source, n), not on
  ``--docs``, so a larger sample extends a smaller one.
* Documents 1, 2, 3 and 4 of every source are an empty, a whitespace-only, a one-word and
  a long document, so any sample with at least 5 documents per source has every kind;
  further ones occur at low random rates.

The numbers (rates, medians) are module constants so tests can refer to them.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import numpy as np

from loader.cli import run_command
from loader.order.hashing import stable_hash64
from loader.samples import default_tokenizer_path  # noqa: F401  (also importable from here)

logger = logging.getLogger(__name__)


SOURCES = ("prose", "code", "multilingual")
# Share of --docs given to each source (largest-remainder rounding, in SOURCES order).
SOURCE_SHARES = {"prose": 0.5, "code": 0.25, "multilingual": 0.25}
FORMATS = ("jsonl", "jsonl.gz", "jsonl.zst", "parquet")
KINDS = ("normal", "empty", "whitespace", "one_word", "long")

DEFAULT_NUM_DOCS = 3000
DEFAULT_SEED = 0
DEFAULT_FILES_PER_SOURCE = 4

# Every source's documents 1..4 have these kinds, so small samples still cover them.
FORCED_KINDS = {1: "empty", 2: "whitespace", 3: "one_word", 4: "long"}
# Probability of each special kind elsewhere; the rest are "normal".
KIND_RATES = {"empty": 0.002, "whitespace": 0.002, "one_word": 0.004, "long": 0.0008}
LONG_MIN_CHARS = 100_000
LONG_MAX_CHARS = 250_000
# Lognormal normal-document lengths in characters: (median, sigma); capped below LONG.
LENGTH_PARAMS = {"prose": (800.0, 1.1), "code": (1200.0, 0.9), "multilingual": (500.0, 1.1)}
NORMAL_MAX_CHARS = 60_000
# Documents are generated in blocks with their own seed: vectorised, yet prefix-stable.
BLOCK_DOCS = 256
PARQUET_ROW_GROUP_ROWS = 1000
BAD_RECORDS_DIR = "bad_records"

_PARQUET_SCHEMA = None  # built lazily so importing this module does not import pyarrow


@dataclass(frozen=True)
class SampleDocument:
    """One generated document; ``to_record()`` is its JSONL / Parquet row."""

    id: str
    text: str
    source: str
    kind: str
    lang: str

    def to_record(self) -> dict:
        return {"id": self.id, "text": self.text, "source": self.source, "meta": {"kind": self.kind, "lang": self.lang}}


@dataclass(frozen=True)
class SourceSummary:
    """What :func:`make_sample` wrote for one source."""

    source: str
    paths: tuple[str, ...]
    num_docs: int
    num_chars: int
    num_bytes: int  # on disk, after compression
    kind_counts: dict[str, int] = field(default_factory=dict)

    def describe(self) -> str:
        kinds = ", ".join(f"{self.kind_counts.get(kind, 0)} {kind}" for kind in KINDS)
        return (
            f"{self.source}: {self.num_docs} docs ({kinds}), {self.num_chars:,} chars, "
            f"{len(self.paths)} files, {self.num_bytes / 1e6:.1f} MB"
        )


@dataclass(frozen=True)
class SampleSummary:
    """Everything :func:`make_sample` wrote; ``sources`` is keyed in :data:`SOURCES` order."""

    out_dir: str
    seed: int
    sources: dict[str, SourceSummary]
    bad_records_path: Optional[str] = None
    num_bad_records: int = 0  # lines in the bad-records file that a reader must reject
    num_good_records_in_bad_file: int = 0  # valid lines mixed into that file

    @property
    def num_docs(self) -> int:
        return sum(summary.num_docs for summary in self.sources.values())

    @property
    def paths(self) -> list[str]:
        return [path for summary in self.sources.values() for path in summary.paths]


def docs_per_source(num_docs: int) -> dict[str, int]:
    """Split ``num_docs`` over :data:`SOURCES` by :data:`SOURCE_SHARES` (sums exactly)."""
    if num_docs < 0:
        raise ValueError(f"num_docs must be >= 0 (got {num_docs=})")
    exact = {source: num_docs * SOURCE_SHARES[source] for source in SOURCES}
    counts = {source: int(value) for source, value in exact.items()}
    by_remainder = sorted(SOURCES, key=lambda s: (-(exact[s] - counts[s]), SOURCES.index(s)))
    for source in by_remainder[: num_docs - sum(counts.values())]:
        counts[source] += 1
    return counts


def _block_rng(seed: int, source: str, block: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(stable_hash64(seed, "sample-data", source, block)))


def _block_kinds(rng: np.random.Generator, block: int) -> list[str]:
    thresholds = np.cumsum([KIND_RATES[kind] for kind in KINDS[1:]])
    picks = np.searchsorted(thresholds, rng.random(BLOCK_DOCS), side="right")
    kinds = [KINDS[1:][p] if p < len(thresholds) else "normal" for p in picks]
    if block == 0:
        for offset, kind in FORCED_KINDS.items():
            kinds[offset] = kind
    return kinds


def _block_target_chars(rng: np.random.Generator, source: str, kinds: list[str]) -> np.ndarray:
    median, sigma = LENGTH_PARAMS[source]
    normal = np.clip(rng.lognormal(np.log(median), sigma, BLOCK_DOCS), 1.0, NORMAL_MAX_CHARS)
    long = rng.uniform(LONG_MIN_CHARS * 1.1, LONG_MAX_CHARS, BLOCK_DOCS)
    is_long = np.array([kind == "long" for kind in kinds])
    return np.where(is_long, long, normal).astype(np.int64)


def _generate_block(seed: int, source: str, block: int) -> list[tuple[str, str, str]]:
    """All BLOCK_DOCS documents of one block as (kind, lang, text); depends on nothing else."""
    rng = _block_rng(seed, source, block)
    kinds = _block_kinds(rng, block)
    target_chars = _block_target_chars(rng, source, kinds)
    return _GENERATORS[source](rng, kinds, target_chars)


def iter_documents(source: str, *, num_docs: int, seed: int = DEFAULT_SEED) -> Iterator[SampleDocument]:
    """Yield documents ``<source>-0`` .. ``<source>-{num_docs-1}`` (prefix-stable, see module doc)."""
    if source not in SOURCES:
        raise ValueError(f"unknown source {source!r}; choose one of {', '.join(SOURCES)}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0 (got {seed=})")
    produced = 0
    block = 0
    while produced < num_docs:
        for kind, lang, text in _generate_block(seed, source, block):
            if produced == num_docs:
                break
            yield SampleDocument(id=f"{source}-{produced}", text=text, source=source, kind=kind, lang=lang)
            produced += 1
        block += 1


# ---------------------------------------------------------------------------------------
# Text. Lexicons are fixed (seeded by name only, never by the user's seed): the seed picks
# documents, not the language. Each source generator maps a block's kinds and target
# lengths to (kind, lang, text) triples, drawing only from the block's generator.

_EN_TOP = (
    "the of and to a in is that for it as was with be by on not he I this are or his from at which but "
    "have an they you were her she there one all we their has been would more if will its who so can no "
    "other when said into out them what up some time only than could new these two may first then do any "
    "like my now over such our man me even most made after also did many before must through back years "
    "where much your way well down should because each just those people how too good data model train"
).split()
_LANG_TOP = {
    "fr": "le la de et à les des est un une que pour dans qui sur pas plus ne avec il elle ce être très où été déjà après même",
    "de": "der die und das ist nicht ein zu mit für auf über müssen größer schön straße mädchen können wäre hören",
    "es": "el la de que y en los se por un con más está también año niño señor mañana qué cómo",
    "ru": "и в не на я что он с это как по но мы для они ещё всё",
    "ar": "في من على إلى أن هذا التي عن مع كان",
    "ja": "の は に を が で と も た です ます する こと",
    "ko": "은 는 이 가 을 를 에 의 하다 있다",
}
# (onsets, vowels, codas, suffixes) of the pseudo-words behind each alphabetic lexicon.
_SYLLABLES = {
    "en": ("b c d f g h l m n p r s t v w br cl cr dr fl gr pl pr sh st str th tr ch", "a e i o u ea ou ai io",
           "n r s t l m nd st ng ck rt nt ss", "ing ed ly tion er s ment ness"),
    "fr": ("b c d f g j l m n p r s t v ch pl tr gr", "a e é è ê i o ou au eau u â ô oi", "n r s t l x", "ment tion eur ée ais"),
    "de": ("b d f g h k l m n p r s t w z sch st sp kr", "a e i o u ä ö ü ei au ie", "n r s t l ß ch sch ng", "ung heit keit en er lich"),
    "es": ("b c d f g j l m n ñ p r s t v ll rr ch", "a e i o u á é í ó ú ue ie", "n r s l z", "ción mente ado ita os as"),
    "ru": ("б в г д з к л м н п р с т ф х ц ч ш щ ж", "а е и о у ы э ю я ё", "н р с т л й к м", "ость ение ский ать"),
}
_HANZI = (
    "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可里后小么心多天而能好"
    "都然没日于起还发成事只作当想看文无开手十用主行方又如前所本见经头面公同三已老从动两长知民样现分将外但身些与高意进把法此"
    "实回二理美点月明其种声全工己话儿者向情部正名定女问力机给等几很业最间新什打便位因重被走电四第门相次东政海口使教西再平真"
    "听世气信北少关并内加化由却代军产入先山五太水万市眼体别处总才场师书比住员九笑性通目华报立马命张活难神数件安表原车白应路"
)
_HIRAGANA = "あいうえおかきくけこさしすせそたちつてとなにぬねのはひふへほまみむめもやゆよらりるれろわをん"
_KATAKANA = "アイウエオカキクケコサシスセソタチツテトナニヌネノハヒフヘホマミムメモヤユヨラリルレロワン"
_ARABIC = "ابتثجحخدذرزسشصضطظعغفقكلمنهوي"
_EMOJI = np.array("😀 😂 🥲 😍 🤔 🙏 👍 👍🏽 🎉 🔥 ✨ 🚀 ❤️ 🌍 🍣 🐍 👩‍💻 👨‍👩‍👧 🇯🇵 🇫🇷 🏳️‍🌈 ☕ 📚 🤖".split(), dtype=object)
# Share of multilingual documents per language, and of documents mixing two languages.
MULTILINGUAL_WEIGHTS = {"zh": 0.2, "ja": 0.15, "ko": 0.1, "fr": 0.15, "de": 0.12, "es": 0.13, "ru": 0.1, "ar": 0.05}
MULTILINGUAL_MIXED_RATE = 0.12


@dataclass(frozen=True)
class _Language:
    """A Zipf-distributed lexicon plus the punctuation of its script."""

    name: str
    words: np.ndarray  # object array of str, most frequent first
    capitalised: np.ndarray  # same words, sentence-initial form
    cdf: np.ndarray  # cumulative Zipf-Mandelbrot weights over ranks
    space: str  # between words: "" for Chinese and Japanese
    comma: str
    separators: np.ndarray  # [end mark, (mid-text, paragraph break, end of document)]
    sentence_words: float  # mean words per sentence
    emoji_rate: float  # chance that a word is followed by an emoji
    mean_word_chars: float  # expected characters per word including separators

    def random_word(self, rng: np.random.Generator) -> str:
        return self.words[min(int(np.searchsorted(self.cdf, rng.random(), side="right")), len(self.words) - 1)]


def _make_language(name, words, *, space=" ", comma=",", end_marks=(".", ".", ".", "?", "!"), sentence_words=15.0, emoji_rate=0.0, cased=True) -> _Language:
    words = list(dict.fromkeys(words))  # de-duplicate, keeping rank order
    weights = 1.0 / (np.arange(len(words)) + 2.7) ** 1.07
    cdf = np.cumsum(weights) / weights.sum()
    mean_len = float(np.dot(weights / weights.sum(), [len(word) for word in words]))
    capitalised = [word[:1].upper() + word[1:] for word in words] if cased else words
    separators = np.array([[mark + space, mark + "\n\n", mark] for mark in end_marks], dtype=object)
    return _Language(
        name=name,
        words=np.array(words, dtype=object),
        capitalised=np.array(capitalised, dtype=object),
        cdf=cdf,
        space=space,
        comma=comma + space,
        separators=separators,
        sentence_words=sentence_words,
        emoji_rate=emoji_rate,
        mean_word_chars=mean_len + len(space) + 1.0 / sentence_words + 2 * emoji_rate,
    )


def _pseudo_words(rng: np.random.Generator, count: int, make_word) -> list[str]:
    words: dict[str, None] = {}
    for _ in range(count * 3):  # bounded: duplicates are common for small alphabets
        words[make_word()] = None
        if len(words) == count:
            break
    ordered = list(words)
    return [ordered[i] for i in rng.permutation(len(ordered))]  # ranks must not follow the alphabet


def _syllable_maker(rng: np.random.Generator, name: str):
    onsets, vowels, codas, suffixes = (_SYLLABLES[name][0].split() + [""], _SYLLABLES[name][1].split(),
                                       _SYLLABLES[name][2].split() + [""] * 8, _SYLLABLES[name][3].split() + [""] * 12)
    d = _Draws(rng)

    def make() -> str:
        syllables = d.pick((1, 1, 1, 2, 2, 3))
        parts = [d.pick(onsets) + d.pick(vowels) + d.pick(codas) for _ in range(syllables)]
        return "".join(parts) + d.pick(suffixes)

    return make


def _chars_maker(rng: np.random.Generator, alphabet: str, lengths: Sequence[int]):
    d = _Draws(rng)

    def make() -> str:
        return "".join(d.pick(alphabet) for _ in range(d.pick(lengths)))

    return make


def _hangul_maker(rng: np.random.Generator):
    # Common initials, vowels and finals only, so the syllables look like real Korean.
    syllables = [chr(0xAC00 + (initial * 21 + vowel) * 28 + final)
                 for initial in (0, 2, 3, 5, 6, 7, 9, 11, 12, 18) for vowel in (0, 1, 4, 6, 8, 13, 18, 20) for final in (0, 0, 1, 4, 8, 16, 21)]
    d = _Draws(rng)

    def make() -> str:
        return "".join(d.pick(syllables) for _ in range(d.pick((1, 2, 2, 3))))

    return make


_LANGUAGES: dict[str, _Language] = {}


def _languages() -> dict[str, _Language]:
    """All lexicons, built once per process from fixed seeds (about 0.3 s)."""
    if _LANGUAGES:
        return _LANGUAGES
    langs = {}
    for name in ("en", "fr", "de", "es", "ru"):
        rng = np.random.Generator(np.random.PCG64(stable_hash64("sample-data-lexicon", name)))
        top = _EN_TOP if name == "en" else _LANG_TOP[name].split()
        words = top + _pseudo_words(rng, 20000 if name == "en" else 6000, _syllable_maker(rng, name))
        langs[name] = _make_language(name, words, emoji_rate=0.0 if name == "en" else 0.02)
    rng = np.random.Generator(np.random.PCG64(stable_hash64("sample-data-lexicon", "cjk")))
    langs["ar"] = _make_language("ar", _LANG_TOP["ar"].split() + _pseudo_words(rng, 5000, _chars_maker(rng, _ARABIC, (2, 3, 4, 5))),
                                 comma="،", end_marks=(".", ".", "؟"), emoji_rate=0.02, cased=False)
    hanzi = list(_HANZI) + _pseudo_words(rng, 4000, _chars_maker(rng, _HANZI, (2,)))
    langs["zh"] = _make_language("zh", hanzi, space="", comma="，", end_marks=("。", "。", "！", "？"), sentence_words=12, emoji_rate=0.03, cased=False)
    japanese = (_LANG_TOP["ja"].split() + _pseudo_words(rng, 1500, _chars_maker(rng, _HANZI[:200], (1, 2)))
                + _pseudo_words(rng, 1500, _chars_maker(rng, _HIRAGANA, (1, 2, 3))) + _pseudo_words(rng, 1000, _chars_maker(rng, _KATAKANA, (2, 3, 4))))
    langs["ja"] = _make_language("ja", japanese, space="", comma="、", end_marks=("。",), sentence_words=14, emoji_rate=0.03, cased=False)
    langs["ko"] = _make_language("ko", _LANG_TOP["ko"].split() + _pseudo_words(rng, 3000, _hangul_maker(rng)), end_marks=(".", ".", "?"), emoji_rate=0.03, cased=False)
    _LANGUAGES.update(langs)
    return _LANGUAGES


def _render(rng: np.random.Generator, lang: _Language, word_counts: Sequence[int]) -> list[str]:
    """One text per entry of ``word_counts``: Zipf words, sentences, commas, paragraphs.

    Vectorised over all words of all texts; only the final per-text join is a Python loop.
    """
    counts = np.asarray(word_counts, dtype=np.int64)
    total = int(counts.sum())
    if total == 0:
        return ["" for _ in counts]
    ranks = np.minimum(np.searchsorted(lang.cdf, rng.random(total), side="right"), len(lang.words) - 1)
    starts = np.cumsum(counts) - counts
    lasts = (starts + counts - 1)[counts > 0]
    ends_sentence = rng.random(total) < 1.0 / lang.sentence_words
    ends_sentence[lasts] = True
    capitalise = np.concatenate([[True], ends_sentence[:-1]])
    capitalise[starts[counts > 0]] = True
    words = np.where(capitalise, lang.capitalised[ranks], lang.words[ranks])
    with_emoji = rng.random(total) < lang.emoji_rate
    emoji = _EMOJI[rng.integers(0, len(_EMOJI), total)]
    words[with_emoji] = words[with_emoji] + lang.space + emoji[with_emoji]
    # Separator after each word: space, comma, or end mark + (space | paragraph | nothing).
    position = np.where(rng.random(total) < 0.15, 1, 0)
    position[lasts] = 2
    marks = rng.integers(0, len(lang.separators), total)
    separators = np.full(total, lang.space, dtype=object)
    separators[rng.random(total) < 0.07] = lang.comma
    separators[ends_sentence] = lang.separators[marks, position][ends_sentence]
    pieces = np.empty(2 * total, dtype=object)
    pieces[0::2], pieces[1::2] = words, separators
    return ["".join(pieces[2 * start : 2 * (start + count)].tolist()) for start, count in zip(starts, counts)]


def _whitespace(rng: np.random.Generator, chars: str) -> str:
    return "".join(chars[i] for i in rng.integers(0, len(chars), 1 + int(rng.integers(0, 12))))


def _lexicon_block(rng, kinds, target_chars, *, weights: dict[str, float], mixed_rate: float, whitespace_chars: str):
    """Documents made of :func:`_render` segments; mixed documents switch language once."""
    langs = _languages()
    names = list(weights)
    probabilities = np.array([weights[name] for name in names]) / sum(weights.values())
    primary = rng.choice(len(names), size=len(kinds), p=probabilities)
    secondary = (primary + 1 + rng.integers(0, max(1, len(names) - 1), len(kinds))) % len(names)
    mixed = rng.random(len(kinds)) < mixed_rate
    labels, texts, segments = [], [""] * len(kinds), {name: [] for name in names}  # lang -> [(doc, words)]
    for doc, kind in enumerate(kinds):
        first, second = names[primary[doc]], names[secondary[doc]]
        is_mixed = bool(mixed[doc]) and kind == "normal"
        labels.append(f"{first}+{second}" if is_mixed else first)
        if kind == "whitespace":
            texts[doc] = _whitespace(rng, whitespace_chars)
        elif kind == "one_word":
            texts[doc] = langs[first].random_word(rng)
        elif kind in ("normal", "long"):
            num_words = max(1, int(target_chars[doc] / langs[first].mean_word_chars))
            if is_mixed:
                segments[first].append((doc, (num_words + 1) // 2))
                segments[second].append((doc, num_words // 2))
            else:
                segments[first].append((doc, num_words))
    parts: dict[int, list[str]] = {}
    for name in names:  # fixed order: the draws must not depend on dict iteration quirks
        rendered = _render(rng, langs[name], [words for _, words in segments[name]])
        for (doc, _), text in zip(segments[name], rendered):
            parts.setdefault(doc, []).append(text)
    for doc, doc_parts in sorted(parts.items()):
        texts[doc] = "\n\n".join(doc_parts)
        while kinds[doc] == "long" and len(texts[doc]) < LONG_MIN_CHARS:  # rare: short-worded draw
            texts[doc] += "\n\n" + _render(rng, langs[labels[doc]], [2000])[0]
    return list(zip(kinds, labels, texts))


def _prose_block(rng, kinds, target_chars):
    return _lexicon_block(rng, kinds, target_chars, weights={"en": 1.0}, mixed_rate=0.0, whitespace_chars=" \t\n\r")


def _multilingual_block(rng, kinds, target_chars):
    return _lexicon_block(rng, kinds, target_chars, weights=MULTILINGUAL_WEIGHTS, mixed_rate=MULTILINGUAL_MIXED_RATE,
                          whitespace_chars=" \t\n\u3000\u00a0")


class _Draws:
    """Uniform draws from a Generator, fetched in chunks so per-line Python code stays fast."""

    def __init__(self, rng: np.random.Generator, chunk: int = 4096):
        self._rng, self._chunk, self._buffer, self._position = rng, chunk, [], 0
        self._words: list[str] = []  # identifier parts, drawn vectorised in chunks

    def uniform(self) -> float:
        if self._position == len(self._buffer):
            self._buffer, self._position = self._rng.random(self._chunk).tolist(), 0
        self._position += 1
        return self._buffer[self._position - 1]

    def below(self, n: int) -> int:
        return min(int(self.uniform() * n), n - 1)

    def pick(self, options: Sequence):
        return options[self.below(len(options))]

    def word(self) -> str:
        if not self._words:
            words = _code_words()
            ranks = np.minimum(np.searchsorted(_CODE_CDF, self._rng.random(self._chunk)), len(words) - 1)
            self._words = np.asarray(words, dtype=object)[ranks][::-1].tolist()  # reversed: pop() from the end
        return self._words.pop()

    def name(self, camel: bool = False) -> str:
        parts = [self.word() for _ in range(1 + self.below(3))]
        return parts[0] + "".join(p.capitalize() for p in parts[1:]) if camel else "_".join(parts)

    def sentence(self) -> str:
        return " ".join(self.word() for _ in range(3 + self.below(10))).capitalize() + "."


_CODE_WORDS: list[str] = []
_CODE_CDF = np.zeros(0)
_PY_IMPORTS = ("import os", "import sys", "import json", "import math", "from pathlib import Path",
               "from typing import Optional", "from dataclasses import dataclass", "import numpy as np")
_JS_IMPORTS = ("import fs from 'fs';", "import path from 'path';", "const assert = require('assert');",
               "import { readFile } from 'node:fs/promises';", "import React, { useState } from 'react';")
_ONE_WORD_CODE = ("pass", "return", "None", "undefined", "TODO", "}", "main")


def _code_words() -> list[str]:
    """ASCII identifiers' parts: the English lexicon's lowercase words, in rank order."""
    global _CODE_CDF
    if not _CODE_WORDS:
        english = _languages()["en"].words
        _CODE_WORDS.extend(w for w in english[:3000] if w.isascii() and w.isalpha() and w.islower() and len(w) > 1)
        weights = 1.0 / (np.arange(len(_CODE_WORDS)) + 2.7) ** 1.07
        _CODE_CDF = np.cumsum(weights) / weights.sum()
    return _CODE_WORDS


def _expression(d: _Draws, names: list[str], js: bool) -> str:
    name, number = d.pick(names), d.below(1000)
    options = (f"{name} + {number}", f"{d.name(js)}({name})", f"{name} * {number}", f'"{d.word()} {d.word()}"',
               str(number), f"{name}[{d.below(8)}]", "null" if js else "None",
               f"{name}.length" if js else f"len({name})", f"`${{{name}}} {d.word()}`" if js else f'f"{{{name}}}: {d.word()}\\n"')
    return d.pick(options)


def _statement(d: _Draws, names: list[str], indent: str, js: bool) -> list[str]:
    target, name, end = d.name(js), d.pick(names), ";" if js else ""
    decl = "const " if js else ""
    kind = d.below(7)
    if kind == 0:
        names.append(target)
        return [f"{indent}{decl}{target} = {_expression(d, names, js)}{end}"]
    if kind == 1:
        op = d.pick(("<", ">", "===", "!==", ">=") if js else ("<", ">", "==", "!=", ">="))
        if js:
            return [f"{indent}if ({name} {op} {d.below(100)}) {{", f"{indent}  {name} = {_expression(d, names, js)};", f"{indent}}}"]
        return [f"{indent}if {name} {op} {d.below(100)}:", f"{indent}    {name} = {_expression(d, names, js)}"]
    if kind == 2:
        if js:
            return [f"{indent}for (let i = 0; i < {d.below(64)}; i++) {{", f"{indent}  {name} += i;", f"{indent}}}"]
        return [f"{indent}for i in range({d.below(64)}):", f"{indent}    {name} += i"]
    if kind == 3:
        return [f"{indent}{'//' if js else '#'} {d.sentence()}"]
    if kind == 4:
        names.append(target)
        if js:
            return [f"{indent}const {target} = {name}.filter((x) => x !== {d.below(10)}).map((x) => x * 2);"]
        return [f"{indent}{target} = [x for x in {name} if x != {d.below(10)}]"]
    if kind == 5:
        names.append(target)
        return [f"{indent}{decl}{target} = {{\"{d.word()}\": {d.below(500)}, \"{d.word()}\": '{d.sentence()}'}}{end}"]
    if js:
        return [f"{indent}try {{", f"{indent}  {target}({name});", f"{indent}}} catch (err) {{",
                f"{indent}  throw new Error(\"{d.sentence()}\");", f"{indent}}}"]
    return [f"{indent}try:", f"{indent}    {target}({name})", f"{indent}except {d.pick(('ValueError', 'KeyError', 'OSError'))} as exc:",
            f"{indent}    raise RuntimeError(\"{d.sentence()}\") from exc"]


def _function(d: _Draws, indent: str, js: bool, method: bool = False) -> list[str]:
    params = [d.name(js) for _ in range(d.below(4))]
    names = params[:] or ["value"]
    inner = indent + ("  " if js else "    ")
    if js:
        head = f"{indent}{d.name(True)}({', '.join(params)}) {{" if method else f"{indent}function {d.name(True)}({', '.join(params)}) {{"
        lines = [f"{indent}/** {d.sentence()} */", head] if d.uniform() < 0.5 else [head]
    else:
        lines = [f"{indent}def {d.name()}({', '.join((['self'] if method else []) + params)}):"]
        if d.uniform() < 0.6:
            lines.append(f'{inner}"""{d.sentence()}"""')
    for _ in range(1 + d.below(8)):
        lines.extend(_statement(d, names, inner, js))
    lines.append(f"{inner}return {_expression(d, names, js)}{';' if js else ''}")
    return lines + ([f"{indent}}}"] if js else [])


def _code_unit(d: _Draws, js: bool) -> list[str]:
    if d.uniform() < 0.75:
        return _function(d, "", js)
    class_name = d.name(True).capitalize()
    lines = [f"class {class_name} {{" if js else f"class {class_name}:"]
    if not js:
        lines.append(f'    """{d.sentence()}"""')
    for _ in range(1 + d.below(3)):
        lines += [""] + _function(d, "  " if js else "    ", js, method=True)
    return lines + (["}"] if js else [])


def _code_block(rng, kinds, target_chars):
    d = _Draws(rng)
    out = []
    for kind, target in zip(kinds, target_chars):
        js = d.uniform() < 0.4
        lang = "javascript" if js else "python"
        if kind in ("empty", "whitespace", "one_word"):
            text = {"empty": "", "whitespace": _whitespace(rng, " \t\n\r"), "one_word": d.pick(_ONE_WORD_CODE)}[kind]
            out.append((kind, lang, text))
            continue
        lines = list(dict.fromkeys(d.pick(_JS_IMPORTS if js else _PY_IMPORTS) for _ in range(d.below(4))))
        size = sum(len(line) + 1 for line in lines)
        while size < target:
            unit = ([""] if lines else []) + ([""] if lines and not js else []) + _code_unit(d, js)
            lines += unit
            size += sum(len(line) + 1 for line in unit)
        out.append((kind, lang, "\n".join(lines) + "\n"))
    return out


_GENERATORS = {"prose": _prose_block, "code": _code_block, "multilingual": _multilingual_block}


# ---------------------------------------------------------------------------------------
# Writers. Each writes one part file deterministically (no timestamps, fixed settings).


def _jsonl_bytes(docs: Sequence[SampleDocument]) -> bytes:
    return "".join(json.dumps(doc.to_record(), ensure_ascii=False) + "\n" for doc in docs).encode("utf-8")


def _write_jsonl(path: str, docs: Sequence[SampleDocument], fmt: str) -> None:
    chunks = [docs[start : start + PARQUET_ROW_GROUP_ROWS] for start in range(0, len(docs), PARQUET_ROW_GROUP_ROWS)]
    with open(path, "wb") as raw:
        if fmt == "jsonl":
            for chunk in chunks:
                raw.write(_jsonl_bytes(chunk))
        elif fmt == "jsonl.gz":
            # mtime=0 and no file name in the header: otherwise every run differs.
            with gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=6, mtime=0) as out:
                for chunk in chunks:
                    out.write(_jsonl_bytes(chunk))
        elif fmt == "jsonl.zst":
            import zstandard

            with zstandard.ZstdCompressor(level=3).stream_writer(raw, closefd=False) as out:
                for chunk in chunks:
                    out.write(_jsonl_bytes(chunk))
        else:
            raise ValueError(f"not a JSONL format: {fmt!r}")


def _parquet_schema():
    global _PARQUET_SCHEMA
    if _PARQUET_SCHEMA is None:
        import pyarrow as pa

        meta = pa.struct([("kind", pa.string()), ("lang", pa.string())])
        _PARQUET_SCHEMA = pa.schema([("id", pa.string()), ("text", pa.string()), ("source", pa.string()), ("meta", meta)])
    return _PARQUET_SCHEMA


def _write_parquet(path: str, docs: Sequence[SampleDocument]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = _parquet_schema()
    with pq.ParquetWriter(path, schema, compression="zstd", write_statistics=True) as writer:
        for start in range(0, max(len(docs), 1), PARQUET_ROW_GROUP_ROWS):
            chunk = docs[start : start + PARQUET_ROW_GROUP_ROWS]
            table = pa.Table.from_pylist([doc.to_record() for doc in chunk], schema=schema)
            writer.write_table(table)


def part_file_name(part: int, fmt: str) -> str:
    return f"part-{part:04d}.{fmt}"


def _check_no_stale_parts(directory: str, planned: set[str]) -> None:
    """Refuse to leave part files of an earlier, differently-shaped run next to ours."""
    if not os.path.isdir(directory):
        return
    stale = sorted(name for name in os.listdir(directory) if name.startswith("part-") and name not in planned)
    if stale:
        raise FileExistsError(
            f"{directory} already holds part files this run would not overwrite ({', '.join(stale)}); "
            "they would mix into the corpus. Use an empty output directory."
        )


def _plan_parts(num_docs: int, formats: Sequence[str], files_per_source: int) -> list[tuple[str, str, int]]:
    """(file name, format, document count) per part; parts hold contiguous ranges of n."""
    num_parts = max(1, min(files_per_source, num_docs))
    # The first num_docs % num_parts parts get one document more.
    sizes = [num_docs // num_parts + (1 if part < num_docs % num_parts else 0) for part in range(num_parts)]
    part_formats = [formats[part % len(formats)] for part in range(num_parts)]
    return [(part_file_name(part, fmt), fmt, size) for part, (fmt, size) in enumerate(zip(part_formats, sizes))]


def _write_source(directory: str, source: str, parts: list[tuple[str, str, int]], seed: int) -> SourceSummary:
    os.makedirs(directory, exist_ok=True)
    documents = iter_documents(source, num_docs=sum(size for _, _, size in parts), seed=seed)
    paths, kind_counts, num_chars, num_bytes = [], {kind: 0 for kind in KINDS}, 0, 0
    for name, fmt, size in parts:
        docs = [next(documents) for _ in range(size)]
        path = os.path.join(directory, name)
        if fmt == "parquet":
            _write_parquet(path, docs)
        else:
            _write_jsonl(path, docs, fmt)
        for doc in docs:
            kind_counts[doc.kind] += 1
            num_chars += len(doc.text)
        num_bytes += os.path.getsize(path)
        paths.append(path)
        logger.debug("wrote %s (%d docs)", path, size)
    return SourceSummary(source, tuple(paths), sum(size for _, _, size in parts), num_chars, num_bytes, kind_counts)


def bad_record_lines() -> tuple[list[bytes], int]:
    """Lines of the bad-records file and how many of them are bad (the rest are valid).

    One case per line, each a way real corpora go wrong; two valid records are mixed in so
    a reader must reject per record, not per file.
    """
    def record(rid: str, **fields) -> bytes:
        return json.dumps({"id": rid, **fields, "source": BAD_RECORDS_DIR}, ensure_ascii=False).encode("utf-8")

    meta = {"kind": "bad", "lang": "en"}
    bad = [
        b'{"id": "bad-malformed-json", "text": "this line is cut off',  # malformed JSON
        record("bad-missing-text", meta=meta),  # no "text" field
        record("bad-int-text", text=12345, meta=meta),  # text is not a string
        record("bad-null-text", text=None, meta=meta),
        record("bad-list-text", text=["a", "list"], meta=meta),
        b'{"id": "bad-invalid-utf8", "text": "caf\xe9 \xff\xfe broken bytes", "source": "bad_records"}',
        record("bad-empty-text", text="", meta=meta),
        b'["not", "an", "object"]',
    ]
    good = [
        record("bad_records-good-0", text="A valid record between bad ones.", meta={"kind": "normal", "lang": "en"}),
        record("bad_records-good-1", text="Another valid record: 東京 🚀", meta={"kind": "normal", "lang": "mixed"}),
    ]
    lines = bad[:3] + [good[0]] + bad[3:6] + [good[1]] + bad[6:]
    return lines, len(bad)


def _write_bad_records(out_dir: str) -> tuple[str, int, int]:
    directory = os.path.join(out_dir, BAD_RECORDS_DIR)
    name = part_file_name(0, "jsonl")
    os.makedirs(directory, exist_ok=True)
    lines, num_bad = bad_record_lines()
    path = os.path.join(directory, name)
    with open(path, "wb") as out:
        out.write(b"\n".join(lines) + b"\n")
    return path, num_bad, len(lines) - num_bad


def make_sample(
    out_dir: str,
    *,
    num_docs: int = DEFAULT_NUM_DOCS,
    seed: int = DEFAULT_SEED,
    formats: Sequence[str] = FORMATS,
    files_per_source: int = DEFAULT_FILES_PER_SOURCE,
    with_bad_records: bool = False,
) -> SampleSummary:
    """Write the sample corpus under ``out_dir`` (local path) and describe what was written.

    ``num_docs`` is the total over all sources (split by :data:`SOURCE_SHARES`). Part
    ``k`` of a source is written in ``formats[k % len(formats)]``. Existing files with the
    same names are overwritten; other ``part-*`` files in a source directory are an error.
    """
    formats = tuple(formats)
    unknown = [fmt for fmt in formats if fmt not in FORMATS]
    if not formats or unknown:
        raise ValueError(f"formats must be a non-empty subset of {', '.join(FORMATS)} (got {list(formats)})")
    if files_per_source < 1:
        raise ValueError(f"files_per_source must be >= 1 (got {files_per_source=})")
    if seed < 0:
        raise ValueError(f"seed must be >= 0 (got {seed=})")
    counts = docs_per_source(num_docs)
    plans = {source: _plan_parts(counts[source], formats, files_per_source) for source in SOURCES}
    # Check every directory before writing anything, so a refused run changes nothing.
    for source, parts in plans.items():
        _check_no_stale_parts(os.path.join(out_dir, source), {name for name, _, _ in parts})
    if with_bad_records:
        _check_no_stale_parts(os.path.join(out_dir, BAD_RECORDS_DIR), {part_file_name(0, "jsonl")})
    summaries = {}
    for source, parts in plans.items():
        summaries[source] = _write_source(os.path.join(out_dir, source), source, parts, seed)
        logger.info("%s", summaries[source].describe())
    bad_path, num_bad, num_good = (None, 0, 0)
    if with_bad_records:
        bad_path, num_bad, num_good = _write_bad_records(out_dir)
    return SampleSummary(os.path.abspath(out_dir), seed, summaries, bad_path, num_bad, num_good)


def _parse_formats(value: str) -> tuple[str, ...]:
    formats = tuple(part.strip() for part in value.split(",") if part.strip())
    unknown = [fmt for fmt in formats if fmt not in FORMATS]
    if not formats or unknown:
        raise argparse.ArgumentTypeError(f"unknown format(s) {unknown or value!r}; choose from {','.join(FORMATS)}")
    return formats


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zephon make-sample",
        description="Generate a deterministic sample corpus (prose, code, multilingual) as JSONL, .gz, .zst and Parquet.",
    )
    parser.add_argument("out", help="output directory (created; must not hold part files of a different run)")
    parser.add_argument("--docs", type=int, default=DEFAULT_NUM_DOCS, help=f"total documents over all sources (default {DEFAULT_NUM_DOCS})")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"generator seed, >= 0 (default {DEFAULT_SEED})")
    parser.add_argument("--formats", type=_parse_formats, default=FORMATS, help=f"comma-separated, rotated over part files (default {','.join(FORMATS)})")
    parser.add_argument("--files-per-source", type=int, default=DEFAULT_FILES_PER_SOURCE, help=f"part files per source (default {DEFAULT_FILES_PER_SOURCE})")
    parser.add_argument("--with-bad-records", action="store_true", help=f"also write {BAD_RECORDS_DIR}/part-0000.jsonl with records a reader must reject")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``zephon make-sample``: errors are reported by :func:`loader.cli.run_command`."""
    return run_command("make-sample", argv)


def command(argv: Sequence[str]) -> int:
    parser = build_arg_parser()
    args = parser.parse_args(argv)
    for option, value, minimum in (("--docs", args.docs, 0), ("--seed", args.seed, 0),
                                   ("--files-per-source", args.files_per_source, 1)):
        if value < minimum:
            parser.error(f"{option} must be >= {minimum} (got {value})")
    # An output that is a file, or part files of another run: FileExistsError / NotADirectoryError,
    # reported by the CLI in one line.
    summary = make_sample(
        args.out,
        num_docs=args.docs,
        seed=args.seed,
        formats=args.formats,
        files_per_source=args.files_per_source,
        with_bad_records=args.with_bad_records,
    )
    for source_summary in summary.sources.values():
        print(source_summary.describe())
    if summary.bad_records_path:
        print(f"{BAD_RECORDS_DIR}: {summary.num_bad_records} bad + {summary.num_good_records_in_bad_file} valid records -> {summary.bad_records_path}")
    print(f"wrote {summary.num_docs} documents under {summary.out_dir} (seed {summary.seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
