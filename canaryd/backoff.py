"""Jittered, bounded exponential backoff (client-go's shape: 800 ms doubling to 30 s)."""

import random


class Backoff:
    def __init__(self, initial: float, maximum: float, *, rng: random.Random | None = None) -> None:
        self.initial = initial
        self.maximum = maximum
        self._next = initial
        self._rng = rng or random.Random()

    def next(self) -> float:
        """The next delay: the current step with ±20% jitter, then double the step."""
        step = self._next
        self._next = min(self._next * 2, self.maximum)
        return min(step * self._rng.uniform(0.8, 1.2), self.maximum)

    def reset(self) -> None:
        self._next = self.initial
