"""Field ownership of the children the operator creates with a plain POST.

A POST costs the API server about half what a server-side apply that creates the same object
does (docs/performance.md), so a child that does not exist yet is created with one. Its fields
are then owned by an `Update` entry of the operator's field manager, and a later server-side
apply by the same manager would not remove a field it stops setting (the `Update` entry still
owns it). So before the first apply to such a child, its `Update` entry is merged into the
manager's `Apply` entry, as client-go's csaupgrade does when kubectl first server-side applies
an object created by `kubectl create`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def owned_by_update(entries: list[dict[str, Any]], manager: str) -> bool:
    """Whether `manager` still owns fields of the object through an Update entry (it created the
    object by POST and has not applied to it since): the index keeps this, so an apply to a child
    already taken over reads nothing first."""
    return any(_is_update_of(e, manager) for e in entries)


def upgrade_to_apply(entries: list[dict[str, Any]], manager: str) -> list[dict[str, Any]] | None:
    """`entries` (an object's metadata.managedFields) with `manager`'s Update entries of the
    object itself (not of a subresource such as status) merged into its Apply entry; None if it
    has no such Update entry, so nothing needs to change. Other managers' entries are kept."""
    updates = [e for e in entries if _is_update_of(e, manager)]
    if not updates:
        return None
    kept = [e for e in entries if not _is_update_of(e, manager)]
    applied = next((e for e in kept if e.get("manager") == manager and e.get("operation") == "Apply"), None)
    fields: dict[str, Any] = {}
    for entry in updates + ([applied] if applied else []):
        _merge_into(fields, entry.get("fieldsV1") or {})
    upgraded = {**(applied or updates[0]), "operation": "Apply", "fieldsV1": fields}
    if applied is None:
        return [upgraded, *kept]
    return [upgraded if e is applied else e for e in kept]


def _is_update_of(entry: Mapping[str, Any], manager: str) -> bool:
    return entry.get("manager") == manager and entry.get("operation") == "Update" and not entry.get("subresource")


def _merge_into(into: dict[str, Any], fields: Mapping[str, Any]) -> None:
    """Union of two FieldsV1 tries (each key a field, list item or `.` for the node itself)."""
    for key, child in fields.items():
        _merge_into(into.setdefault(key, {}), child)
