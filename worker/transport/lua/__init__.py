"""ticketq's Redis scripts, one `.lua` file each; Python only loads and dispatches them."""

from __future__ import annotations

import functools
from importlib.resources import files


@functools.cache
def script(name: str) -> str:
    """The text of `lua/<name>.lua`."""
    return files(__package__).joinpath(f"{name}.lua").read_text(encoding="utf-8")
