"""Environment variables (DDTREE_*), read by one set of rules wherever they are used: an empty value is unset,
booleans take 0/1/false/true/no/yes/off/on in any case, a choice outside its list is refused with the list, and
a path has `~` expanded. A bad value is a ConfigError naming the variable, the value and what it accepts."""
from __future__ import annotations

import os
from pathlib import Path

from .config import ConfigError

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


def env_value(name: str) -> str | None:
    """The variable's value without surrounding blanks; None where it is unset or empty."""
    value = os.environ.get(name, "").strip()
    return value or None


def env_flag(name: str, default: bool) -> bool:
    """A boolean variable (`default` where unset)."""
    value = env_value(name)
    if value is None:
        return default
    if value.lower() in TRUE:
        return True
    if value.lower() in FALSE:
        return False
    raise ConfigError(f"{name}={value!r} is not a boolean: use one of {', '.join(TRUE)} or {', '.join(FALSE)} "
                      f"(or unset it)")


def env_choice(name: str, choices, default: str | None = None) -> str | None:
    """One of `choices` (compared in lower case), `default` where unset."""
    value = env_value(name)
    if value is None:
        return default
    if value.lower() not in choices:
        raise ConfigError(f"{name}={value!r} is not valid: use one of {', '.join(choices)} (or unset it)")
    return value.lower()


def env_int(name: str, low: int = 1) -> int | None:
    """An integer variable (>= low), None where unset."""
    value = env_value(name)
    if value is None:
        return None
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or number < low:
        raise ConfigError(f"{name}={value!r} is not valid: use an integer >= {low} (or unset it)")
    return number


def env_path(name: str, default: Path) -> Path:
    """A folder or file named by the variable, `~` expanded and made absolute (a later chdir does not move it)."""
    value = env_value(name)
    return Path(value).expanduser().absolute() if value is not None else Path(default).expanduser()
