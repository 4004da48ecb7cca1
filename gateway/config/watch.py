"""The shell around ConfigStore: follow the file on disk."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from gateway.config.store import ConfigStore


async def watch_file(store: ConfigStore, on_reload: Callable[[bool], None] | None = None) -> None:
    """Poll the config file and reload it when it changes (no inotify dependency)."""
    while True:
        interval = store.current.server.config_watch_interval_s
        await asyncio.sleep(interval or 1.0)
        if interval and store.changed_on_disk():
            ok, _ = store.reload()
            if on_reload:
                on_reload(ok)
