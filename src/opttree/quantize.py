"""Weight quantization with torchao, as people run models locally on a CPU: `--quantize int8` and the like.

A quantized model is a model of its own: opttree's output is identical to *that* model's
`generate(do_sample=False)`, not to the unquantized model's. The schemes here quantize weights only,
ahead of time: activations stay in the model's dtype, so a tree forward computes what a one-token decode
does up to float rounding, as for any model (the tests check it against `generate`). Schemes that
quantize activations at run time (torchao's int8 dynamic activation) turn a float rounding difference
between two forwards into a whole quantization step (logits 1e-2 apart on a tiny model): opttree's
exactness probe (`opttree.certify`) refuses them, so they are not offered. A model saved quantized
(`quantization_config` in its config.json) loads quantized with `from_pretrained` and needs none of this.
"""

from __future__ import annotations

from typing import Callable

import torch

# scheme -> (what it is, a function building torchao's config)
SCHEMES: dict[str, tuple[str, Callable]] = {}


def _scheme(name: str, about: str):
    def register(build: Callable) -> Callable:
        SCHEMES[name] = (about, build)
        return build
    return register


@_scheme("int8", "int8 weights, per output channel; activations in the model's dtype")
def _int8(ao, model):
    return ao.Int8WeightOnlyConfig()


@_scheme("int4", "int4 weights in groups of 32 inputs (16 or 8 where a layer's input size needs it), stored "
                 "unpacked in int8; activations in the model's dtype")
def _int4(ao, model):
    from torchao.quantization.granularity import PerGroup

    return ao.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(_group_size(model)))


def _group_size(model: torch.nn.Module) -> int:
    """The largest of 32, 16, 8 that divides every linear layer's input size."""
    sizes = {m.in_features for m in model.modules() if isinstance(m, torch.nn.Linear)}
    group = next((g for g in (32, 16, 8) if all(size % g == 0 for size in sizes)), None)
    if group is None:
        raise ValueError(f"int4 quantization groups inputs by 8 at least; this model has linear layers of input sizes "
                         f"{sorted(sizes)}: use --quantize int8")
    return group


def quantize(model: torch.nn.Module, scheme: str) -> torch.nn.Module:
    """Quantize `model`'s linear layers in place with torchao's `scheme` (SCHEMES); returns the model."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization {scheme!r}; choose one of {', '.join(SCHEMES)}")
    try:
        import torchao.quantization as ao
    except ImportError:
        raise ValueError(f"quantization {scheme!r} needs torchao: pip install torchao") from None
    config = SCHEMES[scheme][1](ao, model)
    try:
        ao.quantize_(model, config)
    except (AssertionError, RuntimeError, NotImplementedError) as error:  # torchao's own checks, named
        raise ValueError(f"torchao could not quantize {type(model).__name__} with {scheme!r}: {error}") from None
    return model


def weight_kinds(model: torch.nn.Module) -> list[str] | None:
    """The tensor classes of a model quantized in memory (torchao's tensor subclasses: ['Int8Tensor']), so
    that a calibration profile tells it from the unquantized model; None for plain weights."""
    kinds = sorted({type(p).__name__ for p in model.parameters()} - {"Parameter"})
    return kinds or None
