"""Settings that follow the hardware: the hardware key, the dtype choice, profiles from elsewhere."""

import json
import os
import subprocess
import sys

import torch

import opttree
from opttree import hardware
from opttree import profiles


def test_a_curve_where_bf16_loses_chooses_fp32():
    assert hardware.choose_dtype({"bfloat16": 43.4, "float32": 22.5}) == "float32"  # AVX2-like
    assert hardware.choose_dtype({"bfloat16": 17.7, "float32": 19.4}) == "bfloat16"  # bf16 hardware
    assert hardware.choose_dtype({"bfloat16": 20.0, "float32": 19.5}) == "bfloat16"  # a tie: half the memory
    # without bf16 hardware a tie goes to float32 (bf16's cost grows faster with the tree there)
    assert hardware.choose_dtype({"bfloat16": 99.9, "float32": 98.8}, bf16_hardware=False) == "float32"
    assert hardware.choose_dtype({"bfloat16": 95.0, "float32": 98.8}, bf16_hardware=False) == "float32"
    assert hardware.choose_dtype({"bfloat16": 80.0, "float32": 98.8}, bf16_hardware=False) == "bfloat16"


def test_the_key_follows_restricted_kernels():
    """ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA reproduce an AVX2 CPU, and the key says so."""
    code = "import json; from opttree.hardware import hardware_key; print(json.dumps(hardware_key()))"
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2")
    key = json.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                    check=True).stdout)
    assert key == {"device": "cpu", "cpu_capability": "AVX2", "bf16_hardware": False}
    assert key != hardware.hardware_key() or torch.backends.cpu.get_cpu_capability() == "AVX2"


def test_a_profile_from_other_hardware_is_not_applied(monkeypatch, capsys):
    target, draft, _ = opttree.demo_models(torch.bfloat16)
    profiles._note_once.cache_clear()  # the note prints once per process: an earlier test may have printed it
    here = hardware.hardware_key()
    shipped = json.loads((profiles.SHIPPED_PROFILES / "bfloat16.json").read_text())["hardware"]
    monkeypatch.setattr(profiles, "hardware_key", lambda device="cpu": shipped)
    assert opttree.profile_options(target, draft)["budget"] == 8  # the reference machine's kind: applied
    other = {"device": "cpu", "cpu_capability": "AVX2", "bf16_hardware": False}
    monkeypatch.setattr(profiles, "hardware_key", lambda device="cpu": other)
    assert opttree.profile_options(target, draft) == {}
    assert "not applied" in capsys.readouterr().err
    assert here  # the real key is computed without error here


def test_cached_profiles_are_keyed_by_hardware(monkeypatch):
    target, draft, _ = opttree.demo_models(torch.bfloat16)
    keys = set()
    for key in ({"device": "cpu", "cpu_capability": "AVX2", "bf16_hardware": False},
                {"device": "cpu", "cpu_capability": "AVX512", "bf16_hardware": True}):
        monkeypatch.setattr(profiles, "hardware_key", lambda device="cpu", key=key: key)
        keys.add(profiles.profile_key(target, draft))
    keys.add(profiles.profile_key(target.float(), draft.float()))
    assert len(keys) == 3
