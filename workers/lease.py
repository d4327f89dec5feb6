"""Leadership by a Redis lease, for SWARM's Coordinator (§4.3.1): one coordinator leads while it
holds `LEASE_KEY` (SET NX PX, renewed by compare-and-pexpire); standbys keep trying and take
over within a TTL when the leader dies, or at once when it releases the lease on SIGTERM.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import redis

from app.pipeline import names

log = logging.getLogger(__name__)

LEASE_SAFETY = 0.8
"""The leader acts only until this fraction of the TTL has passed since its last successful
renewal was *sent*: Redis expires the lease no earlier than the full TTL after it received the
renewal, so a standby cannot hold it while this process still believes it leads."""
LEASE_SOCKET_TIMEOUT_S = 2.0
# Compare-and-pexpire / compare-and-delete on the lease. Renewal: 1 renewed, 0 another holder,
# -1 nobody (it lapsed: this process was not scheduled, or Redis was slow, for a whole TTL).
RENEW_SCRIPT = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
if not holder then return -1 end
return 0
"""
RELEASE_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

class LostLease(Exception):
    """This coordinator is no longer the leader: stop acting at once."""


class Lease:
    """Leadership by a Redis lease (SET NX PX), kept by a thread: the leader renews it every
    TTL/3 (compare-and-pexpire), a standby tries to take it every TTL/4. A failed or refused
    renewal ends the leadership at once; `held()` is what the acting thread checks."""

    def __init__(self, client: Any, owner: str, stop: threading.Event) -> None:
        self.redis = client
        self.id = owner
        self.stop = stop
        self.ttl_s = 1.0  # set by the coordinator from the config
        self.term = 0  # incremented on each acquisition
        self._held = False
        self._valid_until = 0.0
        self._renew = client.register_script(RENEW_SCRIPT)
        self._release = client.register_script(RELEASE_SCRIPT)
        self._thread = threading.Thread(target=self._run, name="lease", daemon=True)

    def held(self) -> bool:
        return self._held and time.monotonic() < self._valid_until

    def start(self) -> None:
        self._thread.start()

    def join(self) -> None:
        if self._thread.is_alive():
            self._thread.join(LEASE_SOCKET_TIMEOUT_S + 1)

    def _ttl_ms(self) -> int:
        return int(self.ttl_s * 1000)

    def _renewed(self, sent: float) -> None:
        self._valid_until = sent + self.ttl_s * LEASE_SAFETY

    def lose(self, why: str) -> None:
        self._held = False
        self._valid_until = 0.0
        log.warning("coordinator %s lost the lease: %s", self.id, why)

    def try_acquire(self) -> bool:
        sent = time.monotonic()
        ttl_ms = self._ttl_ms()
        # SET NX; or the lease is still ours (a renewal that failed on our side only).
        if self.redis.set(names.LEASE_KEY, self.id, nx=True, px=ttl_ms) or int(
            self._renew(keys=[names.LEASE_KEY], args=[self.id, ttl_ms])
        ) == 1:
            self._renewed(sent)
            self.term += 1
            self._held = True
            log.info("coordinator %s holds the lease (term %d)", self.id, self.term)
            return True
        return False

    def renew(self) -> None:
        sent = time.monotonic()
        done = int(self._renew(keys=[names.LEASE_KEY], args=[self.id, self._ttl_ms()]))
        if done == 1:
            self._renewed(sent)
        elif done == 0:
            self.lose("another coordinator holds it")
        else:  # a new term at once if still free; the state is reloaded (others may have led)
            self.lose("it lapsed before this renewal")
            self.try_acquire()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                if self._held:
                    self.renew()
                else:
                    self.try_acquire()
            except (redis.RedisError, OSError) as exc:
                if self._held:
                    self.lose(f"renewal failed ({exc})")
            self.stop.wait(self.ttl_s / 3 if self._held else self.ttl_s / 4)

    def release(self) -> None:
        """Compare-and-delete (after the thread has stopped), so a standby takes over at once."""
        self._held = False
        try:
            if int(self._release(keys=[names.LEASE_KEY], args=[self.id])) == 1:
                log.info("coordinator %s released the lease", self.id)
        except (redis.RedisError, OSError) as exc:
            log.warning("coordinator %s could not release the lease: %s", self.id, exc)
