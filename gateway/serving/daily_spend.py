"""Spend counted per UTC day, for the caps of what the gateway spends on its own learning (exploration,
shadow answers): the count starts again at 0 when the wall clock's date changes."""

from __future__ import annotations

import time


class DailySpend:
    def __init__(self) -> None:
        self._day = ""
        self._usd = 0.0

    @property
    def today_usd(self) -> float:
        self._roll()
        return self._usd

    def add(self, usd: float) -> None:
        """Book `usd` (negative: a reservation settled for less) against today; never below 0, so a reservation
        made before midnight and settled after it gives the new day no extra room."""
        self._roll()
        self._usd = max(self._usd + usd, 0.0)

    def _roll(self) -> None:
        day = time.strftime("%Y-%m-%d", time.gmtime())
        if day != self._day:
            self._day, self._usd = day, 0.0
