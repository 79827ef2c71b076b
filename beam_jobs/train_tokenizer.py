"""Train the small byte-level BPE shipped as ``beam_jobs/assets/tokenizer.json``.

    python -m beam_jobs.train_tokenizer --out beam_jobs/assets/tokenizer.json

The file is a demo and test fixture only: Zephon never assumes this vocabulary (users pass
their own ``tokenizer.json``). It is trained on :mod:`loader.samples.corpus`'s generator,
so it covers English-like prose, Python/JavaScript and multilingual text with emoji.

Design choices, and why:

* Byte-level pre-tokenizer and decoder with the full 256-byte initial alphabet and no
  normalizer: every string, including emoji, rare CJK and stray control characters,
  encodes without ``<unk>`` and ``decode(encode(text)) == text`` exactly.
* ``add_prefix_space=False``: a prefix space would make the round trip add a character.
* No post-processor: the loader, not the tokenizer, decides where EOS/BOS go.
* Special tokens come first, so their ids are fixed: ``<|endoftext|>`` = 0,
  ``<|begin_of_text|>`` = 1, ``<pad>`` = 2.

Determinism: the corpus is generated deterministically, and the ``tokenizers`` BPE trainer
breaks ties between equally frequent pairs by the pair itself, so the same library version
writes the same file (checked by ``--check``). A newer ``tokenizers`` may serialise
differently; the fixture is committed, so that only matters when retraining.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Iterable, Iterator, Optional, Sequence

from loader.samples import corpus as sample_data
from loader.cli import run_command

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ("<|endoftext|>", "<|begin_of_text|>", "<pad>")
DEFAULT_VOCAB_SIZE = 8000
# Training corpus: this many sample documents (all sources, sample_data's shares) from a
# seed different from make-sample's default, so the fixture is not fitted to the demo data.
DEFAULT_TRAINING_DOCS = 6000
TRAINING_SEED = 20240601


def training_texts(num_docs: int = DEFAULT_TRAINING_DOCS, seed: int = TRAINING_SEED) -> Iterator[str]:
    """The texts the fixture is trained on, in a fixed order (source by source)."""
    for source, count in sample_data.docs_per_source(num_docs).items():
        for document in sample_data.iter_documents(source, num_docs=count, seed=seed):
            if document.text.strip():
                yield document.text


def train(texts: Iterable[str], *, vocab_size: int = DEFAULT_VOCAB_SIZE):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``texts`` (see module doc)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must cover the 256 bytes and {len(SPECIAL_TOKENS)} special tokens (got {vocab_size=})")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != expected_id:  # guards against a trainer change
            raise RuntimeError(f"{token} got id {tokenizer.token_to_id(token)}, expected {expected_id}")
    return tokenizer


PROG = "python -m beam_jobs.train_tokenizer"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Not a ``zephon`` subcommand, but its errors are reported the same way (:func:`loader.cli.run_command`)."""
    return run_command("beam_jobs.train_tokenizer", argv, prog=PROG)


def command(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=sample_data.default_tokenizer_path(), help="where to write tokenizer.json (default: the shipped fixture)")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument("--docs", type=int, default=DEFAULT_TRAINING_DOCS, help="sample documents to train on")
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 if the trained tokenizer differs from --out")
    args = parser.parse_args(argv)
    smallest = 256 + len(SPECIAL_TOKENS)
    if args.vocab_size < smallest:
        parser.error(f"--vocab-size must cover the 256 bytes and {len(SPECIAL_TOKENS)} special tokens: >= {smallest} "
                     f"(got {args.vocab_size})")
    if args.docs < 1:
        parser.error(f"--docs must be >= 1 (got {args.docs})")
    existing = None
    if args.check:  # read first: a missing or unreadable --out fails before a minute of training
        with open(args.out, "rb") as handle:
            existing = handle.read()
    tokenizer = train(training_texts(args.docs), vocab_size=args.vocab_size)
    serialised = tokenizer.to_str(pretty=False)
    if args.check:
        same = existing == serialised.encode("utf-8")
        print(f"{args.out}: {'up to date' if same else 'DIFFERS from a fresh training run'}")
        return 0 if same else 1
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as out:
        out.write(serialised)
    ids = ", ".join(f"{token}={tokenizer.token_to_id(token)}" for token in SPECIAL_TOKENS)
    print(f"wrote {args.out}: vocab_size={tokenizer.get_vocab_size()} ({ids}), {len(serialised):,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
