"""Byte quantities as Kubernetes writes them ("16Gi", "512M", "1e9"): one grammar for the
API's pattern (so the API server and the CRD refuse what the janitor could not parse) and for
the parser."""

from __future__ import annotations

import math
import re
from decimal import Decimal

# No milli or negative values: a byte count is whole and positive. ASCII digits only, and an
# exponent of at most two digits: `1e999999999` would take the parser minutes and no pod has it.
BYTE_QUANTITY = r"^\+?([0-9]{1,19}(\.[0-9]{0,19})?|\.[0-9]{1,19})([eE][+]?[0-9]{1,2}|Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"
# Kubernetes' own quantity grammar (resource.Quantity), exponent bounded likewise.
QUANTITY = r"^[+-]?([0-9]{1,19}(\.[0-9]{0,19})?|\.[0-9]{1,19})([KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]{1,2})?$"
# Kubernetes keeps quantities in an int64: no emptyDir or budget can be larger. The bound is 2**62,
# not 2**63 - 1: the API server reads a CRD's `maximum` as a float64, where 2**63 - 1 becomes 2**63,
# no longer an int64, and then refuses every object that sets the field ("Maximum boundary value
# must be of type integer").
MAX_BYTES = 2**62
_PATTERN = re.compile(BYTE_QUANTITY)

_SUFFIXES = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}


def parse_quantity(quantity: str) -> int:
    """Bytes in a byte quantity, rounded up as Kubernetes rounds them ("1.5Gi", "1000").
    Raises ValueError for anything BYTE_QUANTITY refuses (e.g. "100m")."""
    match = _PATTERN.fullmatch(quantity.strip())
    if not match:
        raise ValueError(f"not a byte quantity: {quantity!r}")
    number, _fraction, suffix = match.groups()
    if (suffix or "") in _SUFFIXES:  # E and Ei are exa and exbi, not exponents
        scale = Decimal(_SUFFIXES[suffix or ""])
    else:
        scale = Decimal(10) ** int(suffix[1:].lstrip("+"))
    return math.ceil(Decimal(number) * scale)


def byte_quantity(size: int) -> str:
    """A byte count as Kubernetes would write it: 20Gi, 512Mi, or the bytes."""
    for unit, scale in (("Gi", 2**30), ("Mi", 2**20)):
        if size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)


def human_bytes(size: int) -> str:
    """1.5Gi, 12.0Mi, 300B: for messages people read."""
    for unit, scale in (("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if size >= scale:
            return f"{size / scale:.1f}{unit}"
    return f"{size}B"
