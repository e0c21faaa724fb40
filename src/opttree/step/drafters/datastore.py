"""A retrieval datastore built once from files (REST-style; docs/METHODS.md, "Draft sources").

`build_datastore(files, tokenizer, out)` tokenizes text files (documents joined by the EOS token)
and writes, to a folder: `tokens.npy` (int32), for each n-gram length n an index of every position's
n-gram as one exact int64 key (n tokens of `bits` bits each, so no hash collisions) sorted with the
positions after it (`keys-{n}.npy`, `starts-{n}.npy`), and `datastore.json` (tokenizer, vocabulary,
sizes). `Datastore.matches(suffix)` finds the longest suffix (up to `max_n` tokens) of the committed
text that occurs in the store by binary search, and returns where its latest occurrences continue;
`DatastoreSource` (`--drafter ...+datastore --datastore DIR`) turns them into a trie like `lookup`.
Memory: 4 bytes per token plus 16 per token and n-gram length (about 52 bytes per token at n <= 3).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np

FORMAT_VERSION = 1
MAX_NGRAM = 4


def key_bits(vocab: int) -> int:
    return max(int(vocab - 1).bit_length(), 1)


def ngram_keys(tokens: np.ndarray, n: int, bits: int) -> np.ndarray:
    """(T,) int -> (T - n + 1,) int64: the n-gram starting at each position as one exact key."""
    keys = np.zeros(len(tokens) - n + 1, dtype=np.int64)
    for j in range(n):
        keys = (keys << bits) | tokens[j : len(tokens) - n + 1 + j].astype(np.int64)
    return keys


def build_datastore(files: list[str | Path], tokenizer, out: str | Path, progress: bool = True) -> dict:
    """Tokenize `files` with `tokenizer` and write the datastore folder `out`. Returns its description."""
    from tqdm import tqdm

    out = Path(out)
    vocab = len(tokenizer)
    separator = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    pieces = []
    for path in tqdm(files, desc="tokenizing", unit="file", disable=not progress):
        text = Path(path).read_text(encoding="utf-8", errors="replace")
        pieces += [tokenizer(text, add_special_tokens=False, verbose=False).input_ids, [separator]]
    tokens = np.array([t for piece in pieces for t in piece], dtype=np.int32)
    if tokens.size < 2:
        raise ValueError(f"no text to index in {[str(f) for f in files]}")
    bits = key_bits(vocab)
    max_n = min(MAX_NGRAM, 63 // bits)
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "tokens.npy", tokens)
    for n in range(1, max_n + 1):
        keys = ngram_keys(tokens, n, bits)
        order = np.argsort(keys, kind="stable")  # equal keys stay in text order: the latest come last
        np.save(out / f"keys-{n}.npy", keys[order])
        np.save(out / f"starts-{n}.npy", (order + n).astype(np.int64))  # where each occurrence continues
    meta = {"version": FORMAT_VERSION, "tokenizer": getattr(tokenizer, "name_or_path", None), "vocab": vocab,
            "bits": bits, "max_n": max_n, "tokens": int(tokens.size), "files": [str(f) for f in files]}
    (out / "datastore.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


class Datastore:
    def __init__(self, folder: str | Path):
        folder = Path(folder)
        meta_path = folder / "datastore.json"
        if not meta_path.exists():
            raise ValueError(f"--datastore {folder}: not a datastore (no datastore.json); build one with "
                             "`opttree datastore build FILES --out DIR`")
        self.meta = json.loads(meta_path.read_text())
        if self.meta.get("version") != FORMAT_VERSION:
            raise ValueError(f"datastore {folder} has format {self.meta.get('version')}, this opttree reads "
                             f"{FORMAT_VERSION}: build it again")
        self.tokens = np.load(folder / "tokens.npy", mmap_mode="r")
        self.bits, self.max_n = self.meta["bits"], self.meta["max_n"]
        self.keys = {n: np.load(folder / f"keys-{n}.npy", mmap_mode="r") for n in range(1, self.max_n + 1)}
        self.starts = {n: np.load(folder / f"starts-{n}.npy", mmap_mode="r") for n in range(1, self.max_n + 1)}

    def check_vocab(self, vocab: int) -> None:
        if self.meta["vocab"] > vocab:
            raise ValueError(f"the datastore was built with a tokenizer of {self.meta['vocab']} tokens; the target "
                             f"has {vocab}: build it with the target's tokenizer")

    def matches(self, suffix: list[int], limit: int) -> tuple[int, list[int]]:
        """(n, starts): the longest suffix of n tokens found in the store, and where its latest `limit`
        occurrences continue. (0, []) when even the last token is absent."""
        for n in range(min(self.max_n, len(suffix)), 0, -1):
            key = int(ngram_keys(np.array(suffix[-n:], dtype=np.int64), n, self.bits)[0])
            lo, hi = np.searchsorted(self.keys[n], key, "left"), np.searchsorted(self.keys[n], key, "right")
            starts = [int(s) for s in self.starts[n][max(lo, hi - limit) : hi] if s < len(self.tokens)]
            if starts:
                return n, starts
        return 0, []

    def continuation(self, start: int, length: int) -> list[int]:
        return [int(t) for t in self.tokens[start : start + length]]


def open_datastore(path: str | Path) -> Datastore:
    """The datastore at `path`, opened once per process (its arrays are memory-mapped)."""
    return _open(str(Path(path).resolve()))


@lru_cache(maxsize=8)
def _open(path: str) -> Datastore:
    return Datastore(path)
