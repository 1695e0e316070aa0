"""Shows a ``ReadOnly`` attribute in the API reference as the read-only property it acts
as: its value's type, no right-hand side (which names where the object keeps it)."""

from __future__ import annotations

from typing import Any

import griffe


class ReadOnlyAttributes(griffe.Extension):
    """``name: ReadOnly[str] = ReadOnly("_state.name")`` reads ``name: str``, labelled as
    a property."""

    def on_attribute_instance(self, *, attr: griffe.Attribute, **kwargs: Any) -> None:
        annotation = attr.annotation
        if not isinstance(annotation, griffe.ExprSubscript):
            return
        if annotation.canonical_path == "rselection.readonly.ReadOnly":
            attr.annotation = annotation.slice
            attr.value = None
            attr.labels = {"property"}
