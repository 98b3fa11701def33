"""kopf's watch streams decoded by orjson instead of the standard library's json.

Every event of every watch is one JSON line that kopf decodes with `json.loads` before anything
else looks at it; a unit's pod is about 21 KB as the API server sends it, a StatefulSet 29 KB.
At 1,000 units that decoding was 35 % of the operator's py-spy samples; orjson decodes the same
lines to the same Python objects in about half the time, and the operator's CPU while 1,000 units
start fell by a fifth (docs/performance.md). A line orjson refuses and the standard library takes
(a string escaping a lone UTF-16 surrogate) is decoded by `json`: no line the standard library
decodes stops a watch that did not stop before. Installed only on the kopf module it was written
against (kopf_source.py): `stream` is that module's only user of `json`.
"""

from __future__ import annotations

import json
from typing import Any

import orjson
from kopf._cogs.clients import api  # kopf's own module: nothing public to hook into

from . import kopf_source

# kopf 1.45.2's clients/api.py (kopf_source.py).
API_SHA256 = "26a2f108e79ac5cffb5ab98510ec5f6d1709154b2970cdacee99869f994f08aa"


def loads(line: str | bytes) -> Any:
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError:
        return json.loads(line)


class _Decoder:
    """What kopf's watch stream calls as `json.loads`."""

    loads = staticmethod(loads)


def install() -> bool:
    """Make kopf's watch streams decode with `loads` (before kopf.run); False, and kopf's own
    decoding, if kopf's module is not the one this was written against."""
    if not kopf_source.unchanged(api, API_SHA256, "orjson decoding of watch streams"):
        return False
    api.json = _Decoder  # type: ignore[assignment]  # kopf's json module, replaced on purpose: its source is pinned
    return True
