"""The live progress line: elapsed, sent, in flight, errors and current goodput (tqdm, on stderr)."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from tqdm import tqdm

from kernels.tiers import TierSlo, slo_for
from loadtest.record import RequestRecord
from loadtest.slo import meets_slo

GOODPUT_WINDOW_S = 10.0


class Progress:
    """Counts sends and completions; ``refresh(now_s)`` redraws at most a few times a second."""

    def __init__(self, total: int, tier_to_slo: Mapping[str, TierSlo], enabled: bool) -> None:
        self._bar = tqdm(total=total, unit="req", desc="sent", disable=not enabled, mininterval=0.5, leave=True)
        self._tier_to_slo = tier_to_slo
        self._met_at_s: deque[float] = deque()
        self.num_sent = 0
        self.num_done = 0
        self.num_errors = 0

    def on_sent(self) -> None:
        self.num_sent += 1
        self._bar.update(1)

    def on_done(self, record: RequestRecord, now_s: float) -> None:
        self.num_done += 1
        if not record.ok:
            self.num_errors += 1
        elif meets_slo(record, slo_for(self._tier_to_slo, record.tier)):
            self._met_at_s.append(now_s)

    @property
    def num_in_flight(self) -> int:
        return self.num_sent - self.num_done

    def goodput_rps(self, now_s: float) -> float:
        """SLO-meeting completions per second over the last GOODPUT_WINDOW_S."""
        while self._met_at_s and self._met_at_s[0] < now_s - GOODPUT_WINDOW_S:
            self._met_at_s.popleft()
        return len(self._met_at_s) / min(GOODPUT_WINDOW_S, max(now_s, 1e-9))

    def refresh(self, now_s: float) -> None:
        self._bar.set_postfix(
            in_flight=self.num_in_flight, errors=self.num_errors, goodput=f"{self.goodput_rps(now_s):.1f}/s", refresh=True
        )

    def close(self) -> None:
        self._bar.close()
