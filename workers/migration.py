"""Partition migration, SWARM §5.1: the executor's side of a move, split or merge.

mH carries out a plan change itself: one Lua script (`PLAN_CAS_SCRIPT`) appends a handoff
(the partitions' subscriptions, window statistics and moving objects) to each receiver's
stream and publishes the next plan version, only if the stored plan is still the version mH
computed from (ownership is fenced by plan version); with outboxes, the same change is staged
and relayed (`app.pipeline.control`). mL reads the handoff before anything
routed to it under the new plan; entries still routed to mH under an older plan are
forwarded unprocessed (`reroute`), each record to the owner of its new position and each
`exit` decision to the owner of its previous one, so every match is decided exactly once.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from app.geo import balance
from app.geo.index import GlobalIndex, Partition, Plan
from app.pipeline import knnreg, names, wire
from app.pipeline.router import targets_for_spec
from workers.decide import known
from workers.knn import MOVING, KnnSub
from workers.window import keyword_set

if TYPE_CHECKING:
    from workers.executor import Executor

log = logging.getLogger(__name__)


PLAN_WAIT_S = 30.0  # how long a handoff may wait for its staged plan to become active

BalanceCommand = wire.ReduceCommand | wire.MoveCommand | wire.SplitCommand | wire.MergeCommand


def done(action: str, details: dict[str, Any]) -> wire.CommandReply:
    """The reply to a command carried out by publishing plan `details["version"]`."""
    return wire.CommandReply(ok=True, action=action, version=details["version"],
                             details=details)


class CommandRefused(Exception):
    """A balancing command that is stale (plan changed, deadline passed) or invalid."""


class Migration:
    """Moves, splits and merges of one executor's partitions, and the handoffs it receives."""

    def __init__(self, executor: Executor) -> None:
        self.ex = executor

    def reroute(self, msg: wire.ObjectBatch, pipe: Any, owner: str | None = None
                ) -> wire.ObjectBatch | None:
        """An entry routed with an older plan to `owner` (this worker unless it adopted a dead
        worker's stream): rows whose new position is owned by another worker now go there
        unprocessed, and each exit decision goes to the owner of the previous position, so
        each record is decided exactly once even across a move. Returns what stays with
        `owner` (None when nothing does)."""
        ex = self.ex
        ex.load_plan()  # forward with the newest plan we can see
        assert ex.index is not None
        index = ex.index
        owner = owner or ex.id
        me = index.workers.index(owner) if owner in index.workers else -1
        n = len(msg)
        new_w = index.worker_of_points(np.asarray(msg.lon, dtype=np.float64),
                                       np.asarray(msg.lat, dtype=np.float64))
        xo = np.asarray(msg.exit_only, dtype=bool)
        dx = np.asarray(msg.decide_exit, dtype=bool)
        prev_w = np.full(n, -1, dtype=np.int64)
        need = np.flatnonzero(xo | dx)
        if need.size:
            prev = [known(msg.prev[i]) for i in need.tolist()]
            prev_w[need] = index.worker_of_points(
                np.asarray([p[0] for p in prev], dtype=np.float64),
                np.asarray([p[1] for p in prev], dtype=np.float64))
        if ((new_w[~xo] == me).all() and (prev_w[xo] == me).all()
                and (prev_w[dx & ~xo] == me).all()):
            return msg
        dest: dict[int, list[tuple[int, bool, bool]]] = {}
        for i in range(n):
            if xo[i]:
                dest.setdefault(int(prev_w[i]), []).append((i, True, True))
            elif dx[i] and prev_w[i] != new_w[i]:
                dest.setdefault(int(new_w[i]), []).append((i, False, False))
                dest.setdefault(int(prev_w[i]), []).append((i, True, True))
            else:
                dest.setdefault(int(new_w[i]), []).append((i, False, bool(dx[i])))
        local = None
        for w, rows in dest.items():
            sub = msg.take([i for i, _, _ in rows])
            sub.exit_only = [x for _, x, _ in rows]
            sub.decide_exit = [d for _, _, d in rows]
            sub.plan_version = index.version
            if w == me:
                local = sub
            else:
                pipe.xadd(names.worker_stream(index.workers[w]), {b"m": wire.encode_entry(sub)})
                ex.forwarded += len(rows)
        return local

    def forward_subs(self, subs: list[wire.SubscriptionCopy], pipe: Any,
                     owner: str | None = None, since_version: int = 0) -> None:
        """Subscriptions routed with an older plan (`since_version`) to `owner` (this worker
        unless adopted): also send them to the other workers that own their regions now
        (adding is idempotent; deleted ids are tombstoned). kNN registrations go to the
        owners within their radius under every newer plan (`KnnRegistry.forward`)."""
        ex = self.ex
        ex.load_plan()
        assert ex.index is not None
        owner = owner or ex.id
        fwd: dict[str, list[wire.SubscriptionCopy]] = {}
        for m in subs:
            if m.id in ex.tombstones:
                continue
            if m.spec["type"] == "knn":
                ex.knnreg.forward(m, since_version, owner, pipe)
                continue
            if m.spec["type"] != "range":
                continue  # keyword subscriptions are on every worker already
            for w in targets_for_spec(ex.index, m.spec):
                if w != owner:
                    fwd.setdefault(w, []).append(m)
        for w, ms in fwd.items():
            pipe.xadd(names.worker_stream(w), {b"m": wire.encode_entry(
                wire.SubsAdded(subs=ms, plan_version=ex.version))})

    def _load_plan_of(self, version: int, what: str) -> None:
        """Load the plan a handoff or takeover was published with (or a newer one). With
        outboxes a handoff is written just before the plan that gives its partitions (a
        staged change, `app.pipeline.control`): its relay is finished here too (its stager
        may have died), and the plan read again."""
        ex = self.ex
        give_up = time.monotonic() + PLAN_WAIT_S
        while True:
            ex.load_plan()
            if ex.version >= version:
                return
            if ex.relayer is None or time.monotonic() > give_up:
                raise RuntimeError(f"{what} for plan {version} but the stored plan is older")
            ex.relay_control()
            time.sleep(0.002)

    def receive_handoff(self, msg: wire.Handoff, pipe: Any,
                         notify: dict[str, set[str]]) -> None:
        """mL's side of a move (§5.1): the partitions' subscriptions, window statistics and
        moving objects, read before anything routed to us under the new plan."""
        started = time.perf_counter()
        ex = self.ex
        self._load_plan_of(msg.plan_version, "handoff")
        ex.awaiting.difference_update(msg.partitions)
        ledger = ex.ledger
        for pid in msg.partitions:
            # seen early in a plan reload: seed it again, now with what the handoff brings
            ledger.stats.pop(pid, None)
        ledger.receive_window(msg.window)
        # The moving objects first: the registrations carried then search once, among them,
        # and report at once (registered first, each would take them as arrivals and report
        # twice).
        for tenant, objs in msg.moving.items():
            state = ex.knn_state(tenant)
            for oid, lon, lat, kws, ts in objs:
                state.upsert_moving(oid, lon, lat, keyword_set(kws), ts)
            changed = state.refresh()
            if changed:
                ex.merge_knn(tenant, changed, pipe)
                notify.setdefault(tenant, set()).update(s.id for s in changed)
        # The merged lists that held the objects handed off waited for us: we hold them now.
        # A registration carried reports with its first list; the others report again.
        token = knnreg.hold_field(msg.plan_version, ex.id)
        holds = set(msg.holds)
        reported = ex.add_subscriptions([m for m in msg.subs if m.id not in holds], pipe)
        reported |= ex.add_subscriptions([m for m in msg.subs if m.id in holds], pipe,
                                         (token,))
        parts = {p.id: p for p in ex.owned()}
        for pid, exported in msg.stats.items():
            if pid in parts:  # else it moved on again meanwhile
                ledger.restore(parts[pid], exported)
        ex.sync_stats()
        for m in msg.subs:
            if m.id in reported:
                notify.setdefault(m.tenant, set()).add(m.id)
        for sid in msg.holds:
            if sid in reported:
                continue
            held = next(((t, st.subs[sid]) for t, st in ex.knn.items() if sid in st.subs), None)
            if held is None:
                pipe.hdel(names.knn_key(sid), token)
            else:
                ex.merge_knn(held[0], [held[1]], pipe, clear=(token,))
                notify.setdefault(held[0], set()).add(sid)
        took = time.perf_counter() - started
        ex.moves.observe("take", took)
        log.info("worker %s received %s from %s (plan %d): %d subscriptions, %d moving "
                 "objects, in %.0f ms", ex.id, msg.partitions, msg.sender, msg.plan_version,
                 len(msg.subs), sum(map(len, msg.moving.values())), took * 1000)

    def receive_takeover(self, msg: wire.Takeover, pipe: Any,
                         notify: dict[str, set[str]]) -> None:
        """A failover gave us partitions of a dead worker (workers.failover): what its handoff
        would have carried is rebuilt from SQL (range subscriptions over them) and the
        latest-position store (moving objects in them); its local kNN lists leave the merged
        lists, which are merged again."""
        started = time.perf_counter()
        ex = self.ex
        self._load_plan_of(msg.plan_version, "takeover")
        ex.sync_stats()
        taken = set(msg.partitions)
        ex.awaiting.difference_update(taken)
        parts = [p for p in ex.owned() if p.id in taken]
        # The dead worker's lists, and the tokens waiting for it, leave every kNN hash
        # first; then the registrations reaching the partitions taken report, once their
        # moving objects are here.
        msgs = ex.sql_subscriptions()
        ex.knnreg.drop_worker([m.id for m in msgs if m.spec["type"] == "knn"], msg.dead, pipe)
        ex.rebuild_positions(parts)
        ex.rebuild_subscriptions(parts, pipe, msgs)
        for tenant, state in ex.knn.items():
            if state.subs:
                ex.merge_knn(tenant, list(state.subs.values()), pipe, force=True)
                notify.setdefault(tenant, set()).update(state.subs)
        took = time.perf_counter() - started
        ex.moves.observe("takeover", took)
        log.info("worker %s took over %s of dead worker %s (plan %d) in %.0f ms", ex.id,
                 msg.partitions, msg.dead, msg.plan_version, took * 1000)

    def transfer(self, new_plan: Plan) -> dict[str, Any]:
        """Apply a plan that changes only this worker's partitions: hand the partitions given
        to other workers off through their streams and publish the plan, atomically and only
        if the stored plan is still the one this change was computed from (fencing)."""
        started = time.perf_counter()
        ex = self.ex
        assert ex.index is not None
        old = ex.index.plan
        old_ids = {p.id for p in old.partitions}
        given = [p for p in new_plan.partitions if p.id not in old_ids and p.worker != ex.id]
        by_worker: dict[str, list[Partition]] = {}
        for p in given:
            by_worker.setdefault(p.worker, []).append(p)
        handoffs: list[tuple[str, bytes]] = []
        holds: list[tuple[str, str, str]] = []
        leaving: list[tuple[str, list[str]]] = []
        carried: dict[str, tuple[str, KnnSub]] = {}  # kNN registrations handed off
        ledger = ex.ledger
        old_rects = {(q.x0, q.y0, q.x1, q.y1): q.id for q in old.partitions
                     if q.worker == ex.id and q.id in ledger.stats}
        taken = ledger.empty_masks()
        grid = new_plan.grid
        for w, parts in by_worker.items():
            def inside_cells(cx: Any, cy: Any, parts: list[Partition] = parts) -> Any:
                m = np.zeros(np.shape(cx), dtype=bool)
                for p in parts:
                    m |= p.contains_cells(cx, cy)
                return m

            def inside(lon: Any, lat: Any, f: Any = inside_cells) -> Any:
                return f(*grid.cells_of(lon, lat))

            def reaches(box: Any, parts: list[Partition] = parts) -> bool:
                rect = grid.cell_range(box)
                return any(p.overlaps(*rect) for p in parts)

            subs = [ex.sub_msgs[sid] for sid, rect in ledger.sub_rect.items()
                    if ex.sub_msgs[sid].spec["type"] == "range"
                    and any(p.overlaps(*rect) for p in parts)]
            win = ledger.export_window(inside_cells, taken)
            mv: dict[str, list[wire.MovingObject]] = {}
            held: set[str] = set()
            for tenant, state in ex.knn.items():
                carried_here = ex.knnreg.handoff(state, reaches)
                subs += carried_here
                carried.update({c.id: (tenant, state.subs[c.id]) for c in carried_here})
                # ghosts (on their way to another worker's partition) are not handed off:
                # they stay here, in the lists that hold them, until their new owner has them
                objs = [o for o in state.objects.moving_in(inside) if o[0] not in state.ghosts]
                if objs:
                    mv[tenant] = objs
                    leaving.append((tenant, [o[0] for o in objs]))
                    # lists holding an object handed off wait for the receiver to take it
                    for o in objs:
                        for sid in state.members.get((MOVING, o[0]), ()):
                            if sid not in held:
                                held.add(sid)
                                holds.append((names.knn_key(sid),
                                              knnreg.hold_field(new_plan.version, w),
                                              str(state.subs[sid].epoch)))
            # A partition moved whole takes its statistics along (R of the last round
            # included); the halves of a split are seeded from the window instead.
            shipped = {p.id: ledger.stats[old_rects[(p.x0, p.y0, p.x1, p.y1)]].export()
                       for p in parts if (p.x0, p.y0, p.x1, p.y1) in old_rects}
            handoffs.append((names.worker_stream(w), wire.encode_entry(wire.Handoff(
                plan_version=new_plan.version, sender=ex.id, partitions=[p.id for p in parts],
                subs=subs, window=win, moving=mv, stats=shipped, holds=sorted(held)))))
        if not ex.change_plan(old.version, new_plan.to_json(), new_plan.version, handoffs,
                              holds):
            raise CommandRefused(f"the plan is no longer version {old.version}")
        ex.set_index(GlobalIndex(new_plan))
        if given:
            ledger.drop_window(taken)
        ex.sync_stats()
        # The registrations that leave go first: the lists that lost the objects handed off
        # are then searched again only where they stay.
        ex.knnreg.leave_unreached(list(carried.values()))
        if leaving:
            pipe = ex.commit_pipe(ex.id)
            notify: dict[str, set[str]] = {}
            for tenant, ids in leaving:
                state = ex.knn[tenant]
                state.drop_moving(ids)
                changed = state.refresh()
                if changed:
                    ex.merge_knn(tenant, changed, pipe)
                    notify.setdefault(tenant, set()).update(s.id for s in changed)
            try:
                ex.knnreg.settle(pipe, pipe.execute())
            finally:
                ex.knnreg.forget(pipe)
            ex.notify([], [], [], notify)
        took = time.perf_counter() - started
        ex.moves.observe("give", took)
        log.info("worker %s published plan %d: gave %s in %.0f ms", ex.id, new_plan.version,
                 {w: [p.id for p in ps] for w, ps in by_worker.items()}, took * 1000)
        return {"version": new_plan.version,
                "given": {w: [p.to_dict() for p in ps] for w, ps in by_worker.items()},
                "partitions": [p.to_dict() for p in new_plan.partitions
                               if p.id not in old_ids]}

    def command(self, cmd: BalanceCommand) -> wire.CommandReply:
        """Carry out a reduce / move / split / merge from the coordinator; what it did."""
        ex = self.ex
        if cmd.deadline is not None and (late := time.time() - cmd.deadline) > 0:
            raise CommandRefused(f"deadline passed: worker {ex.id} reached the command "
                                 f"{late:.1f} s after it (busy with earlier entries); nothing "
                                 "was done, retry")
        ex.load_plan()
        if cmd.plan_version != ex.version:
            raise CommandRefused(f"plan version {cmd.plan_version} is stale "
                                 f"(current {ex.version})")
        if ex.replicated:
            raise CommandRefused("partitioning is replicated: nothing to move")
        if ex.awaiting:  # what they hold is not here yet: it would not be handed on
            raise CommandRefused(f"handoffs of {sorted(ex.awaiting)} to {ex.id} are not "
                                 "processed yet")
        assert ex.index is not None
        plan = ex.index.plan
        mine = {p.id: p for p in ex.owned()}
        ids = iter(cmd.ids)
        if isinstance(cmd, wire.ReduceCommand):
            if cmd.to == ex.id:
                raise CommandRefused("mL is this worker")
            stats = [ex.ledger.stats[pid] for pid in sorted(mine)]
            red = balance.reduce_workload(stats, cmd.cost_ml, cmd.r_s)
            if red is None:
                return wire.CommandReply(ok=True, details={"reason": "no feasible reduction"})
            action = "move" if isinstance(red, balance.MoveSubset) else "split"
            details = self.transfer(balance.apply_reduction(plan, red, cmd.to, ids))
            if isinstance(red, balance.SplitMove):
                details["split"] = {"partition": red.partition_id, **red.split._asdict()}
            else:
                details["moved"] = list(red.partition_ids)
            return done(action, details)
        if isinstance(cmd, wire.MoveCommand):
            missing = [p for p in cmd.partitions if p not in mine]
            if missing:
                raise CommandRefused(f"partitions {missing} are not owned by {ex.id}")
            details = self.transfer(balance.apply_move(plan, cmd.partitions, cmd.to, ids))
            details["moved"] = cmd.partitions
            return done("move", details)
        if isinstance(cmd, wire.SplitCommand):
            pid = cmd.partition
            if pid not in mine:
                raise CommandRefused(f"partition {pid} is not owned by {ex.id}")
            if cmd.moved is None:
                low, high = balance.split_partition(mine[pid], cmd.axis, cmd.at,
                                                    (next(ids), next(ids)))
                parts = []
                for p in plan.partitions:
                    parts.extend([low, high] if p.id == pid else [p])
                new_plan = Plan(version=plan.version + 1, grid=plan.grid, partitions=parts,
                                members=plan.members)
                new_plan.validate()
            else:
                split = balance.Split(cmd.axis, cmd.at, cmd.moved, 0.0)
                new_plan = balance.apply_split(plan, pid, split, cmd.to, ids)
            details = self.transfer(new_plan)
            details["split"] = {"partition": pid, "axis": cmd.axis, "at": cmd.at,
                                "moved": cmd.moved}
            return done("split", details)
        new_plan = balance.apply_merges(plan, ids, worker=ex.id)
        if new_plan is plan:
            return wire.CommandReply(ok=True, details={"reason": "nothing to merge"})
        details = self.transfer(new_plan)
        return done("merge", details)
