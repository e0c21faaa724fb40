"""Linear weights prepacked for the CPU's matrix kernels (bf16 and float32), during opttree's steps.

On a CPU with bf16 matrix instructions (AVX512-bf16, AMX), a bf16 `nn.Linear` runs oneDNN's brgemm
kernel, which first copies the weight into its blocked layout: every call, for every layer. A decoding
step multiplies a few rows by each weight, so that copy is most of the time: on a 2-core Xeon with AMX,
a 512 x 1376 layer takes 50 us plain and 22 us with the weight packed once (`scripts/packed_linears.py`;
docs/BENCHMARKS.md, "Packed bf16 weights and listed children").

`PackedLinears(model)` packs each bf16 linear weight of a CPU model once (`torch.ops.mkldnn`, the ops
inductor's frozen graphs call) and, while entered, runs those layers from the packed copy. Exactness is
checked, not assumed: for each weight shape, the packed kernel's output is compared bit for bit with the
plain one's at every row count up to MAX_ROWS (random inputs), and a layer runs packed only for row counts
up to the largest where every smaller one matched (once per machine, kernel library and shape: kept in the
user cache); other calls (a long prefill, grad mode, another dtype) run the plain layer. So a generation's
tokens are those of the plain layers, and only the time changes. `OPTTREE_PACKED=0` turns it off (to
measure what it gains).

Layers that take one input (each decoder layer's q, k, v, and its MLP's gate, up, where the lean forward of
`opttree.step.lean` drives the model; it declares them: `register_shared_inputs`) are also packed together,
their weights stacked: the lean forward runs each group as one product (`PackedLinears.products`), checked bit
for bit against the plain layers side by side as single layers are. One product of three costs about what
one of them costs alone: 4 products a decoder layer instead of 7, 7 % of a greedy step of the shipped target
on a 2-core AMD EPYC with avx512_bf16.
float32 linear weights are packed too (from FLOAT32_MIN_ELEMENTS), on any CPU oneDNN runs on (AVX2 included), for
products of 2 rows or more:
transformers' float32 kernel (MKL's) is slow on a few rows (17 rows by the shipped target's 8192 x 512 head: 1.7 ms
against 0.3 packed, on a 2-core AMD EPYC; a tree step of 17 tokens 20.4 -> 13.9 ms restricted to AVX2). There the
packed kernel rounds differently from the plain one (its sums run in another order), so float32 is checked to agree
within float32 rounding (`_checked_rows`), not bit for bit; but the plain kernel itself rounds a row differently
with 1 row than with 4 or more (its one-row path), so a tree step's rows never were the one-row products of plain
decoding bit for bit. A product of 1 row (plain decoding) always runs the plain kernel: opttree's plain decoding
stays transformers' own, bit for bit, and greedy identity with `target.generate` is tested as before.
The packed copies cost memory (the size of the packed linear weights): a model is packed only while they
fit in a quarter of the memory available (`MEMORY_SHARE`), its groups only while their stacked copies fit
there too (every layer keeps its own copy: a forward the lean one does not drive runs them), and the copies
live as long as the model.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import threading
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F

from .device import is_compiled
from .shipped import cache_root

MAX_ROWS = 128  # rows of a call checked (and run) packed: a tree step's and a batch's, not a prefill's
FLOAT32_MIN_ROWS = 2  # a float32 product of fewer rows runs the plain kernel (plain decoding: transformers')
FLOAT32_AGREEMENT = 1e-4  # float32: packed and plain outputs differ by at most this share of the largest output
FLOAT32_CHECKED = (2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65, MAX_ROWS)  # row counts float32 is checked at
# a smaller float32 weight is not packed: oneDNN's call costs ~10 us more than MKL's, which a product by a small
# weight does not earn back (on a 2-core AMD EPYC, 9 rows: 64 x 64 3.6 us plain, 10.9 packed; 512 x 256 31 / 16)
FLOAT32_MIN_ELEMENTS = 1 << 17
MEMORY_SHARE = 0.25  # packed copies may take at most this share of the memory available

_LINEAR = torch.ops.mkldnn._linear_pointwise.default if hasattr(torch.ops.mkldnn, "_linear_pointwise") else None
_PACKED: "weakref.WeakKeyDictionary[torch.nn.Module, PackedLinears | None]" = weakref.WeakKeyDictionary()


def packed_linears(model: torch.nn.Module | None) -> "PackedLinears | None":
    """The model's packed linears (made on first use, kept with the model), or None where packing does
    not apply: not on a CPU with bf16 matrix kernels, no bf16 linear, a compiled model, not enough memory."""
    if model is None or os.environ.get("OPTTREE_PACKED", "1") == "0":
        return None
    packed = _PACKED.get(model)
    if packed is None or packed.stale():  # new, or its weights changed (trained, loaded, moved, converted)
        packed = _pack(model) if packing_applies(model) else None
        if packed is None:
            _PACKED.pop(model, None)
            return None
        _PACKED[model] = packed
    return packed if packed.layers else None


def active_pack(model: torch.nn.Module) -> "PackedLinears | None":
    """The model's packed linears while they run (entered), else None."""
    packed = _PACKED.get(model)
    return packed if packed is not None and packed._entered else None


