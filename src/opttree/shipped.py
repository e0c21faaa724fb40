"""The models shipped inside the package (the target, the draft and the target's EAGLE-3 head), stored
packed and unpacked once into the user cache.

A shipped folder `models/<name>/` holds its small files as they are and every large file packed: the
file's bytes after its header are split into byte planes (byte 0 of every element, then byte 1, ...:
the sign-and-exponent bytes of bf16 weights are nearly constant, the mantissa bytes are not) and the
whole is compressed with the standard library's `lzma`. `packed.json` lists each packed file with the
sha256 and size of its unpacked form. `shipped_path(name)` unpacks the folder on first use into
`<cache>/models/<name>-<digest>/` (one atomic rename, so concurrent first uses are safe), checks every
file against its sha256, and returns it: an ordinary folder for `from_pretrained(path)`.

The cache is `$OPTTREE_CACHE_DIR`, else `$XDG_CACHE_HOME/opttree`, else `~/.cache/opttree`.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np

MODELS_DIR = Path(__file__).parent / "models"
MANIFEST = "packed.json"
PACKED_SUFFIX = ".xz"
PACK_MIN_BYTES = 64 * 1024  # smaller files are kept as they are
_SAFETENSORS_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                      "BOOL": 1}


def cache_root() -> Path:
    """$OPTTREE_CACHE_DIR, else $XDG_CACHE_HOME/opttree, else ~/.cache/opttree."""
    root = os.environ.get("OPTTREE_CACHE_DIR")
    if root is None:
        root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "opttree"
    return Path(root)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _layout(data: bytes, name: str) -> tuple[int, int]:
    """(offset, stride): the bytes before `offset` are kept in order; after it, elements of `stride`
    bytes are split into planes. A safetensors file whose tensors share one element size gets that
    size after its header; anything else is one plane."""
    if name.endswith(".safetensors") and len(data) >= 8:
        header_len = struct.unpack("<Q", data[:8])[0]
        header = json.loads(data[8:8 + header_len])
        sizes = {_SAFETENSORS_BYTES.get(v["dtype"], 1) for k, v in header.items() if k != "__metadata__"}
        if len(sizes) == 1:
            return 8 + header_len, sizes.pop()
    return 0, 1


def _planes(body: bytes, stride: int) -> bytes:
    usable = len(body) - len(body) % stride
    split = np.frombuffer(body, np.uint8, usable).reshape(-1, stride).T  # (stride, elements)
    return split.tobytes() + body[usable:]


def _unplanes(body: bytes, stride: int) -> bytes:
    usable = len(body) - len(body) % stride
    joined = np.frombuffer(body, np.uint8, usable).reshape(stride, -1).T  # (elements, stride)
    return joined.tobytes() + body[usable:]


def pack_file(src: Path, dest_dir: Path) -> dict:
    """Write `src` packed as dest_dir/<name>.xz; returns its manifest entry."""
    data = src.read_bytes()
    offset, stride = _layout(data, src.name)
    payload = data[:offset] + _planes(data[offset:], stride)
    (dest_dir / (src.name + PACKED_SUFFIX)).write_bytes(lzma.compress(payload, preset=9 | lzma.PRESET_EXTREME))
    return {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "offset": offset, "stride": stride}


def unpack_file(packed: Path, entry: dict, dest: Path) -> None:
    """Write the unpacked form of `packed` to `dest` and check it against the manifest entry."""
    payload = lzma.decompress(packed.read_bytes())
    offset = entry["offset"]
    data = payload[:offset] + _unplanes(payload[offset:], entry["stride"])
    if len(data) != entry["size"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise RuntimeError(f"the shipped file {packed} does not unpack to the file it was made from (sha256 "
                           "mismatch): the installation is damaged; reinstall opttree")
    dest.write_bytes(data)


def pack_folder(src: str | Path, dest: str | Path, min_bytes: int = PACK_MIN_BYTES) -> Path:
    """Copy a model folder into `dest` as a shipped folder: files of `min_bytes` or more packed, the
    rest as they are, and `packed.json`. `dest` is replaced."""
    src, dest = Path(src), Path(dest)
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    manifest = {}
    for path in sorted(p for p in src.iterdir() if p.is_file()):
        if path.stat().st_size >= min_bytes:
            manifest[path.name] = pack_file(path, dest)
        else:
            shutil.copy2(path, dest / path.name)
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return dest


def shipped_names() -> list[str]:
    """The shipped folders: 'draft', 'head', 'target'."""
    return sorted(p.parent.name for p in MODELS_DIR.glob(f"*/{MANIFEST}"))


def _manifest(name: str) -> dict:
    path = MODELS_DIR / name / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"no shipped model {name!r} (shipped: {', '.join(shipped_names()) or 'none'}); "
                                "reinstall opttree or rebuild the pair with `opttree train pair` (docs/TRAINING.md)")
    return json.loads(path.read_text())


def shipped_location(name: str) -> Path:
    """Where shipped model `name` is (or will be) unpacked: a folder named by the digest of its manifest and of the
    files stored as they are (config.json, ...), so that a changed file unpacks anew."""
    source = MODELS_DIR / name
    digest = hashlib.sha256((source / MANIFEST).read_bytes())
    for path in sorted(source.iterdir()):
        if path.is_file() and path.name != MANIFEST and not path.name.endswith(PACKED_SUFFIX):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return cache_root() / "models" / f"{name}-{digest.hexdigest()[:12]}"


def _complete(folder: Path, source: Path, manifest: dict) -> bool:
    names = [p.name for p in source.iterdir() if p.is_file() and p.name != MANIFEST and p.name.removesuffix(
        PACKED_SUFFIX) not in manifest] + list(manifest)
    return folder.is_dir() and all((folder / n).is_file() for n in names) and all(
        (folder / n).stat().st_size == entry["size"] for n, entry in manifest.items())


def shipped_path(name: str) -> Path:
    """The folder of shipped model `name` ('target', 'draft', 'head'), unpacked into the user cache on
    first use (a few seconds) and checked by sha256; later calls only check that it is complete."""
    manifest, source = _manifest(name), MODELS_DIR / name
    folder = shipped_location(name)
    if _complete(folder, source, manifest):
        return folder
    if folder.exists():  # a damaged or partial copy (files deleted by hand): unpack it again
        shutil.rmtree(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=folder.parent))
    try:
        for path in source.iterdir():
            if not path.is_file() or path.name == MANIFEST:
                continue
            stem = path.name.removesuffix(PACKED_SUFFIX)
            if stem in manifest:
                unpack_file(path, manifest[stem], work / stem)
            else:
                shutil.copy2(path, work / path.name)
        os.replace(work, folder)  # atomic; fails if another process finished first
    except OSError:
        if not _complete(folder, source, manifest):
            raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return folder
