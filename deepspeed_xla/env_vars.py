"""The one way to read a number or a flag that a user sets in the environment.

Every error names the variable, the value it had, and what to set instead. Imports nothing from the
package: the launcher, the device types and the comm layer all read their settings through here.
"""
from typing import Mapping, Optional


def _bad(name: str, value: str, wanted: str, example: str) -> ValueError:
    return ValueError(f"{name}={value!r} is not {wanted}: set it to {example}, or unset it.")


def positive_int(env: Mapping[str, str], *names: str) -> Optional[int]:
    """The first of ``names`` set to a positive integer (blank and 0 count as unset)."""
    for name in names:
        value = env.get(name, "").strip()
        if not value:
            continue
        try:
            number = int(value)
        except ValueError:
            raise _bad(name, value, "an integer", "a count such as 2") from None
        if number > 0:
            return number
    return None


def flag(env: Mapping[str, str], name: str) -> Optional[bool]:
    """torch_xla's flags are integers (``xu.getenv_as(name, bool)`` is ``bool(int(value))``); None when unset."""
    value = env.get(name)
    if value is None:
        return None
    try:
        return bool(int(value))
    except ValueError:
        raise _bad(name, value, "an integer", "1 (on) or 0 (off)") from None


def number(env: Mapping[str, str], name: str, example: str = "a fraction such as 0.75") -> Optional[float]:
    """A float; None when unset."""
    value = env.get(name)
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        raise _bad(name, value, "a number", example) from None


def positive_number(env: Mapping[str, str], name: str, example: str) -> Optional[float]:
    """A float greater than 0; None when unset or blank."""
    value = env.get(name, "").strip()
    if not value:
        return None
    result = number(env, name, example)
    if result <= 0:
        raise _bad(name, value, "greater than 0", example)
    return result
