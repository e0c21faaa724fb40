"""The shipped models are stored packed (byte planes + lzma) and unpacked once into the user cache:
the unpacked files are byte for byte the ones packed, damage is refused, and the repository stays
light enough to travel to a GPU host."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from opttree import shipped

ROOT = Path(__file__).resolve().parents[1]


def _model_folder(folder: Path, dtype: torch.dtype, mixed: bool = False) -> Path:
    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    tensors = {"w": (torch.randn(300, 257, generator=g) * 0.02).to(dtype), "b": torch.randn(7, generator=g).to(dtype)}
    if mixed:
        tensors["step"] = torch.arange(5, dtype=torch.int64)
    save_file(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"hidden_size": 257}))
    (folder / "tokenizer.json").write_text(json.dumps({"vocab": {f"t{i}": i for i in range(4000)}}))
    return folder


@pytest.mark.parametrize("dtype,mixed", [(torch.bfloat16, False), (torch.float32, False), (torch.bfloat16, True)])
def test_pack_unpack_gives_back_the_same_bytes(tmp_path, monkeypatch, dtype, mixed):
    src = _model_folder(tmp_path / "src", dtype, mixed)
    models = tmp_path / "models"
    shipped.pack_folder(src, models / "m", min_bytes=1024)
    manifest = json.loads((models / "m" / shipped.MANIFEST).read_text())
    assert set(manifest) == {"model.safetensors", "tokenizer.json"}  # config.json is small: kept as it is
    assert manifest["model.safetensors"]["stride"] == (1 if mixed else torch.finfo(dtype).bits // 8)
    assert (models / "m" / "config.json").is_file() and not (models / "m" / "model.safetensors").exists()
    packed = (models / "m" / "model.safetensors.xz").stat().st_size
    assert packed < 0.85 * (src / "model.safetensors").stat().st_size  # exponent bytes compress

    monkeypatch.setattr(shipped, "MODELS_DIR", models)
    monkeypatch.setenv("OPTTREE_CACHE_DIR", str(tmp_path / "cache"))
    assert shipped.shipped_names() == ["m"]
    out = shipped.shipped_path("m")
    assert out.parent == tmp_path / "cache" / "models"
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    assert shipped.shipped_path("m") == out  # second use: no new folder
    assert [p.name for p in out.parent.iterdir()] == [out.name]


def test_a_damaged_copy_is_unpacked_again_and_a_damaged_package_refused(tmp_path, monkeypatch):
    src = _model_folder(tmp_path / "src", torch.bfloat16)
    models = tmp_path / "models"
    shipped.pack_folder(src, models / "m", min_bytes=1024)
    monkeypatch.setattr(shipped, "MODELS_DIR", models)
    monkeypatch.setenv("OPTTREE_CACHE_DIR", str(tmp_path / "cache"))
    out = shipped.shipped_path("m")
    (out / "model.safetensors").write_bytes(b"truncated")
    assert shipped.shipped_path("m") == out
    assert (out / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()

    shutil.rmtree(out)
    manifest_path = models / "m" / shipped.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    manifest["model.safetensors"]["sha256"] = "0" * 64
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(RuntimeError, match="sha256 mismatch"):
        shipped.shipped_path("m")
    assert not any((tmp_path / "cache" / "models").iterdir())  # nothing half-written left behind
    with pytest.raises(FileNotFoundError, match="no shipped model 'nope'"):
        shipped.shipped_path("nope")


def test_the_shipped_models_unpack_into_loadable_folders():
    from transformers import AutoConfig

    assert shipped.shipped_names() == ["draft", "head", "target"]
    for name in ("target", "draft"):
        folder = shipped.shipped_path(name)
        assert folder.parent == shipped.cache_root() / "models"
        assert AutoConfig.from_pretrained(folder).model_type
        assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    assert (shipped.shipped_path("head") / "head.safetensors").is_file()


def test_the_cli_prints_the_shipped_folders(capsys):
    from opttree.cli import main

    assert main(["models", "--path", "target"]) == 0
    assert capsys.readouterr().out.strip() == str(shipped.shipped_path("target"))
    assert main(["models", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == ["draft", "head", "target"]


def test_the_tracked_tree_fits_a_gpu_host():
    """A copy of the repository plus a wheel or two must fit the 64 MiB a GPU host accepts."""
    try:
        listing = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = [ROOT / name for name in listing.decode().split("\0") if name]
    total = sum(f.stat().st_size for f in files if f.is_file())
    assert total <= 56 * 2**20, f"tracked files are {total / 2**20:.1f} MiB (limit 56 MiB)"
