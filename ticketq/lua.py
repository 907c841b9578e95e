"""ticketq's Redis scripts: one `.lua` file each, beside the module that dispatches it (each
file's header lists its keys and arguments); Python only loads and dispatches them."""

from __future__ import annotations

import functools
from importlib.resources import files


@functools.cache
def script(package: str, name: str) -> str:
    """The text of `<name>.lua` in `package` (a dispatching module passes its own `__package__`)."""
    return files(package).joinpath(f"{name}.lua").read_text(encoding="utf-8")