def _pack(model: torch.nn.Module) -> "PackedLinears | None":
    try:
        return PackedLinears(model)
    except RuntimeError:  # oneDNN refuses where its bf16 kernels are not built for this CPU (or its ISA is capped)
        return None


def entered(packs: list["PackedLinears"]) -> contextlib.ExitStack:
    """A context in which every one of `packs` runs packed."""
    stack = contextlib.ExitStack()
    for pack in packs:
        stack.enter_context(pack)
    return stack


def packed_models(*models: torch.nn.Module | None) -> contextlib.ExitStack:
    """A context in which each model's linears run packed where packing applies (timings of what a
    generation runs: calibration, --dtype auto, batch sizing)."""
    return entered([pack for pack in map(packed_linears, models) if pack is not None])


def packing_applies(model: torch.nn.Module) -> bool:
    """A CPU model with linear layers that pack (`_packable_linears`: float32, or bf16 on a CPU with oneDNN's bf16
    kernels), not compiled, whose packed copies fit in MEMORY_SHARE of the free memory."""
    params = list(model.parameters())
    if not params or params[0].device.type != "cpu" or is_compiled(model):  # inductor makes its own kernels
        return False
    if _LINEAR is None or not torch.backends.mkldnn.is_available():
        return False
    size = sum(_bytes(m) for m in _packable_linears(model))
    return 0 < size <= MEMORY_SHARE * available_bytes()


