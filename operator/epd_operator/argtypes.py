"""argparse types shared by the operator's and the data plane's command lines, so their errors
read alike."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from .ec.quantity import parse_quantity


def positive(text: str) -> float:
    value = float(text)
    if not 0 < value < math.inf:  # nan too
        raise argparse.ArgumentTypeError(f"must be a positive number, not {text}")
    return value


def int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, not {text}")
        return value

    return parse


positive_int = int_at_least(1)


def port(text: str) -> int:
    value = int(text)
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"not a TCP port: {text}")
    return value


def byte_quantity(text: str) -> int:
    try:
        return parse_quantity(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
