"""The executor's side of kNN registrations (`app.pipeline.knnreg`): each report of a local
list goes through the merge script, whose answer may ask for a resize (fewer than k within
the radius: grow; the k-th far inside it: shrink) or say the report was of an older
registration (drop it here); registrations that reach this worker under an older plan are
forwarded to the owners under the newer ones, with their tokens."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from app.core.redis import is_pipeline, run_script
from app.geo.geometry import circle_bbox
from app.pipeline import knnreg, names, wire
from app.pipeline.histories import history_chunks, history_housekeeping_ms
from workers.knn import MOVING, KnnState, KnnSub, knn_sub

if TYPE_CHECKING:
    from workers.executor import Executor

log = logging.getLogger(__name__)

MERGE_CHUNK = 256  # reports per merge call at most (bounds the time Redis is busy)


class KnnRegistry:
    def __init__(self, executor: Executor) -> None:
        self.ex = executor
        self.broadcast = executor.replicated or executor.settings.knn_broadcast
        self._merge = executor.redis.register_script(knnreg.MERGE_SCRIPT)
        self._resize = executor.redis.register_script(knnreg.RESIZE_SCRIPT)
        self._drop = executor.redis.register_script(knnreg.DROP_WORKER_SCRIPT)
        self._leave = executor.redis.register_script(knnreg.LEAVE_SCRIPT)
        self.history = knnreg.PlanHistory()
        # reports queued on a pipeline: (pipeline, position of the call, position of the
        # report in it, tenant, sub, epoch)
        self.queued: list[tuple[Any, int, int, str, KnnSub, int]] = []
        self.resizes = {"grow": 0, "shrink": 0, "leave": 0}
        self.reports = 0  # local lists sent to the merge script
        s = executor.settings  # the history arguments of every report
        self._history_args = (s.history_max_len, int(s.history_max_age_s) + 60,
                              int(s.history_max_age_s * 1000),
                              history_housekeeping_ms(s.history_max_age_s))
        self.skipped = 0  # changes of lists held alone that could not change the merged one

    # --- reports -------------------------------------------------------------------------
    def report(self, tenant: str, subs: list[KnnSub], pipe: Any,
               clear: tuple[str, ...] = (), force: bool = False) -> None:
        """Each sub's local list to the merge script, on `pipe` (a pipeline: the answers are
        read by `settle` after it executes) or on the client itself (answered at once); many
        in one call (`knnreg.merge_call`). Unless `force` (or tokens to `clear`), a list this
        worker holds alone is reported only when the merged list could change
        (`_merge_could_change`)."""
        taken: list[tuple[KnnSub, knnreg.Report]] = []
        for sub in subs:
            members = sub.keys  # (kind, id) of each, in order
            if not (force or clear) and sub.sole and not _merge_could_change(sub, members):
                self.skipped += 1
                continue
            sub.reported = members
            local = orjson.dumps([(d, oid, x, y, _kind(key)) for d, oid, x, y, key in sub.local])
            refresh = wire.encode_entry(wire.KnnRefresh(tenant=tenant, ids=[sub.id],
                                                        epoch=sub.epoch))
            # held alone at the last report (as most are): the merged list is ours, as we
            # render it, if it still is
            whole = (knnreg.sole_rendering(sub.local, sub.k) if sub.sole
                     else knnreg.NO_SOLE_RENDERING)
            taken.append((sub, knnreg.Report(sub.id, sub.epoch, local, sub.k, refresh, whole)))
        self.reports += len(taken)
        direct = not is_pipeline(pipe)
        outbox = self.ex.relayer is not None
        if outbox:  # (a call per history group: see `history_chunks`)
            taken.sort(key=lambda t: names.history_tag(t[0].id))
        for a, b in history_chunks([sub.id for sub, _ in taken], outbox, MERGE_CHUNK):
            call = taken[a:b]
            keys, args = knnreg.merge_call(self.ex.id, tenant, self._history_args,
                                           [r for _, r in call], outbox, clear)
            if direct:
                answers = self._merge(keys=keys, args=args, client=pipe)
                self._relay(call[0][0].id)
                for (sub, r), out in zip(call, answers, strict=True):
                    self._answer(tenant, sub, r.epoch, out)
            else:
                at = len(pipe.command_stack)
                run_script(pipe, self._merge, keys, args)
                self.queued += [(pipe, at, j, tenant, sub, r.epoch)
                                for j, (sub, r) in enumerate(call)]

    def _outbox(self, sub_id: str) -> list[str]:
        """The outbox the kNN scripts write their messages to, with outboxes (a cluster)."""
        return [] if self.ex.relayer is None else [names.history_outbox(sub_id)]

    def _relay(self, sub_id: str) -> None:
        """Relay what a direct call of a kNN script wrote to its outbox (with outboxes; a
        call queued on a commit is relayed with it, `workers.outbox`)."""
        if self.ex.relayer is not None:
            self.ex.relayer.relay_all(names.history_outbox(sub_id))

    def settle(self, pipe: Any, results: list[Any]) -> None:
        """The answers of the reports queued on `pipe`, now executed."""
        mine = [q for q in self.queued if q[0] is pipe]
        self.queued = [q for q in self.queued if q[0] is not pipe]
        for _, at, j, tenant, sub, epoch in mine:
            answers = results[at]  # of the call, or the error it failed with
            self._answer(tenant, sub, epoch,
                         answers if isinstance(answers, Exception) else answers[j])

    def forget(self, pipe: Any) -> None:
        """`pipe` was discarded: its reports were never made (their lists are reported
        whole at their next change)."""
        for q in self.queued:
            if q[0] is pipe:
                q[4].sole, q[4].reported = False, None
        self.queued = [q for q in self.queued if q[0] is not pipe]

    def _answer(self, tenant: str, sub: KnnSub, epoch: int, out: Any) -> None:
        if isinstance(out, Exception) or not out:
            sub.sole = False
            return
        status = int(out[0])
        sub.sole = status != -1 and len(out) > 2 and int(out[2]) == 1
        if status == -1:  # a newer registration leaves us out (its retraction is on its way)
            self.retract(tenant, [sub.id], epoch + 1)
        elif status == 2 and not self.broadcast:
            self.resize(tenant, sub, epoch, grow=True, kth=0.0)
        elif status == 3 and not self.broadcast:
            raw = out[1].decode() if isinstance(out[1], bytes) else str(out[1])
            self.resize(tenant, sub, epoch, grow=False, kth=float(raw))

    # --- registrations -------------------------------------------------------------------
    def register(self, ms: list[wire.SubscriptionCopy], pipe: Any, clear: tuple[str, ...] = ()
                 ) -> None:
        """Registrations (new, or of a newer epoch); an older one is only reported (its
        token is cleared) while the newer stays. `clear`: more tokens their reports clear.
        The new ones of a tenant search together (`KnnState.add_many`)."""
        ex = self.ex
        fresh: dict[str, dict[str, KnnSub]] = {}  # tenant -> id -> the registration to add
        for m in ms:
            taken = fresh.setdefault(m.tenant, {})
            held = taken.get(m.id) or ex.knn_state(m.tenant).subs.get(m.id)
            if held is None or held.epoch < m.epoch:
                taken[m.id] = knn_sub(m.id, m.spec, m.radius_m, m.epoch)
                ex.sub_msgs[m.id] = m
        for tenant, taken in fresh.items():
            if taken:
                ex.knn_state(tenant).add_many(list(taken.values()))
        for m in ms:  # each clears its token
            self.report(m.tenant, [ex.knn[m.tenant].subs[m.id]], pipe, clear, force=True)

    def on_refresh(self, msg: wire.KnnRefresh, pipe: Any,
                   notify: dict[str, set[str]]) -> None:
        """Another worker holds lists this worker held alone: report them whole (the merge
        waits for it); a registration of another epoch has nothing to report."""
        state = self.ex.knn.get(msg.tenant)
        if state is None:
            return
        subs = [sub for sid in msg.ids
                if (sub := state.subs.get(sid)) is not None and sub.epoch == msg.epoch]
        if subs:
            self.report(msg.tenant, subs, pipe, force=True)
            notify.setdefault(msg.tenant, set()).update(s.id for s in subs)

    def retract(self, tenant: str, ids: list[str], epoch: int) -> None:
        """Registrations older than `epoch` leave this worker (not deleted: see KnnRetract)."""
        ex = self.ex
        state = ex.knn.get(tenant) if tenant else None
        states = [state] if state is not None else list(ex.knn.values())
        for sid in ids:
            for st in states:
                sub = st.subs.get(sid)
                if sub is not None and sub.epoch < epoch:
                    st.remove(sid)
                    ex.sub_msgs.pop(sid, None)
                    ex.ledger.remove_query(sid)

    def resize(self, tenant: str, sub: KnnSub, epoch: int, grow: bool, kth: float) -> None:
        """Register `sub` again with a grown or shrunk radius (if its epoch is still
        `epoch`: another worker may have done it)."""
        ex = self.ex
        copy = ex.sub_msgs.get(sub.id)
        if copy is None or ex.index is None:
            return
        if grow:
            if not math.isfinite(sub.radius):
                return
            radius = sub.radius * knnreg.GROW
            if radius >= knnreg.WORLD_M:
                radius = math.inf
        else:
            radius = max(2.0 * kth, knnreg.MIN_RADIUS_M)
            if radius >= sub.radius:
                return
        events = bool(ex.redis.exists(names.events_key(tenant)))
        workers = self._workers(sub, radius, events)
        reg = wire.encode_entry(wire.SubsAdded(subs=[wire.SubscriptionCopy(
            id=copy.id, tenant=copy.tenant, spec=copy.spec, expires_at=copy.expires_at,
            radius_m=radius if math.isfinite(radius) else None, epoch=epoch + 1)],
            plan_version=ex.index.version))
        retract = wire.encode_entry(wire.KnnRetract(ids=[sub.id], epoch=epoch + 1))
        done = self._resize(keys=[names.knn_key(sub.id), *self._outbox(sub.id)],
                            args=[epoch, knnreg.stored_radius(radius), reg, retract,
                                  knnreg.STREAM_TEMPLATE, *sorted(workers)])
        self._relay(sub.id)
        if done:
            self.resizes["grow" if grow else "shrink"] += 1
            log.debug("worker %s: kNN %s radius %.0f -> %.0f m on %s", ex.id, sub.id,
                      sub.radius, radius, sorted(workers))

    def leave_unreached(self, carried: list[tuple[str, KnnSub]]) -> None:
        """After a move or split handed partitions off with these registrations: those whose
        circle reaches none of this worker's partitions any more leave it, unless their
        tenant may have events here (`names.events_key`: they stay where they were stored
        for the window) or their list holds an object on its way to another worker (a
        ghost: it stays listed here until its new owner has it). The registration keeps its
        epoch on the receivers; only this worker's part of it goes (LEAVE_SCRIPT)."""
        ex = self.ex
        if self.broadcast or not carried:
            return
        tenants = sorted({t for t, _ in carried})
        pipe = ex.redis.pipeline(transaction=False)
        for t in tenants:
            pipe.exists(names.events_key(t))
        events = dict(zip(tenants, map(bool, pipe.execute()), strict=True))
        pipe = ex.redis.pipeline(transaction=False)  # one round trip for them all
        leaving: list[tuple[str, KnnSub]] = []
        for tenant, sub in carried:
            state = ex.knn.get(tenant)
            if (events[tenant] or state is None or not math.isfinite(sub.radius)
                    or any(_kind(n[4]) == MOVING and n[1] in state.ghosts for n in sub.local)
                    or ex.id in self._workers(sub, sub.radius, False)):
                continue
            run_script(pipe, self._leave, [names.knn_key(sub.id)], [ex.id, sub.epoch])
            leaving.append((tenant, sub))
        left = 0
        for (tenant, sub), done in zip(leaving, pipe.execute(), strict=True):
            if done:
                self.retract(tenant, [sub.id], sub.epoch + 1)
                left += 1
        self.resizes["leave"] += left
        if left:
            log.info("worker %s: %d kNN registrations left it with the partitions handed off",
                     ex.id, left)

    def _workers(self, sub: KnnSub, radius: float, events: bool) -> set[str]:
        ex = self.ex
        assert ex.index is not None
        if events:
            self.history.read(lambda n: ex.redis.lrange(names.PLAN_HISTORY, -n, -1))
        horizon = time.time() - ex.settings.window_s - ex.settings.bucket_s
        return knnreg.registration_workers(self.history, ex.index, horizon, sub.lon, sub.lat,
                                           radius, events)

    def forward(self, m: wire.SubscriptionCopy, since_version: int, owner: str,
                pipe: Any) -> None:
        """A registration routed under plan `since_version` to `owner` (this worker, or a
        dead one whose stream we adopted): the owners within its radius under the newer
        plans get it too, each with a token, before `owner`'s report (or, adopted, instead
        of it) can complete the merged list."""
        ex = self.ex
        key = names.knn_key(m.id)
        if owner != ex.id:
            pipe.hdel(key, knnreg.PENDING + owner)
        if m.radius_m is None or ex.index is None:
            return  # unbounded: it went to every worker
        self.history.read(lambda n: ex.redis.lrange(names.PLAN_HISTORY, -n, -1))
        plans = [ex.index, *(p for v, (_, p) in self.history.plans.items()
                             if since_version < v < ex.index.version)]
        lon, lat = m.spec["point"]
        targets = knnreg.circle_workers(plans, float(lon), float(lat), m.radius_m) - {owner}
        for w in sorted(targets):
            pipe.hset(key, knnreg.PENDING + w, str(m.epoch))
            pipe.xadd(names.worker_stream(w), {b"m": wire.encode_entry(
                wire.SubsAdded(subs=[m], plan_version=ex.index.version))})
        if targets:
            pipe.expire(key, 30 * 24 * 3600)

    def drop_worker(self, sub_ids: list[str], dead: str, pipe: Any) -> None:
        """A dead worker's lists and the tokens waiting for it leave these subscriptions."""
        for sid in sub_ids:
            run_script(pipe, self._drop, [names.knn_key(sid)], [dead])

    def stored(self, sub_ids: list[str]) -> dict[str, tuple[int, float, bool]]:
        """sub -> (epoch, radius, whether this worker is registered) from the hashes; those
        without a registration are left out."""
        ex = self.ex
        pipe = ex.redis.pipeline(transaction=False)
        for sid in sub_ids:
            pipe.hmget(names.knn_key(sid), ["_e", "_r", knnreg.PENDING + ex.id, ex.id])
        out: dict[str, tuple[int, float, bool]] = {}
        for sid, (e, r, p, f) in zip(sub_ids, pipe.execute(), strict=True):
            if e is not None:
                out[sid] = (int(e), knnreg.read_radius(r), p is not None or f is not None)
        return out

    def handoff(self, state: KnnState, inside_rect: Any) -> list[wire.SubscriptionCopy]:
        """The kNN registrations a handoff carries: those whose circle reaches the given
        partitions (`inside_rect(bbox)`), with their current radius and epoch."""
        if self.broadcast:
            return []  # every worker has every one
        out = []
        for sub in state.subs.values():
            copy = self.ex.sub_msgs.get(sub.id)
            if copy is None:
                continue
            box = (circle_bbox(sub.lon, sub.lat, sub.radius) if math.isfinite(sub.radius)
                   else (-180.0, -90.0, 180.0, 90.0))
            if inside_rect(box):
                out.append(copy)
        return out


    # --- objects on their way (KnnState.ghosts) ------------------------------------------
    def send_asks(self, tenant: str, state: KnnState, pipe: Any) -> None:
        """Ask the new owners of listed objects that left for their partitions to answer
        once they hold them."""
        asks = state.take_asks()
        ex = self.ex
        if not asks or ex.index is None:
            return
        index = ex.index
        owners = index.worker_of_points(np.asarray([a[2] for a in asks], dtype=np.float64),
                                        np.asarray([a[3] for a in asks], dtype=np.float64))
        rows: dict[str, list[tuple[str, float, float, float]]] = {}
        for ask, w in zip(asks, owners.tolist(), strict=True):
            dest = index.workers[w] if w >= 0 else ex.id
            if dest == ex.id:  # ours again under the newest plan: nothing to wait for
                state.arrived(ask[0], ask[1])
            else:
                rows.setdefault(dest, []).append(ask)
        for dest, rs in rows.items():
            self._send_ask(dest, tenant, rs, ex.id, pipe)

    def on_ask(self, msg: wire.KnnAsk, pipe: Any, owner: str | None = None) -> None:
        """Answer for the records we (or `owner`, adopted) hold under the newest plan: every
        entry before this one was processed. Forward the rest to their owners."""
        ex = self.ex
        ex.load_plan()
        assert ex.index is not None
        index = ex.index
        owner = owner or ex.id
        owners = index.worker_of_points(np.asarray(msg.lon, dtype=np.float64),
                                        np.asarray(msg.lat, dtype=np.float64))
        mine_ids: list[str] = []
        mine_ts: list[float] = []
        rows: dict[str, list[tuple[str, float, float, float]]] = {}
        for i, w in enumerate(owners.tolist()):
            dest = index.workers[w] if w >= 0 else owner
            if dest == owner and owner == ex.id:
                mine_ids.append(msg.ids[i])
                mine_ts.append(msg.ts[i])
            else:  # a dead worker's (adopted) rows go to the owner under the new plan
                dest = dest if dest != owner else ex.id
                rows.setdefault(dest, []).append((msg.ids[i], msg.ts[i], msg.lon[i],
                                                  msg.lat[i]))
        if mine_ids:
            pipe.xadd(names.worker_stream(msg.reply_to), {b"m": wire.encode_entry(
                wire.KnnArrived(tenant=msg.tenant, ids=mine_ids, ts=mine_ts))})
        for dest, rs in rows.items():
            self._send_ask(dest, msg.tenant, rs, msg.reply_to, pipe)

    def _send_ask(self, dest: str, tenant: str, rows: list[tuple[str, float, float, float]],
                  reply_to: str, pipe: Any) -> None:
        pipe.xadd(names.worker_stream(dest), {b"m": wire.encode_entry(wire.KnnAsk(
            tenant=tenant, ids=[r[0] for r in rows], ts=[r[1] for r in rows],
            lon=[r[2] for r in rows], lat=[r[3] for r in rows], reply_to=reply_to))})

    def on_arrived(self, msg: wire.KnnArrived, pipe: Any,
                   notify: dict[str, set[str]]) -> None:
        state = self.ex.knn.get(msg.tenant)
        if state is None:
            return
        for oid, ts in zip(msg.ids, msg.ts, strict=True):
            state.arrived(oid, ts)
        changed = state.refresh()
        if changed:
            self.report(msg.tenant, changed, pipe)
            notify.setdefault(msg.tenant, set()).update(s.id for s in changed)


def _merge_could_change(sub: KnnSub, members: tuple[Hashable, ...]) -> bool:
    """Whether a list held alone changed in a way the merge script would act on: its members
    or their order (the merged list is pushed), or a k-th far enough inside the radius that
    the registration shrinks. Distances alone change nothing pushed."""
    if members != sub.reported:
        return True
    return len(sub.local) >= sub.k and sub.local[sub.k - 1][0] * knnreg.SHRINK_AT < sub.radius


def _kind(key: Any) -> int:
    """The kind (workers.knn.MOVING or EVENT) of a neighbour's key (kind, id)."""
    return int(key[0])
