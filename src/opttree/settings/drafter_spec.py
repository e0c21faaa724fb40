"""A drafter spec, 'model+lookup': the draft sources of a generation, parsed once where the text comes
in (SpecConfig's `drafter`, the CLI's --drafter, a bench method, a calibration profile), with what each
source is declared to do (`opttree.settings.names.SourceKind`). Importable without torch (the CLI's parsers use it)."""

from __future__ import annotations

from dataclasses import dataclass

from .names import BUILTIN_SOURCE_KINDS, SourceKind

KINDS: dict[str, SourceKind] = dict(BUILTIN_SOURCE_KINDS)  # every selectable source; `declare_source` adds


def declare_source(name: str, kind: SourceKind) -> None:
    """Make `name` a valid part of a drafter spec (`opttree.step.drafters.sources.register_source` calls it)."""
    KINDS[name] = kind


@dataclass(frozen=True, repr=False, eq=False)
class DrafterSpec:
    """The sources of a drafter spec, checked: known names, no repeats; distribution sources first (the
    first one drives the tree policy), the others in the order given. Equal to another spec of the same
    sources, and to the text of one ('lookup+model' == DrafterSpec.parse('model+lookup'))."""

    names: tuple[str, ...]

    @classmethod
    def parse(cls, text: "str | DrafterSpec") -> "DrafterSpec":
        if isinstance(text, DrafterSpec):
            return text
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"drafter must name draft sources joined by '+' (e.g. 'model+lookup'), got {text!r}")
        names = [n.strip() for n in text.split("+")]
        unknown = [n for n in names if n not in KINDS]
        if unknown:
            raise ValueError(f"unknown draft source {unknown[0]!r} in drafter {text!r}; available: "
                             f"{', '.join(sorted(KINDS))} (join several with '+')")
        if len(set(names)) != len(names):
            raise ValueError(f"drafter {text!r} names a source twice")
        return cls(tuple(sorted(names, key=lambda n: not KINDS[n].distribution)))

    def __str__(self) -> str:
        return "+".join(self.names)

    def __repr__(self) -> str:
        return repr(str(self))

    def __eq__(self, other) -> bool:
        if isinstance(other, str):
            try:
                other = DrafterSpec.parse(other)
            except ValueError:
                return False
        return isinstance(other, DrafterSpec) and other.names == self.names

    def __hash__(self) -> int:
        return hash(self.names)

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def plus(self, name: str) -> "DrafterSpec":
        """This spec with source `name` added (itself if it has it)."""
        return self if name in self else DrafterSpec.parse(f"{self}+{name}")

    @property
    def first(self) -> SourceKind:
        """The source that answers the tree policy's queries."""
        return KINDS[self.names[0]]

    @property
    def uses_draft_model(self) -> bool:
        return any(KINDS[n].draft_model for n in self.names)

    @property
    def runs_network(self) -> bool:
        """A draft layer costs a forward of a network."""
        return any(KINDS[n].network for n in self.names)

    @property
    def drafts_on_target_cache(self) -> bool:
        return any(KINDS[n].own_cache for n in self.names)


def default_drafter(has_draft: bool, has_datastore: bool = False) -> DrafterSpec:
    """`model` with a draft model, else the train-free `recycling+lookup`; with a datastore, `+datastore`."""
    return DrafterSpec.parse(("model" if has_draft else "recycling+lookup") + ("+datastore" if has_datastore else ""))

