"""SWARM's Coordinator (§4.3.1, Figures 8-10): one leader, elected by a Redis lease, runs the
periodic load-balancing rounds (collect every worker's report, R(S) and C(m), step the decision
pointer of Figure 9, ask the costliest worker mH to shed load to the cheapest mL, next mH when it
cannot; merge adjacent partitions now and then) and serves the admin API's manual requests.

The commands are `wire.Command` messages; the workers do the plan changes themselves
(app/pipeline/control.py).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import secrets
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import orjson
import redis
from sqlalchemy.exc import SQLAlchemyError

from app.core.config import Settings
from app.core.db import make_engine, make_sessionmaker, session_scope
from app.core.redis import db_of, is_cluster, sync_client
from app.geo.balance import Decision, DecisionPointer, mergeable
from app.geo.index import Partition, Plan
from app.models import BalancerRound
from app.pipeline import cluster, names, wire
from app.pipeline.control import PLAN_ACTIVATE_SCRIPT
from app.pipeline.outbox import Relayer
from workers.failover import (
    FAILOVER_SCRIPT,
    FAILOVER_STAGE_SCRIPT,
    FENCE_TAKE_SCRIPT,
    failover_args,
    failover_plan,
    failover_stage_args,
)
from workers.lease import LEASE_SOCKET_TIMEOUT_S, Lease, LostLease

log = logging.getLogger(__name__)

COMMAND_MAXLEN = 10_000  # approximate MAXLEN of a worker's command stream
REPORT_POLL_S = 0.05
REPORT_TTL_S = 3600
REPLY_TTL_S = 60
REQUEST_BLOCK_MAX_S = 0.5  # longest BLPOP on the request list: config and lease are re-read
# merge adjacent partitions every 4th round in which nothing moved, balance_merge_s or more
# after the last merge
MERGE_EVERY = 4
# a worker that caught up more backlog than this share of a round counted it in its R
CATCH_UP_SHARE = 0.2
# a worker's report that came this share of the time since the last round or less after its
# previous one
SHORT_WINDOW = 0.5
MIN_PERIOD_S = 0.1
FAILOVER_CHECK_S = 0.5  # how often the leader looks for dead workers that own partitions
STOP_GRACE_S = 2.0  # after SIGTERM, how much longer to wait for a reply to a command sent

# The leader's writes that others act on are fenced by the lease: a coordinator that lost it
# (paused, partitioned) cannot start a round, send a command or overwrite the state. nil = lost.
FENCED_INCR = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return false end
return redis.call('INCR', KEYS[2])
"""
FENCED_XADD = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return false end
return redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', 'm', ARGV[3])
"""
FENCED_SET = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return false end
return redis.call('SET', KEYS[2], ARGV[2])
"""


@dataclass(frozen=True)
class BalancerConfig:
    """`BALANCER_CONFIG` (the admin API's PUT /v1/admin/balancer changes it live)."""

    enabled: bool
    period_s: float
    beta: int

    @property
    def lease_ttl_s(self) -> float:
        return max(1.0, self.period_s)

    @property
    def report_timeout_s(self) -> float:
        return min(max(1.0, self.period_s / 2), 10.0)

    @property
    def reply_timeout_s(self) -> float:
        return max(5.0, self.period_s)

    def to_json(self) -> bytes:
        return orjson.dumps(dataclasses.asdict(self))


@dataclass
class RoundRecord:
    """One `BalancerRound` row in the making."""

    round: int
    started_at: float
    kind: str  # auto | manual | failover
    stage: str
    decision: str  # nothing | rebalance | skipped | manual | failover
    r_s: float = 0.0
    costs: dict[str, Any] = field(default_factory=dict)
    mh: str | None = None
    ml: str | None = None
    action: str = "none"  # none | move | split | merge | failover
    details: dict[str, Any] = field(default_factory=dict)
    plan_version: int | None = None
    duration_ms: float = 0.0


def _loads(raw: bytes | str | None) -> Any:
    if raw is None:
        return None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None


def _number(v: object) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def _recorded(reply: wire.CommandReply | None) -> dict[str, Any]:
    """A worker's reply as the round's record keeps it (JSON)."""
    if reply is None:
        reply = wire.CommandReply(ok=False, error="timeout")
    out: dict[str, Any] = msgspec.to_builtins(reply)
    return out


