"""Adding an API key to a config file: one ``[[auth.keys]]`` table appended, checked, written atomically.

The file is edited as text (appended to), so its comments and layout stay as
they were; the result is parsed and validated before it replaces the file.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
import tempfile
import tomllib
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from gateway.config.sections import Config, parse_config
from gateway.config.store import default_config_path
from gateway.config_schema import ConfigError
from gateway.tenancy.keys import hash_key, new_key


def add_key(path: Path, name: str, *, spend_limit_usd: float | None = None, period: str | None = None,
            requests_per_minute: int | None = None, models: Sequence[str] = (),
            presets: Sequence[str] = ()) -> str:
    """Append a new key named ``name`` to the config at ``path``; returns the key, which is stored nowhere.

    Options left as None or empty are left out of the table (the config's
    defaults apply). Raises ValueError (ConfigError included) when the file is
    the packaged default config, is invalid, already has a key of this name, or
    would not load with the new table; OSError when it cannot be read or written.
    """
    target = path.resolve()  # a symlinked config is edited where it lives
    packaged = default_config_path()
    if target == packaged.resolve():
        raise ValueError(f"{path} is the packaged default config (upgrades overwrite it); make a config of "
                         f"your own first (cp {packaged} my-pool.toml) and pass --config my-pool.toml")
    if spend_limit_usd is not None and not math.isfinite(spend_limit_usd):
        raise ValueError(f"--spend-limit-usd must be a finite number, got {spend_limit_usd!r}")
    text = target.read_bytes().decode("utf-8")
    current = _parse(text, path)
    if any(key.name == name for key in current.auth.keys):
        raise ValueError(f"{path} already has a key named {name!r}; pick another name")
    key = new_key()
    table = [f"# added by `routebalance keys add` on {datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC",
             "[[auth.keys]]",
             f"name = {_string(name)}",
             f"sha256 = {_string(hash_key(key))}"]
    if spend_limit_usd is not None:
        table.append(f"spend_limit_usd = {float(spend_limit_usd)!r}")
    if period is not None:
        table.append(f"period = {_string(period)}")
    if requests_per_minute is not None:
        table.append(f"requests_per_minute = {requests_per_minute}")
    if models:
        table.append(f"models = [{', '.join(map(_string, models))}]")
    if presets:
        table.append(f"presets = [{', '.join(map(_string, presets))}]")
    separator = "\n" if text.endswith("\n") or not text else "\n\n"
    new_text = text + separator + "\n".join(table) + "\n"
    _parse(new_text, path)  # the file as it will be must load, or it is not written
    _replace_atomically(target, new_text.encode("utf-8"))
    return key


def _parse(text: str, path: Path) -> Config:
    try:
        return parse_config(tomllib.loads(text), str(path))
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"invalid TOML: {err}", source=str(path)) from None


def _string(value: str) -> str:
    # JSON's string escapes (\" \\ \n \uXXXX ...) are all valid in a TOML basic string;
    # the parse check above rejects anything else (a raw DEL character).
    return json.dumps(value, ensure_ascii=False)


def _replace_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path`` and rename it over ``path``, keeping its mode.

    A reader (the gateway's config watcher) sees the old file or the new one,
    never a half-written one.
    """
    mode = stat.S_IMODE(path.stat().st_mode)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
