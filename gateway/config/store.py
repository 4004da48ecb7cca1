"""Loading config.toml and reloading it.

``ConfigStore`` owns the current ``Config`` and swaps it only when a reload
parses and validates cleanly; it has no thread or event loop of its own (the
server polls ``changed_on_disk`` and calls ``reload``).
"""

from __future__ import annotations

import logging
import os
import tomllib
from collections.abc import Callable
from pathlib import Path

from gateway.config.sections import Config, parse_config
from gateway.config_schema import ConfigError

log = logging.getLogger("gateway.config")


def _read(path: Path) -> tuple[Config, tuple[int, int, int] | None]:
    """Parse ``path``; also return the stamp of the version that was read.

    The stamp comes from fstat of the open file before reading, so a write
    that races the read shows up as a change later instead of being missed.
    """
    try:
        with open(path, "rb") as fh:
            st = os.fstat(fh.fileno())
            raw = fh.read()
    except OSError as err:
        raise ConfigError(f"cannot read: {err.strerror or err}", source=str(path)) from None
    stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"invalid TOML: {err}", source=str(path)) from None
    return parse_config(data, str(path)), stamp


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read and validate a TOML config file; raises ConfigError."""
    return _read(Path(path))[0]


def default_config_path() -> Path:
    """The packaged default config (the 13-instance pool of the paper)."""
    return Path(__file__).with_name("default.toml")


def resolve_config_path(given: str | os.PathLike[str] | None = None) -> Path:
    """The config file a command reads: the one given, else ./config.toml when there is one (so the
    repository's file, or a deployment's, is what every command reads), else the packaged default."""
    if given is not None:
        return Path(given)
    local = Path("config.toml")
    if local.is_file():
        log.info("config: ./config.toml (the working directory's; --config picks another)")
        return local
    path = default_config_path()
    log.info("config: the built-in %s (no ./config.toml here; --config picks another)", path)
    return path


def _stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


class ConfigStore:
    """The current Config of a file, replaced only by a reload that validates.

    Construction loads the file and raises ConfigError if it is invalid (the
    server should not start on a bad config). Later failures keep the old
    config, log a warning and are counted.
    """

    def __init__(self, path: str | os.PathLike[str], adjust: Callable[[Config], Config] | None = None):
        self.path = Path(path)
        # What the command adds on every load: its own checks (the emulator's tables) and overrides (ports).
        self._adjust = adjust or (lambda config: config)
        self._config, self._seen = self._read()
        self._subscribers: list[Callable[[Config], None]] = []
        self.reloads_ok = 0
        self.reloads_failed = 0
        self.last_error: str | None = None  # message of the last reload if it failed

    def _read(self) -> tuple[Config, tuple[int, int, int] | None]:
        config, stamp = _read(self.path)
        try:
            return self._adjust(config), stamp
        except ConfigError as err:  # a check of the command's own (the emulator's tables): named as the file's
            raise ConfigError(err.reason, err.key, str(self.path)) from None

    @property
    def current(self) -> Config:
        return self._config

    def subscribe(self, callback: Callable[[Config], None]) -> Callable[[], None]:
        """Call ``callback(new_config)`` after each swap; returns an unsubscribe function."""
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback)

    def changed_on_disk(self) -> bool:
        """Has the file changed since the version last read (loaded or rejected)?

        A rejected version counts as read, so a polling watcher retries only
        when the file changes again instead of failing every interval.
        """
        return _stamp(self.path) != self._seen

    def reload(self) -> tuple[bool, str]:
        """Re-read the file. Returns (ok, message); on failure the old config stays."""
        try:
            new, self._seen = self._read()
        except ConfigError as err:
            self._seen = _stamp(self.path)
            self.reloads_failed += 1
            self.last_error = str(err)
            log.warning("config reload failed, keeping the previous config: %s", err)
            return False, str(err)
        self.reloads_ok += 1
        self.last_error = None  # it describes the current state, not history
        if new == self._config:  # touched, not changed: keep the object, wake nobody
            return True, f"{self.path}: unchanged"
        self._config = new
        log.info("config reloaded from %s", self.path)
        for callback in list(self._subscribers):
            try:
                callback(new)
            except Exception:  # one broken subscriber must not stop the others
                log.exception("config subscriber %r failed", callback)
        return True, f"{self.path}: reloaded ({len(new.instances)} instances)"
