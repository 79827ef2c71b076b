"""Loading a Hugging Face ``tokenizers`` file and naming its special tokens.

Shared by the Beam job (offline tokenization) and the loader (online tokenization) so that
both produce the same ids and agree on the tokenizer fingerprint. Nothing here assumes a
vocabulary: any ``tokenizer.json`` works, and special tokens are looked up by name.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional

from loader.errors import TokenizerError
from loader.io import storage

# Tried in order when the config does not name the token explicitly.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]", "<|eot_id|>")
BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "[CLS]", "<|startoftext|>")


def load_tokenizer(path: str, storage_options=None):
    """Load ``tokenizer.json`` from a local path, ``gs://`` or ``s3://`` (read with ``storage_options``).

    A path that is missing, a directory or unreadable, and a file that is not a Hugging Face
    ``tokenizers`` JSON, are a :class:`TokenizerError` naming the path.
    """
    from tokenizers import Tokenizer


    hint = "pass the tokenizer.json saved by `tokenizer.save(...)` / `AutoTokenizer.save_pretrained(...)`"
    if not isinstance(path, str) or not path:
        raise TokenizerError(f"tokenizer path must be a non-empty string (got {path!r})")
    text = storage.read_user_text(
        path, storage_options, error=TokenizerError, noun="tokenizer", named_by="config field 'tokenizer'",
        directory_hint="point 'tokenizer' at the tokenizer.json file inside it",
    )
    try:
        return Tokenizer.from_str(text)
    except Exception as exc:  # tokenizers raises a plain Exception on bad JSON
        raise TokenizerError(f"{path} is not a Hugging Face tokenizers file ({exc}); {hint}") from exc


def tokenizer_fingerprint(tokenizer) -> str:
    """SHA-256 of the library's canonical serialisation (formatting of the file is ignored)."""
    return hashlib.sha256(tokenizer.to_str().encode("utf-8")).hexdigest()


def resolve_special_token(tokenizer, name: Optional[str], candidates: tuple[str, ...], option: str) -> int:
    """Id of the named special token, or of the first known candidate present."""
    if name is not None:
        token_id = tokenizer.token_to_id(name)
        if token_id is None:
            raise TokenizerError(f"{option}={name!r} is not in the tokenizer's vocabulary")
        return token_id
    for candidate in candidates:
        token_id = tokenizer.token_to_id(candidate)
        if token_id is not None:
            return token_id
    raise TokenizerError(
        f"the tokenizer has none of the usual tokens for {option} ({', '.join(candidates)}); "
        f"set {option} in the loader config to the token's text."
    )


@dataclass(frozen=True)
class TokenizerInfo:
    """What the manifest records about an offline tokenizer."""

    fingerprint: str
    vocab_size: int

    def to_dict(self) -> dict:
        return {"fingerprint": self.fingerprint, "vocab_size": self.vocab_size}


def describe(tokenizer) -> TokenizerInfo:
    return TokenizerInfo(fingerprint=tokenizer_fingerprint(tokenizer), vocab_size=tokenizer.get_vocab_size())
