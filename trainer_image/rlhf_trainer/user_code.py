"""Loading a user's function named `module:function` or `path/to/file.py:function` (reward functions,
agent functions).

Owns the one way a spec field names user code, and its errors (each names the field). Must not call the
function or know what it computes.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def load_callable(ref: str, field: str, error: type[Exception] = ValueError) -> Callable[..., Any]:
    """`path/to/file.py:function` or `package.module:function` -> the callable; raises `error` with a
    message naming `field` (the spec field that holds `ref`). A file is loaded once per resolved path
    under a private module name, so two files with the same stem do not shadow each other."""
    if ":" not in ref:
        raise error(f"{field} {ref!r}: expected 'module:function' or 'file.py:function'")
    target, _, name = ref.rpartition(":")
    try:
        if target.endswith(".py"):
            path = Path(target)
            if not path.is_file():
                raise error(f"{field} {ref!r}: file {target} does not exist")
            mod_name = f"rlhf_user_{abs(hash(str(path.resolve())))}"
            spec = importlib.util.spec_from_file_location(mod_name, path)
            if spec is None or spec.loader is None:
                raise error(f"{field} {ref!r}: cannot load {target}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[mod_name] = module
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except error:
        raise
    except Exception as e:
        raise error(f"{field} {ref!r}: import of {target} failed: {type(e).__name__}: {e}") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        raise error(f"{field} {ref!r}: {target} has no callable {name!r}")
    return fn  # type: ignore[no-any-return]
