"""Key revocation that does not hang on one pub/sub message: `DELETE /v1/admin/keys/{id}` tells
every hub at once over Redis pub/sub (at most once), and each api process also re-checks the keys
of its open WebSockets in SQL every `key_recheck_s`, so a revoked key's sockets close within that
bound when the message is lost. (The hub's listener itself survives a failing handler: it logs
the error and listens again, see `Hub._listen_notifications`.)"""

from __future__ import annotations

import asyncio
import logging

from starlette.concurrency import run_in_threadpool

from app.core.security import BOOTSTRAP_KEY_ID
from app.core.state import AppState
from app.pipeline import wire
from app.services import keys as key_service

log = logging.getLogger(__name__)

async def recheck_keys(state: AppState) -> set[str]:
    """Close the open WebSockets whose key no longer authenticates; the ids of those keys."""
    hub = state.hub
    if hub is None:
        return set()
    # The bootstrap key lives in the settings, not in SQL: it is valid until the restart.
    key_ids = {c.principal.key_id for c in hub.conns if c.closed is None} - {BOOTSTRAP_KEY_ID}
    if not key_ids:
        return set()

    def revoked() -> set[str]:
        with state.sessions() as session:
            return key_service.revoked_among(session, key_ids)

    gone = await run_in_threadpool(revoked)
    for key_id in gone:
        hub.handle_key_revoked(wire.KeyRevoked(key_id))
    return gone


async def key_recheck_loop(state: AppState) -> None:
    while True:
        await asyncio.sleep(state.settings.key_recheck_s)
        try:
            gone = await recheck_keys(state)
            if gone:
                # Pub/sub should have closed these at once: its message was lost.
                log.warning("closed the WebSockets of %d revoked keys the revocation message "
                            "did not reach: %s", len(gone), sorted(gone))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a failed round is retried next period
            log.warning("key re-check failed: %s", exc)
