"""The tokenizer of a corpus: loaded without remote code, its EOS token (the document separator), and an identity
that keys the token cache."""
from __future__ import annotations

import json
import os

from ulysses_train.data.sources import DataError, content_hash
from ulysses_train.user_input import missing_local_path, one_line, partial_local_path_note


def load_tokenizer(tokenizer, option: str = "tokenizer"):
    """A tokenizer object as given, or ``AutoTokenizer.from_pretrained`` of a name or path (never running a
    repository's custom code). ``option``: the setting named in errors (``data.tokenizer``, ``--tokenizer``)."""
    if not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    from transformers import AutoTokenizer

    name = os.fspath(tokenizer)
    problem = missing_local_path(name)
    if problem:
        raise DataError(f"{option}={name!r}: {problem}. Fix: point it to a folder with the tokenizer files "
                        f"(usually the model's folder) or a hub name such as Qwen/Qwen3-8B.")
    path = os.path.expanduser(name)
    if os.path.isfile(path):
        raise DataError(f"{option}={name!r} is a file; give the folder that holds tokenizer.json / "
                        f"tokenizer_config.json (usually the model's folder).")
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError, TypeError) as exc:
        text = one_line(exc)
        if os.path.isdir(path):
            reason = ("it asks for custom tokenizer code, which is never run (trust_remote_code stays off)"
                      if "trust_remote_code" in text else f"the folder holds no usable tokenizer ({text})")
        else:
            reason = text + "." + partial_local_path_note(name)
        raise DataError(f"cannot load {option}={name!r}: {reason}. Fix: point it to the model's own tokenizer "
                        f"(a folder with tokenizer.json, or a hub name).") from None


def check_vocabulary_fits(tokens: int, embeddings, option: str) -> None:
    """Refuse a tokenizer with more tokens than the model has embedding rows, before the model is built: its ids
    past the last row index outside the embeddings (an IndexError at step 1 on every rank with chat data, silence
    with text that happens to avoid them). The rule is to refuse, not to pad the embeddings: a resize adds rows the
    release never trained, which is the user's decision to make and to save."""
    if embeddings is not None and tokens > embeddings:
        raise DataError(f"{option} has {tokens:,} tokens but the model's embeddings have {embeddings:,} rows "
                        f"(vocab_size): token ids {embeddings:,} and up have no embedding. Fix: use the model's own "
                        f"tokenizer, or a model whose vocab_size is at least {tokens:,} (resize_token_embeddings, "
                        f"then save it).")


def eos_token_id(tokenizer) -> int:
    eos_id = getattr(tokenizer, "eos_token_id", None)
    if eos_id is None:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise DataError(
            f"tokenizer {name!r} has no EOS token; packing puts EOS after every document so the "
            f"model sees where one ends. Fix: use the model's own tokenizer, or set "
            f"tokenizer.eos_token to a token of its vocabulary."
        )
    return int(eos_id)


def tokenizer_identity(tokenizer) -> dict:
    """Name plus a hash of the full tokenizer definition (vocab, merges, normalizer, ...).

    ``truncation`` and ``padding`` are left out: they are call-time state that changes when the
    tokenizer is used elsewhere, and they do not change the ids produced here.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        definition = json.loads(backend.to_str())
        definition.pop("truncation", None)
        definition.pop("padding", None)
    else:
        definition = sorted(tokenizer.get_vocab().items())
    return {
        "name_or_path": getattr(tokenizer, "name_or_path", ""),
        "class": type(tokenizer).__name__,
        "definition_sha256": content_hash(definition),
        "eos_token_id": getattr(tokenizer, "eos_token_id", None),
    }