class Coordinator:
    """SWARM's Coordinator process: `run()` until SIGTERM (warm) or a second signal (cold)."""

    def __init__(self, settings: Settings, redis_url: str) -> None:
        self.settings = settings
        self.id = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        # redis-py's reply types are unions of every RESP shape; treat replies as Any here.
        self.redis: Any = sync_client(redis_url, socket_timeout=30)
        self.stop = threading.Event()
        self.lease = Lease(sync_client(redis_url, socket_timeout=LEASE_SOCKET_TIMEOUT_S),
                           self.id, self.stop)
        self._incr = self.redis.register_script(FENCED_INCR)
        self._xadd = self.redis.register_script(FENCED_XADD)
        self._set = self.redis.register_script(FENCED_SET)
        self._allocate = self.redis.register_script(cluster.ALLOCATE_IDS_SCRIPT)
        self._failover = self.redis.register_script(FAILOVER_SCRIPT)
        # with outboxes: a plan change a worker staged and did not relay (it died) is
        # relayed here before a failover, which it would stop (app.pipeline.control)
        self.cluster = is_cluster(redis_url)
        self.relayer = Relayer(self.redis, (PLAN_ACTIVATE_SCRIPT, FENCE_TAKE_SCRIPT)) if (
            settings.redis_outbox or self.cluster) else None
        self._failover_stage = self.redis.register_script(FAILOVER_STAGE_SCRIPT)
        self.last_failover_check = 0.0
        self.engine = make_engine(settings)
        self.sessions = make_sessionmaker(self.engine)
        self.defaults = BalancerConfig(enabled=settings.partitioning == "swarm",
                                       period_s=settings.balance_period_s,
                                       beta=settings.balance_beta)
        self.config = self.defaults
        self._bad_config: bytes | None = None
        # Leader state, (re)loaded from BALANCER_STATE on every acquisition of the lease.
        self.term = 0
        self.pointer = DecisionPointer(beta=settings.balance_beta)
        self.state: dict[str, Any] = {}
        self.last_round_at = 0.0
        self.quiet_rounds = 0
        self.merged_at = time.time()
        self.signals = 0
        self.stopped_at = 0.0

    # --- lifecycle -----------------------------------------------------------------------
    def run(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        try:
            self.config = self.read_config()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.warning("coordinator %s: redis unavailable (%s)", self.id, exc)
        self.lease.ttl_s = self.config.lease_ttl_s
        self.lease.start()
        log.info("coordinator %s started (partitioning=%s); standing by for the lease",
                 self.id, self.settings.partitioning)
        try:
            while not self.stop.is_set():
                try:
                    self.step()
                except LostLease as exc:
                    log.warning("coordinator %s stopped acting: %s", self.id, exc)
                    self.term = 0  # a round may have been cut short: reload the saved state
                except (redis.ConnectionError, redis.TimeoutError) as exc:
                    log.warning("coordinator %s: redis unavailable (%s); retrying", self.id, exc)
                    self.term = 0
                    self.stop.wait(0.5)
        finally:
            self.stop.set()
            self.lease.join()
            self.lease.release()
            self.engine.dispose()
            log.info("coordinator %s stopped", self.id)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.signals += 1
        if self.signals > 1:  # second signal: cold stop (the lease expires by itself)
            os._exit(1)
        self.stopped_at = time.monotonic()
        self.stop.set()

    def step(self) -> None:
        """One turn of the loop: a round when due, else wait for an admin request."""
        cfg = self.config = self.read_config()
        self.lease.ttl_s = cfg.lease_ttl_s
        if not self.lease.held():
            self.stop.wait(min(0.1, cfg.lease_ttl_s / 4))
            return
        if self.lease.term != self.term:
            self.take_over(cfg)
        self.pointer.beta = cfg.beta
        now = time.time()
        if now - self.last_failover_check >= FAILOVER_CHECK_S:
            self.last_failover_check = now
            self.fail_over()
        due_at = self.last_round_at + cfg.period_s
        if cfg.enabled and now >= due_at:
            self.run_round("auto", cfg)
            return
        block = min(REQUEST_BLOCK_MAX_S, due_at - now) if cfg.enabled else REQUEST_BLOCK_MAX_S
        item = self.redis.blpop([names.REQUESTS_KEY], timeout=max(0.01, block))
        if item is not None:
            self.handle_request(item[1], cfg)

    def refused(self) -> LostLease:
        """A fenced write found another owner in the lease key: stop acting now (the lease
        thread tries to acquire it again as a standby)."""
        self.lease.lose("a fenced write found another coordinator's id")
        return LostLease("another coordinator holds the lease")

    def check(self) -> None:
        if not self.lease.held() or self.lease.term != self.term:
            raise LostLease("the lease lapsed")

    def take_over(self, cfg: BalancerConfig) -> None:
        """Become the acting leader: continue from the persisted pointer and schedule."""
        self.term = self.lease.term
        state = _loads(self.redis.get(names.BALANCER_STATE))
        self.state = state if isinstance(state, dict) else {}
        try:
            self.pointer = DecisionPointer.from_dict(self.state["pointer"])
        except (KeyError, TypeError, ValueError):
            self.pointer = DecisionPointer(beta=cfg.beta)
        self.pointer.beta = cfg.beta
        now = time.time()
        last = _number(self.state.get("last_round_at"))
        # No state yet: the first round one period from now (workers are still starting).
        self.last_round_at = now if last is None or last > now else last
        quiet = self.state.get("quiet_rounds")
        self.quiet_rounds = quiet if isinstance(quiet, int) else 0
        merged = _number(self.state.get("merged_at"))
        self.merged_at = now if merged is None or merged > now else merged
        self.state["leader"] = self.id
        self.save_state()
        log.info("coordinator %s is the leader (last round %s, stage %s, decision %s)", self.id,
                 self.state.get("round"), self.pointer.stage.name, self.pointer.decision.value)

    # --- config and state ----------------------------------------------------------------
    def read_config(self) -> BalancerConfig:
        raw = self.redis.get(names.BALANCER_CONFIG)
        if raw is None:
            self.redis.set(names.BALANCER_CONFIG, self.defaults.to_json(), nx=True)
            raw = self.redis.get(names.BALANCER_CONFIG)
            if raw is None:
                return self.defaults
        d = _loads(raw)
        try:
            if not isinstance(d, dict):
                raise ValueError("not a JSON object")
            enabled = d.get("enabled", self.defaults.enabled)
            period = _number(d.get("period_s", self.defaults.period_s))
            beta = d.get("beta", self.defaults.beta)
            if not isinstance(enabled, bool):
                raise ValueError("enabled must be true or false")
            if period is None or period <= 0:
                raise ValueError("period_s must be a positive number")
            if isinstance(beta, bool) or not isinstance(beta, int) or beta < 1:
                raise ValueError("beta must be an integer >= 1")
        except ValueError as exc:
            if raw != self._bad_config:
                log.warning("ignoring invalid %s (%s): %r", names.BALANCER_CONFIG, exc, raw)
                self._bad_config = raw
            return self.config
        return BalancerConfig(enabled=enabled, period_s=max(MIN_PERIOD_S, period), beta=beta)

    def save_state(self) -> None:
        self.state["pointer"] = self.pointer.to_dict()
        self.state["stage"] = self.pointer.stage.name
        self.state["leader"] = self.id
        self.state["last_round_at"] = self.last_round_at
        self.state["quiet_rounds"] = self.quiet_rounds
        self.state["merged_at"] = self.merged_at
        done = self._set(keys=[names.LEASE_KEY, names.BALANCER_STATE],
                         args=[self.id, orjson.dumps(self.state)])
        if done is None:
            raise self.refused()

    # --- redis helpers ---------------------------------------------------------------------
    def live_workers(self, now: float | None = None) -> list[str]:
        now = time.time() if now is None else now
        return cluster.live_workers(self.redis.hgetall(names.WORKERS_KEY).items(), now,
                                    self.settings.worker_dead_after_s)

    def plan(self) -> Plan | None:
        return cluster.read_plan(self.redis)

    def plan_version(self) -> int | None:
        d = _loads(self.redis.get(names.PLAN_KEY))
        return int(d["version"]) if isinstance(d, dict) and "version" in d else None

    def next_round(self) -> int:
        n = self._incr(keys=[names.LEASE_KEY, names.ROUND_SEQ], args=[self.id])
        if n is None:
            raise self.refused()
        return int(n)

    def new_ids(self, plan: Plan, count: int) -> list[str]:
        last = int(self._allocate(keys=[names.PART_SEQ],
                                  args=[cluster.part_seq_floor(plan), count]))
        return cluster.partition_ids(last, count)

    def send(self, worker: str, msg: wire.Command) -> None:
        """Append a command for `worker`, fenced by the lease: in the same script on one
        Redis; on a cluster the worker checks the lease when it reads the command."""
        self.check()
        msg.leader = self.id
        stream = names.command_stream(worker)
        if self.cluster:
            self.redis.xadd(stream, {b"m": wire.encode_command(msg)}, maxlen=COMMAND_MAXLEN,
                            approximate=True)
            return
        entry = self._xadd(keys=[names.LEASE_KEY, stream],
                           args=[self.id, COMMAND_MAXLEN, wire.encode_command(msg)])
        if entry is None:
            raise self.refused()

    def wait_reply(self, token: str, timeout: float) -> wire.CommandReply | None:
        """The worker's reply, or None after `timeout` s (short BLPOPs: the lease is checked
        in between)."""
        deadline = time.monotonic() + timeout
        while True:
            if self.stop.is_set():  # warm stop: a short grace for the answer, not the timeout
                deadline = min(deadline, self.stopped_at + STOP_GRACE_S)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            item = self.redis.blpop([names.reply_key(token)],
                                    timeout=max(0.01, min(0.5, remaining)))
            if item is not None:
                reply = wire.decode_list_message(item[1], wire.CommandReply)
                return reply or wire.CommandReply(ok=False, error="unreadable reply")
            self.check()

    def command(self, worker: str, msg: wire.Command, cfg: BalancerConfig
                ) -> wire.CommandReply | None:
        """Send a command that wants a reply; its deadline and reply token are added here."""
        token = secrets.token_hex(8)
        msg = msgspec.structs.replace(msg, deadline=time.time() + cfg.report_timeout_s,
                                      reply=token)
        self.send(worker, msg)
        return self.wait_reply(token, cfg.reply_timeout_s)

    def collect_reports(self, n: int, live: list[str], timeout: float
                        ) -> dict[str, wire.LoadReport]:
        key = names.report_key(n)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.stop.is_set():
            if self.redis.hlen(key) >= len(live):
                got = {k.decode() for k in self.redis.hkeys(key)}
                if got.issuperset(live):
                    break
            self.check()
            time.sleep(REPORT_POLL_S)
        raw = self.redis.hgetall(key)
        self.redis.expire(key, REPORT_TTL_S)
        reports: dict[str, wire.LoadReport] = {}
        for k, v in raw.items():
            rep = wire.decode_report(v)
            wid = k.decode()
            if wid in live and rep is not None and math.isfinite(rep.num + rep.r_m):
                reports[wid] = rep
        return reports

    # --- failover (workers.failover) -------------------------------------------------------
    def fail_over(self) -> None:
        """Hand the partitions of a worker that stopped beating (and was seen beating once:
        one still starting is not dead) to the live workers, with an adopter for its stream.
        One dead worker per call; the next call sees the plan this one published."""
        if self.settings.partitioning == "replicated":
            return  # no partitions: objects are spread over every worker by id
        if self.relayer is not None and self.relayer.relay_all(names.CONTROL_OUTBOX):
            log.info("coordinator %s relayed a staged plan change", self.id)
        # with outboxes, the workers' starts are read first: a worker that starts after this
        # read (and before the failover is staged) makes the staging fail
        starts = self.redis.hgetall(names.WORKER_STARTS) if self.relayer is not None else {}
        plan = self.plan()
        if plan is None:
            return
        now = time.time()
        beats = self.redis.hgetall(names.WORKERS_KEY)
        live = cluster.live_workers(beats.items(), now, self.settings.worker_dead_after_s)
        seen = {k.decode() if isinstance(k, bytes) else k for k in beats}
        dead = sorted({p.worker for p in plan.partitions} & seen - set(live))
        if not live or not dead:
            return
        w = dead[0]
        self.check()
        started = time.monotonic()
        fence = self.redis.get(names.fence_key(w))
        count = sum(p.worker == w for p in plan.partitions)
        new, given = failover_plan(plan, w, live, iter(self.new_ids(plan, count)))
        if self.relayer is None:
            keys, args = failover_args(names.LEASE_KEY, self.id, plan, new, fence, w, given, now,
                                       db_of(self.redis))
            applied = bool(int(self._failover(keys=keys, args=args)))
        else:
            keys, args = failover_stage_args(names.LEASE_KEY, self.id, plan, new, fence,
                                             starts.get(w.encode()), w, given, now,
                                             db_of(self.redis))
            applied = bool(self._failover_stage(keys=keys, args=args))
            if applied:
                self.relayer.relay_all(names.CONTROL_OUTBOX)
        if not applied:
            log.info("failover of %s not applied: the plan, its fence, its starts or the lease "
                     "changed", w)
            return
        adopter = next(iter(given))
        rec = RoundRecord(round=self.next_round(), started_at=now, kind="failover",
                          stage=self.pointer.stage.name, decision="failover", mh=w, ml=adopter,
                          action="failover", plan_version=new.version,
                          details={"leader": self.id, "dead": w, "adopter": adopter,
                                   "given": given,
                                   "dead_after_s": self.settings.worker_dead_after_s})
        rec.duration_ms = (time.monotonic() - started) * 1000
        self.record(rec)
        log.warning("worker %s has no heartbeat for %g s: its %d partitions went to %s (plan "
                    "%d); %s processes its stream until it returns", w,
                    self.settings.worker_dead_after_s, count, given, new.version, adopter)

    # --- rounds (§4.3.1) -------------------------------------------------------------------
    def run_round(self, kind: str, cfg: BalancerConfig) -> RoundRecord:
        started = time.time()
        t0 = time.monotonic()
        n = self.next_round()
        since_last = started - self.last_round_at  # the span the round's counts should cover
        self.last_round_at = started
        rec = RoundRecord(round=n, started_at=started, kind=kind,
                          stage=self.pointer.stage.name, decision="skipped",
                          details={"leader": self.id})
        live = self.live_workers(started)
        if not live:
            rec.details["reason"] = "no live workers"
        else:
            for w in live:
                self.send(w, wire.RoundCommand(round=n))
            reports = self.collect_reports(n, live, cfg.report_timeout_s)
            missing = [w for w in live if w not in reports]
            unsettled = self.unsettled(reports, since_last)
            if missing:
                rec.details["missing"] = missing
                if self.stop.is_set():
                    rec.details["reason"] = "coordinator stopping"
            elif unsettled:
                rec.details["reason"] = unsettled
            else:
                self.decide(rec, reports, cfg)
        self.check()
        rec.plan_version = self.plan_version()
        rec.duration_ms = (time.monotonic() - t0) * 1000
        self.state["round"] = n
        self.state["last_decision"] = rec.decision
        self.save_state()
        self.record(rec)
        log.info("round %d (%s): R(S)=%.6g decision=%s stage=%s action=%s mH=%s mL=%s "
                 "plan v%s, %.0f ms", n, kind, rec.r_s, rec.decision, rec.stage, rec.action,
                 rec.mh, rec.ml, rec.plan_version, rec.duration_ms)
        return rec

    def unsettled(self, reports: dict[str, wire.LoadReport], span_s: float) -> str | None:
        """Why this round's counts do not measure the load of one layout (the round is then
        skipped, as one with a missing report), or None. Each worker counts from its
        previous report:
        - cells that changed workers since the last round's reports (a move or split, the
          last round's own or an admin's, or a failover) were counted part of the round on
          one layout and part on the other: the giver's count stops, the taker's starts late;
        - a worker that read the round's command less than SHORT_WINDOW of `span_s` (the time
          since the last round began) after its previous one (a busy worker reads the
          commands that waited together) counted almost nothing, and looks idle. (Against
          the span, not the period: a manual round soon after the last is no short round.)
        - a worker whose backlog shrank by more than CATCH_UP_SHARE of its round (after a
          hand-off held its stream, or a burst) counted what had waited as well: its R is
          the rate it caught up at, not the rate of arrivals.
        Decisions on such counts move load back and forth, or onto a worker already behind.
        A merge keeps every cell on its worker: not a change."""
        plan = self.plan()
        owners = plan.ownership() if plan is not None else None
        before = self.state.get("owners")
        self.state["owners"] = owners
        if before is not None and owners is not None and before != owners:
            return ("cells changed workers since the last round's reports: these count the "
                    "load of neither layout")
        short, caught = [], []
        for w, rep in sorted(reports.items()):
            if not rep.since:
                continue  # its first report: counted since it started
            window = rep.at - rep.since
            shrank = rep.behind_since_s - rep.behind_s
            if window < SHORT_WINDOW * span_s:
                short.append(f"{w} counted {max(0.0, window):.1f} s")
            elif shrank > CATCH_UP_SHARE * window:
                caught.append(f"{w} caught up {shrank:.1f} s of backlog in {window:.1f} s")
        if short:
            return (f"counts of a short round ({span_s:.1f} s since the last): "
                    + "; ".join(short))
        if caught:
            return "counts inflated by a backlog: " + "; ".join(caught)
        return None

    def decide(self, rec: RoundRecord, reports: dict[str, wire.LoadReport],
               cfg: BalancerConfig) -> None:
        """R(S) (Eqn 4), C(m) = Num(C(m)) / R(S) (Eqn 7), the pointer's step and its action."""
        r_s = sum(rep.r_m for rep in reports.values())
        costs = {w: rep.num / r_s if r_s > 0 else 0.0
                 for w, rep in sorted(reports.items())}
        decision = self.pointer.step(r_s)
        rec.r_s, rec.costs = r_s, dict(costs)
        rec.decision, rec.stage = decision.value, self.pointer.stage.name
        rec.details["received"] = {w: reports[w].r_m for w in costs}
        if self.pointer.forced:
            rec.details["forced"] = True
        self.state.update(r_s=r_s, costs=costs, reports_at=time.time())
        self._note_gap(rec.round, costs)
        if self.settings.partitioning != "swarm":
            rec.details["reason"] = f"partitioning={self.settings.partitioning}"
            return
        if decision is Decision.REBALANCE:
            self.rebalance(rec, costs, r_s, cfg)
        if rec.action == "none":
            self.quiet_rounds += 1
            now = time.time()
            if (self.quiet_rounds >= MERGE_EVERY
                    and now - self.merged_at >= self.settings.balance_merge_s):
                self.quiet_rounds = 0
                self.merged_at = now
                self.merge(rec, cfg)

    def _note_gap(self, round_no: int, costs: dict[str, float]) -> None:
        """In how many decided rounds in a row, this one included, some worker cost more than
        `balance_min_gap` above the cheapest (`state["over_gap"]`: [round, rounds]); a
        skipped round in between starts the count again (the layout may have changed)."""
        over = len(costs) >= 2 and max(costs.values()) > min(costs.values()) * (
            1 + self.settings.balance_min_gap)
        last = self.state.get("over_gap") or [0, 0]
        rounds = (last[1] + 1 if last[0] == round_no - 1 else 1) if over else 0
        self.state["over_gap"] = [round_no, rounds]

    def rebalance(self, rec: RoundRecord, costs: dict[str, float], r_s: float,
                  cfg: BalancerConfig) -> None:
        """Figure 10: mL the cheapest worker; mH the costliest, then the next costliest while
        the one asked finds no feasible reduction (or refuses, or does not answer). Only
        workers costing more than `balance_min_gap` above mL are asked: closer costs differ
        by little more than their counts' noise, and a move pauses both workers' streams."""
        if len(costs) < 2:
            rec.details["reason"] = "fewer than two workers"
            return
        ml = min(costs, key=lambda w: (costs[w], w))
        rec.ml = ml
        gap = self.settings.balance_min_gap
        bar = costs[ml] * (1 + gap)  # only workers costing more are asked
        rounds = self.state["over_gap"][1]  # (`_note_gap`: this round's included)
        if not rounds:
            rec.details["reason"] = (f"costs within {gap:.0%} of each other: no move is worth "
                                     "the pause it makes")
            return
        if rounds < self.settings.balance_confirm_rounds:
            rec.details["reason"] = (
                f"costs more than {gap:.0%} apart in {rounds} round(s) in a row: a move waits "
                f"for {self.settings.balance_confirm_rounds} (one round's costs may be noise)")
            return
        attempts: list[dict[str, Any]] = []
        rec.details["attempts"] = attempts
        for mh in sorted((w for w in costs if w != ml), key=lambda w: (-costs[w], w)):
            if costs[mh] <= bar or self.stop.is_set():
                break
            plan = self.plan()
            if plan is None:
                rec.details["reason"] = "no plan"
                break
            owned = sum(p.worker == mh for p in plan.partitions)
            if owned == 0:
                attempts.append({"mh": mh, "reply": {"ok": False, "error": "no partitions"}})
                continue
            rec.mh = rec.mh or mh
            ids = self.new_ids(plan, owned + 2)
            reply = self.command(mh, wire.ReduceCommand(
                round=rec.round, to=ml, cost_ml=costs[ml], r_s=r_s, ids=ids,
                plan_version=plan.version), cfg)
            attempts.append({"mh": mh, "ids": ids, "reply": _recorded(reply)})
            if reply is not None and reply.ok and reply.action in ("move", "split"):
                rec.mh, rec.action = mh, reply.action
                return

    def merge(self, rec: RoundRecord, cfg: BalancerConfig) -> None:
        """§4.3.1's occasional merge: each worker with adjacent partitions forming a rectangle
        merges them, one worker at a time (each merge is a new plan version)."""
        plan = self.plan()
        if plan is None:
            return
        workers = sorted({_worker_of(plan.partitions, a) for a, _b in mergeable(plan.partitions)})
        merges: list[dict[str, Any]] = []
        for w in workers:
            plan = self.plan()
            if plan is None or self.stop.is_set():
                break
            mine = [p for p in plan.partitions if p.worker == w]
            if not mergeable(mine):
                continue
            ids = self.new_ids(plan, len(mine) - 1)
            reply = self.command(w, wire.MergeCommand(ids=ids, plan_version=plan.version), cfg)
            merges.append({"worker": w, "ids": ids, "reply": _recorded(reply)})
            if reply is not None and reply.ok and reply.action != "none":
                rec.action = "merge"
        if merges:
            rec.details["merges"] = merges

    def record(self, rec: RoundRecord) -> None:
        try:
            with session_scope(self.sessions) as session:
                session.add(BalancerRound(**dataclasses.asdict(rec)))
        except SQLAlchemyError:
            log.exception("could not record balancer round %d", rec.round)

    # --- admin requests (control.py: REQUESTS_KEY) ------------------------------------------
    def handle_request(self, raw: bytes, cfg: BalancerConfig) -> None:
        try:
            req = msgspec.json.decode(raw, type=wire.AdminRequest)
        except msgspec.DecodeError as exc:
            # A request that names its reply list is answered, with what is wrong in it.
            loose = _loads(raw)
            token = loose.get("id") if isinstance(loose, dict) else None
            if isinstance(token, str) and token:
                self.reply(token, wire.AdminReply(status=422, error=f"invalid request: {exc}"))
            else:
                log.warning("dropping an unreadable admin request: %r", raw)
            return
        if not req.id:
            log.warning("dropping an admin request without a reply token: %r", raw)
            return
        if not self.lease.held() or self.lease.term != self.term:
            self.redis.lpush(names.REQUESTS_KEY, raw)  # for the next leader
            raise LostLease("the lease lapsed")
        try:
            reply = self.serve(req, cfg)
        except LostLease:
            self.reply(req.id, wire.AdminReply(status=503, error="the coordinator lost its "
                                                                 "lease; retry"))
            raise
        except Exception as exc:
            try:  # the API is waiting: answer before the error ends this turn (or the process)
                self.reply(req.id, wire.AdminReply(status=503,
                                                   error=f"coordinator error: {exc}"))
            except redis.RedisError:
                pass
            raise
        self.reply(req.id, reply)

    def reply(self, token: str, body: wire.AdminReply) -> None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.rpush(names.reply_key(token), wire.encode_json(body))
        pipe.expire(names.reply_key(token), REPLY_TTL_S)
        pipe.execute()

    def serve(self, req: wire.AdminRequest, cfg: BalancerConfig) -> wire.AdminReply:
        kind = req.kind
        if kind == "round":
            rec = self.run_round("manual", cfg)
            return wire.AdminReply(status=202, round=rec.round, action=rec.action,
                                   details=rec.details)
        if kind not in ("move", "split"):
            return wire.AdminReply(status=422, error=f"unknown request kind {kind!r}")
        if self.settings.partitioning == "replicated":
            return wire.AdminReply(status=409, error="partitions cannot be moved or split with "
                                                     "partitioning=replicated")
        plan = self.plan()
        pid = req.partition
        part = next((p for p in plan.partitions if p.id == pid), None) if plan else None
        if plan is None or part is None:
            return wire.AdminReply(status=404, error=f"partition {pid} not found")
        live = self.live_workers()
        owner = part.worker
        if kind == "move":
            to = req.to
            if to is None or to not in live:
                return wire.AdminReply(status=404, error=f"worker {to} not found or not alive")
            if to == owner:
                return wire.AdminReply(status=409,
                                       error=f"partition {pid} already belongs to {to}")
        else:
            error = _split_error(part, req.axis, req.at)
            if error:
                return wire.AdminReply(status=422, error=error)
        if owner not in live:
            return wire.AdminReply(status=503,
                                   error=f"worker {owner} (owner of {pid}) is not alive")
        started = time.time()
        t0 = time.monotonic()
        n = self.next_round()
        if kind == "move":
            assert req.to is not None
            msg: wire.MoveCommand | wire.SplitCommand = wire.MoveCommand(
                partitions=[part.id], to=req.to, ids=self.new_ids(plan, 1),
                plan_version=plan.version)
        else:
            assert req.axis is not None and req.at is not None
            msg = wire.SplitCommand(partition=part.id, axis=req.axis, at=req.at,
                                    moved=None, to=owner, ids=self.new_ids(plan, 2),
                                    plan_version=plan.version)
        reply = self.command(owner, msg, cfg)
        give_up = time.monotonic() + cfg.reply_timeout_s
        while (reply is not None and not reply.ok and "not processed yet" in (reply.error or "")
               and time.monotonic() < give_up):
            time.sleep(0.05)  # the owner is still reading a handoff to it: nothing was done
            reply = self.command(owner, msg, cfg)
        rec = RoundRecord(round=n, started_at=started, kind="manual",
                          stage=self.pointer.stage.name, decision="manual",
                          r_s=float(self.state.get("r_s") or 0.0),
                          costs=dict(self.state.get("costs") or {}), mh=owner,
                          ml=msg.to if kind == "move" else None,
                          details={"leader": self.id, "request": msgspec.to_builtins(req),
                                   "command": {k: v for k, v in msgspec.to_builtins(msg).items()
                                               if k not in ("reply", "deadline")},
                                   "reply": _recorded(reply)})
        if reply is None:
            out = wire.AdminReply(status=503, error=f"worker {owner} did not answer within "
                                                    f"{cfg.reply_timeout_s:g} s")
        elif reply.ok:
            rec.action = reply.action
            out = wire.AdminReply(status=202, round=n, action=rec.action, details=reply.details)
        else:
            out = wire.AdminReply(status=409, error=reply.error or "refused")
        self.check()
        rec.plan_version = self.plan_version()
        rec.duration_ms = (time.monotonic() - t0) * 1000
        self.state["round"] = n
        self.save_state()
        self.record(rec)
        log.info("round %d (manual %s %s): status %s action=%s plan v%s, %.0f ms", n, kind,
                 pid, out.status, rec.action, rec.plan_version, rec.duration_ms)
        return out


def _worker_of(partitions: list[Partition], pid: str) -> str:
    return next(p.worker for p in partitions if p.id == pid)


def _split_error(part: Partition, axis: object, at: object) -> str | None:
    """Why a manual split of `part` is invalid (the low half is cells <= at), or None."""
    if axis not in ("x", "y"):
        return "axis must be 'x' or 'y'"
    if isinstance(at, bool) or not isinstance(at, int):
        return "at must be an integer grid cell"
    lo, hi = (part.x0, part.x1) if axis == "x" else (part.y0, part.y1)
    if lo == hi:
        return f"partition {part.id} is one cell wide along {axis}; it cannot be split there"
    if not lo <= at <= hi - 1:
        return f"at must lie in {lo}..{hi - 1} to split {part.id} along {axis}"
    return None


def run_coordinator(settings: Settings, redis_url: str) -> None:
    Coordinator(settings, redis_url).run()
