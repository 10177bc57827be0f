"""Content fingerprints: what keys the token cache and what a run records of its data, so neither trusts a
file's size and modification time to change when its content does.

They do not always: `cp -p`, `rsync -t`, `touch -d` or a tool that restores timestamps rewrite a file with the
same size and mtime, and a cache keyed on them would hand back the old tokens. So every corpus file's bytes
are hashed (xxh3-128, the hash `datasets` itself depends on: several GB/s, far below a tokenizer's cost). To
spare a large corpus that read at every start, a file's digest is remembered in the cache folder
(`file-digests/`) under its (device, inode, size, mtime, ctime): the kernel sets ctime on every write and no
user call can set it back (`os.utime` cannot), so a rewritten file always misses the memo and is hashed again.
What is trusted, then, is ctime (only a system clock set back could fake it) and the memo files themselves.

`data_identity` is a run's data in a few comparable values (form, tokenizer, chat template, corpus content),
recorded in run_config.json so that `--resume` can name what changed (training/run_identity.py).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import xxhash

from ulysses_train.data.form import DataForm
from ulysses_train.data.sources import content_hash, corpus_identity
from ulysses_train.data.tokenizer import load_tokenizer, tokenizer_identity

MEMO_FOLDER = "file-digests"
_BLOCK = 1 << 24


def file_digest(path: str | os.PathLike, memo_dir: str | os.PathLike | None = None) -> str:
    """xxh3-128 of the file's bytes; remembered under `memo_dir` keyed by the file's stat (see the module
    docstring), so an unchanged file is hashed once."""
    path = Path(path)
    stat = path.stat()
    key = [stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]
    memo = None
    if memo_dir is not None:
        name = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:24]
        memo = Path(memo_dir).expanduser() / MEMO_FOLDER / f"{name}.json"
        try:
            saved = json.loads(memo.read_text())
            if saved.get("stat") == key:
                return saved["xxh3_128"]
        except (OSError, ValueError, AttributeError, KeyError):
            pass
    digest = xxhash.xxh3_128()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(_BLOCK), b""):
            digest.update(block)
    value = digest.hexdigest()
    if memo is not None:
        _write_memo(memo, {"path": str(path.resolve()), "stat": key, "xxh3_128": value})
    return value


def _write_memo(memo: Path, value: dict) -> None:
    """Atomically (every rank of a run may write the same memo at once); a memo that cannot be written only
    costs a hash at the next start."""
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(value))
        os.replace(tmp, memo)
    except OSError:
        pass


def content_identity(corpus: dict, memo_dir: str | os.PathLike | None = None) -> dict:
    """`sources.corpus_identity` with each file's mtime replaced by its content digest: the key of the token
    cache. A hub dataset is left as it is (trusted under its name; `datasets` caches its download)."""
    if "files" not in corpus:
        return corpus
    root = Path(corpus["path"])
    files = []
    for name, size, _mtime in corpus["files"]:
        path = root if root.is_file() else root / name
        try:
            files.append([name, size, file_digest(path, memo_dir)])
        except OSError:
            files.append([name, None, None])  # unreadable; load_corpus reports it
    return {**corpus, "files": files}


def data_identity(data_cfg, model_name_or_path: str, memo_dir: str | os.PathLike | None = None) -> dict:
    """A run's data as comparable values: the form (how rows become sequences), a hash of the tokenizer's
    definition, of its chat template (chat data only: text data never renders it), and of the corpus's content
    (relative file names, sizes and digests, not its path: a corpus moved elsewhere is the same corpus)."""
    form = DataForm.from_config(data_cfg)
    tokenizer = load_tokenizer(data_cfg.tokenizer or model_name_or_path)
    definition = {k: v for k, v in tokenizer_identity(tokenizer).items() if k != "name_or_path"}
    corpus = content_identity(corpus_identity(data_cfg.source, "train"), memo_dir)
    corpus = {k: v for k, v in corpus.items() if k != "path"}
    shape = {"format": form.format, form.field_option.removeprefix("data."): form.field, "loss_on": form.learned,
             "packing": form.packing,
             **({"too_long": form.too_long} if form.packing == "documents" else {"drop_last": form.drop_last})}
    return {"form": shape,
            "tokenizer": content_hash(definition),
            "chat_template": content_hash(tokenizer.chat_template) if form.chat else None,
            "corpus": content_hash(corpus)}
