"""The training corpus: Python standard-library source, with a fixed held-out split.

Files are ordered by relative path (sorted), so the corpus and the split are the same on every
machine with the same Python version. A file is held out when its top-level module or package name
(``email/mime/text.py`` -> ``email``, ``json.py`` would be ``json``) is in ``HELDOUT_MODULES``.
Tests under ``test/`` belong to the top-level name ``test`` and therefore train.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import numpy as np

# ~4.5 % of the stdlib bytes on CPython 3.11.
HELDOUT_MODULES: tuple[str, ...] = ("email", "html", "http", "json", "logging", "urllib", "wsgiref", "xml")
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def top_level_name(rel_path: str) -> str:
    """``email/mime/text.py`` -> ``email``; ``json.py`` -> ``json``."""
    first = Path(rel_path).parts[0]
    return first[:-3] if first.endswith(".py") else first


def list_files(root: Path) -> list[str]:
    """All ``*.py`` files under root (relative posix paths, sorted), skipping site-packages."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                found.append(Path(dirpath, name).relative_to(root).as_posix())
    return sorted(found)


def split_files(root: Path, heldout: tuple[str, ...] = HELDOUT_MODULES) -> dict[str, list[str]]:
    """{"train": [...], "heldout": [...]} relative paths, each sorted."""
    files = list_files(root)
    held = set(heldout)
    return {
        "train": [f for f in files if top_level_name(f) not in held],
        "heldout": [f for f in files if top_level_name(f) in held],
    }


def read_text(path: Path) -> str:
    return Path(path).read_bytes().decode("utf-8", errors="ignore")


def load_texts(root: Path | None = None, split: str = "train",
               heldout: tuple[str, ...] = HELDOUT_MODULES) -> list[str]:
    """The documents of one split, in sorted path order."""
    root = Path(root) if root is not None else stdlib_root()
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    return [read_text(root / f) for f in split_files(root, heldout)[split]]


def encode_documents(tokenizer, texts: list[str]) -> np.ndarray:
    """Token ids of all documents, each followed by eos, as one flat uint16/int32 array."""
    eos = tokenizer.eos_token_id
    assert eos is not None, "tokenizer needs an eos token"
    parts = []
    batch = 256
    for i in range(0, len(texts), batch):
        for ids in tokenizer(texts[i:i + batch], add_special_tokens=False)["input_ids"]:
            parts.append(np.asarray(ids + [eos], dtype=np.int64))
    flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    dtype = np.uint16 if len(tokenizer) <= 65536 else np.int32
    return flat.astype(dtype)


def load_or_encode(tokenizer, root: Path | None, split: str, cache_dir: Path,
                   heldout: tuple[str, ...] = HELDOUT_MODULES) -> np.ndarray:
    """Encoded split, cached as ``cache_dir/tokens_{split}.npy`` (delete it to re-encode)."""
    cache = Path(cache_dir) / f"tokens_{split}.npy"
    if cache.exists():
        return np.load(cache)
    tokens = encode_documents(tokenizer, load_texts(root, split, heldout))
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".tmp.npy")
    np.save(tmp, tokens)
    os.replace(tmp, cache)
    return tokens