class PackedLinears:
    """A model's bf16 and float32 linear layers with packed copies of their weights; `with` it, they run from them."""

    def __init__(self, model: torch.nn.Module):
        self.layers: list[tuple[torch.nn.Module, torch.Tensor, range]] = []  # (layer, packed weight, rows it runs)
        self.groups: dict[tuple[int, ...], _Group] = {}  # by the ids of its layers
        self._saved: list = []  # the layers' own instance forwards (None: the class's) while entered
        self._entered = 0
        self._lock = threading.Lock()
        path = _limits_path()
        try:
            limits = json.loads(path.read_text())
        except (OSError, ValueError):  # none yet (or unreadable): checked again
            limits = {}
        known = len(limits)
        packable = _packable_linears(model)
        groups = _groups(model, packable)
        room = MEMORY_SHARE * available_bytes() - sum(map(_bytes, packable))
        if sum(_bytes(m) for group in groups for m in group) > room:
            groups = []  # the layers' own packed copies first: they serve every forward, the groups only the lean one
        with torch.inference_mode():
            for group in groups:
                shape = "+".join(_shape(layer) for layer in group)
                packed = _Group(group)
                if shape not in limits:
                    limits[shape] = _checked_rows(group, packed.weight)
                if limits[shape]:
                    packed.rows = _rows_run(group[0].weight.dtype, limits[shape])
                    self.groups[tuple(map(id, group))] = packed
            for layer in packable:
                packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), 16)
                shape = _shape(layer)
                if shape not in limits:
                    limits[shape] = _checked_rows([layer], packed)
                if limits[shape]:
                    self.layers.append((layer, packed, _rows_run(layer.weight.dtype, limits[shape])))
        if len(limits) > known:  # written whole, then renamed: another process never reads half a file
            path.parent.mkdir(parents=True, exist_ok=True)
            written = path.with_suffix(f".{os.getpid()}.tmp")
            written.write_text(json.dumps(limits, indent=1, sort_keys=True) + "\n")
            os.replace(written, path)
        self._versions, self._declared = self._weights(), len(_SHARED_INPUTS)
        self._forwards = [functools.partial(_packed_forward, layer, packed, rows)
                          for layer, packed, rows in self.layers]
        self._ours = {id(layer): forward for (layer, _, _), forward in zip(self.layers, self._forwards)}

    def stale(self) -> bool:
        """Whether a weight changed since it was packed (in place: trained, loaded; or replaced: `.to()`), or a
        forward declared groups of layers since (`register_shared_inputs`)."""
        return self._weights() != self._versions or self._declared != len(_SHARED_INPUTS)

    def _weights(self) -> list[tuple[int, int]]:
        layers = {id(layer): layer for layer, _, _ in self.layers}  # each once (a grouped layer has its own copy too)
        layers.update((id(layer), layer) for group in self.groups.values() for layer in group.layers)
        return [(layer.weight.data_ptr(), layer.weight._version) for layer in layers.values()]

    def products(self, layers: tuple[torch.nn.Module, ...], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each of `layers` (linears that take the same input) applied to x: while entered, in one product
        through their stacked packed weight where they were packed together (`_groups`), nothing hooks them and
        the rows are within the checked limit (the results are views of that product's columns); else each
        layer called as usual."""
        group = self.groups.get(tuple(map(id, layers))) if self._entered else None
        if group is None or x.numel() // x.shape[-1] not in group.rows or x.dtype is not group.dtype \
                or torch.is_grad_enabled() or any(layer._forward_hooks or layer._forward_pre_hooks
                                                   for layer in layers) or self._replaced(layers):
            return tuple(layer(x) for layer in layers)  # each from its own packed copy where it has one
        return _run_packed(x, group.weight, group.bias).split(group.sizes, dim=-1)

    def __enter__(self) -> "PackedLinears":
        with self._lock:  # generations of one model may step in several threads: the first in installs
            self._entered += 1
            if self._entered == 1:
                self._saved = [layer.__dict__.get("forward") for layer, _, _ in self.layers]
                for (layer, _, _), forward in zip(self.layers, self._forwards):
                    layer.__dict__["forward"] = forward  # an instance attribute, past Module.__setattr__'s checks
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:  # ... and the last out restores the layers' own forwards
            self._entered -= 1
            if self._entered:
                return
            for (layer, _, _), forward in zip(self.layers, self._saved):
                if forward is None:
                    del layer.__dict__["forward"]
                else:
                    layer.__dict__["forward"] = forward
            self._saved = []

    def _replaced(self, layers: tuple[torch.nn.Module, ...]) -> bool:
        """Whether one of the layers runs a forward of its own (not this pack's, not its class's)."""
        return any(vars(layer).get("forward", self._ours.get(id(layer))) is not self._ours.get(id(layer))
                   for layer in layers)


def _packed_forward(layer: torch.nn.Module, packed: torch.Tensor, rows: range, x: torch.Tensor) -> torch.Tensor:
    if x.numel() // x.shape[-1] not in rows or x.dtype is not layer.weight.dtype or torch.is_grad_enabled():
        return F.linear(x, layer.weight, layer.bias)
    return _run_packed(x, packed, layer.bias)


def _rows_run(dtype: torch.dtype, checked: int) -> range:
    """The row counts a packed layer of `dtype` runs packed, its kernel checked up to `checked` rows."""
    return range(FLOAT32_MIN_ROWS if dtype == torch.float32 else 1, checked + 1)


def _run_packed(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """(..., in) bf16 or float32 -> (..., out) through oneDNN's kernel on a packed weight."""
    return _LINEAR(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "").view(*x.shape[:-1], -1)


class PackedMatmul:
    """x (..., in) -> x W^T + b (..., out), through a packed copy of W where `packed` (a bf16 or float32 CPU
    weight that packs: `packing_applies`), else `F.linear`. For a draft's own stacked weights
    (`opttree.step.draft_forward`): the packed kernel is not checked against the plain one here, as it is for
    `PackedLinears`, since a draft's roundings never reach the output; it runs at any row count."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, packed: bool):
        self.weight, self.bias = weight, bias  # (out, in), (out,)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 16) if packed and _packs(weight) else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or x.dtype is not self.weight.dtype or torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)
        return _run_packed(x, self.packed, self.bias)


class _Group:
    """Linear layers that take one input (q, k and v of an attention; gate and up of an MLP), their weights
    stacked and packed once: one product instead of several (on a 2-core AMD EPYC with avx512_bf16, 9 rows by
    three 512 x 512 weights: 30 us against 3 x 17)."""

    def __init__(self, layers: list[torch.nn.Module]):
        self.layers = tuple(layers)
        self.sizes = [layer.out_features for layer in layers]
        stacked = torch.cat([layer.weight.detach() for layer in layers])  # (sum of outs, in)
        self.weight = torch.ops.mkldnn._reorder_linear_weight(stacked, 16)
        self.bias = None if layers[0].bias is None else torch.cat([layer.bias.detach() for layer in layers])
        self.dtype = layers[0].weight.dtype
        self.rows = range(0)  # the row counts it runs packed


_SHARED_INPUTS: list = []  # functions: model -> groups of its linears that a forward applies to one input


def register_shared_inputs(find) -> None:
    """A forward that runs groups of linears that read one input through `PackedLinears.products` (the lean
    forward of `opttree.step.lean`) declares how to find them in a model: find(model) -> [(linear, ...), ...].
    A model packed before a declaration is packed again on its next use."""
    if find not in _SHARED_INPUTS:
        _SHARED_INPUTS.append(find)


def _groups(model: torch.nn.Module, packable: list[torch.nn.Module]) -> list[list[torch.nn.Module]]:
    """The model's declared groups (`register_shared_inputs`) whose layers all pack (bf16, all with a bias or
    none)."""
    ids = {id(layer) for layer in packable}
    return [list(group) for find in _SHARED_INPUTS for group in find(model)
            if all(id(layer) in ids for layer in group) and len({layer.bias is None for layer in group}) == 1]


def _shape(layer: torch.nn.Module) -> str:
    """A layer's key in the checked limits: its shape (and dtype, float32's own key)."""
    kind = "/float32" if layer.weight.dtype == torch.float32 else ""
    return f"{layer.in_features}x{layer.out_features}{'+bias' if layer.bias is not None else ''}{kind}"


def _checked_rows(layers: list[torch.nn.Module], packed: torch.Tensor) -> int:
    """The largest r <= MAX_ROWS such that the packed kernel's output (of the layers' stacked weights) agrees with
    the plain layers' outputs side by side up to r rows (random inputs): bf16 bit for bit at every row count from 1,
    float32 within FLOAT32_AGREEMENT of the largest output at FLOAT32_CHECKED's row counts (agreement within rounding
    does not hinge on one row count, as bit equality may; module docstring)."""
    generator = torch.Generator().manual_seed(0)
    biases = [layer.bias for layer in layers]
    bias = None if biases[0] is None else torch.cat(biases)
    dtype = layers[0].weight.dtype
    passed = 0
    for rows in FLOAT32_CHECKED if dtype == torch.float32 else range(1, MAX_ROWS + 1):
        x = torch.randn(rows, layers[0].in_features, generator=generator).to(dtype)
        plain = torch.cat([F.linear(x, layer.weight, layer.bias) for layer in layers], dim=-1)
        out = _LINEAR(x, packed, bias, "none", [], "")
        agree = torch.equal(plain, out) if dtype != torch.float32 else \
            bool((out - plain).abs().max() <= FLOAT32_AGREEMENT * plain.abs().max())
        if not agree:
            return passed
        passed = rows
    return passed


def _limits_path() -> Path:
    """Where the checked row limits live: they depend on the kernels (torch and oneDNN, the CPU, the threads),
    not on the weights, so they are kept per machine and library in the user cache (`profiles/`)."""
    cpu = next((line.split(":", 1)[1].strip() for line in _lines("/proc/cpuinfo") if line.startswith("model name")), "")
    key = json.dumps([torch.__version__, torch.backends.cpu.get_cpu_capability(), cpu, torch.get_num_threads(),
                      MAX_ROWS])
    return cache_root() / "profiles" / f"packed-{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"


def _lines(path: str) -> list[str]:
    try:
        with open(path) as text:
            return text.readlines()
    except OSError:
        return []


def _packable_linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's plain linear layers on the CPU (not a subclass, not a quantized or sharded weight) whose
    weights pack (`_packs`)."""
    return [m for m in model.modules() if type(m) is torch.nn.Linear and type(m.weight) is torch.nn.Parameter
            and m.weight.device.type == "cpu" and _packs(m.weight)]


def _packs(weight: torch.Tensor) -> bool:
    """float32 of at least FLOAT32_MIN_ELEMENTS on any CPU oneDNN runs on; bf16 where it has the bf16 matrix
    kernels."""
    if weight.dtype == torch.float32:
        return weight.numel() >= FLOAT32_MIN_ELEMENTS
    return weight.dtype == torch.bfloat16 and _bf16_kernels()


def _bf16_kernels() -> bool:
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _bytes(layer: torch.nn.Module) -> int:
    return layer.weight.numel() * layer.weight.element_size()


def available_bytes() -> int:
    """MemAvailable from /proc/meminfo (0 where there is none: nothing is packed)."""
    available = (int(line.split()[1]) * 1024 for line in _lines("/proc/meminfo") if line.startswith("MemAvailable:"))
    return next(available, 0)
