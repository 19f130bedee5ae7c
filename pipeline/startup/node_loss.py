"""Nodes lost mid-run (issue 48; not a failed start, `placement.py`): the run stops in one line when a
pool has no node left, and says in one line which nodes it lost when it went on.

Ray restarts an actor whose node died, and with no node left that could hold it the restart waits
forever. `watching_nodes` runs a daemon thread beside
the driver's loop over the stream (public Ray APIs only) that reads `ray.nodes()` every `every_s`
and asks `watch_nodes`, per pool, whether a live node that fits its actor is left. When none has
been for `ray.node_loss_timeout_s` (the grace that lets a node come back or an autoscaler add one)
it interrupts the main thread as Ctrl-C would (SIGINT to that thread: the stream's iterator
closes and Ray Data shuts its executor down, the path every stop already takes) and the block
raises `NodesLostError` in place of the interrupt (an `ActorStartError`: one line, exit 8); the
rows committed so far stay and a rerun resumes. A caller off the main thread cannot be
interrupted: there the watch is off (logged). No live node that fits
means no live actor of that pool either (an actor lives on a node that holds its resources). A
pool is watched only once such a node was seen: a cluster that starts without one may be
waiting for an autoscaler, as before.

A run that goes on after losing nodes (Ray retried their tasks, restarted their actors elsewhere)
prints one line naming them (`NodesSeen.line`, from the listings of the watch and one more at the end).
"""
from __future__ import annotations

import logging
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

from vlbatch.operators.errors import NodesLostError
from vlbatch.pipeline.startup.placement import RunPlacement, fits

log = logging.getLogger("vlbatch.pipeline")


def _need_text(need: dict) -> str:
    """`{"num_gpus": 1, "num_cpus": 0.25}` -> "1 GPU, 0.25 CPU" (memory in GiB)."""
    parts = [f"{need['num_gpus']:g} GPU" if need.get("num_gpus") else "",
             f"{need['num_cpus']:g} CPU" if need.get("num_cpus") else "",
             f"{need['memory'] / 2**30:g} GiB memory" if need.get("memory") else ""]
    return ", ".join(p for p in parts if p) or "no resources"


@dataclass(frozen=True)
class NodeWatch:
    """The node-loss watch of one pool between checks: `held` the live nodes ("IP (id8)") that could
    hold its actor at the last check that found any (empty: none seen yet, so nothing is watched);
    `lost_since` the check (monotonic s) that first found none of them left (None: one is alive)."""

    held: tuple[str, ...] = ()
    lost_since: float | None = None


def watch_nodes(stage: str, need: dict, nodes: list[dict], watch: NodeWatch, now: float,
                timeout_s: float) -> NodeWatch:
    """One check of `stage`'s pool (actors asking `need`) against `nodes` (`ray.nodes()` now): the
    next `NodeWatch`; `NodesLostError` when no live node that fits has been left for `timeout_s`."""
    held = tuple(f"{n.get('NodeManagerAddress', '?')} ({n['NodeID'][:8]})" for n in nodes
                 if n.get("Alive") and fits(n.get("Resources", {}), need))
    if held:
        return NodeWatch(held)
    if not watch.held:
        return watch
    since = now if watch.lost_since is None else watch.lost_since
    if now - since >= timeout_s:
        raise NodesLostError(stage, f"{stage} lost every node that can hold its actor ({_need_text(need)}): "
                             f"{', '.join(watch.held)} gone and none came back within "
                             f"ray.node_loss_timeout_s={timeout_s:g}s; committed rows are kept, rerun to resume")
    return NodeWatch(watch.held, since)


@dataclass(frozen=True)
class NodesSeen:
    """The nodes a run saw alive (`alive`: (id, "IP (id8)") in the order seen) and, of those, the ones found
    dead or gone from the listing since (`lost`, "IP (id8)"): a run that goes on after a loss says so."""

    alive: tuple[tuple[str, str], ...] = ()
    lost: tuple[str, ...] = ()

    def after(self, nodes: list[dict]) -> NodesSeen:
        """This, updated by one listing (`ray.nodes()`)."""
        known = dict(self.alive)
        for n in nodes:
            if n.get("Alive"):
                known.setdefault(n["NodeID"], f"{n.get('NodeManagerAddress', '?')} ({n['NodeID'][:8]})")
        live = {n["NodeID"] for n in nodes if n.get("Alive")}
        gone = [name for node_id, name in known.items() if node_id not in live and name not in self.lost]
        return NodesSeen(tuple(known.items()), self.lost + tuple(gone))

    def line(self) -> str | None:
        """The driver's line for a run that went on after losing nodes (None: none was lost)."""
        if not self.lost:
            return None
        what = f"node {self.lost[0]} was" if len(self.lost) == 1 else f"nodes {', '.join(self.lost)} were"
        return f"[vlbatch] {what} lost mid-run; Ray retried its work on the nodes left and the run went on"


class _NodeLossThread(threading.Thread):
    """Every `every_s`: `check`. On a loss, `lost` is set and the main thread interrupted (once; never
    after `stop`). `nodes` lists the cluster's nodes (`ray.nodes`); `seen` the nodes seen and lost."""

    def __init__(self, needs: dict, timeout_s: float, every_s: float, nodes):
        super().__init__(name="vlbatch-node-watch", daemon=True)
        self.needs, self.timeout_s, self.every_s, self.nodes = needs, timeout_s, every_s, nodes
        self.lost: NodesLostError | None = None
        self.seen = NodesSeen()
        self._watches: dict[str, NodeWatch] = {}
        self._stopped = threading.Event()
        self._lock = threading.Lock()

    def run(self) -> None:
        while not self._stopped.wait(self.every_s) and self.check():
            pass

    def listed(self) -> list[dict] | None:
        """The nodes now, also noted in `seen` (None: the listing failed)."""
        try:
            found = self.nodes()
        except Exception as e:  # noqa: BLE001 - the GCS briefly unreachable: the next check decides
            log.debug("node-loss check: listing the nodes failed: %s", e)
            return None
        with self._lock:
            self.seen = self.seen.after(found)
        return found

    def check(self) -> bool:
        """One check: `watch_nodes` for each pool in `needs`; False once a pool's nodes are lost."""
        found = self.listed()
        if found is None:
            return True
        try:
            for stage, need in list(self.needs.items()):
                self._watches[stage] = watch_nodes(stage, need, found, self._watches.get(stage, NodeWatch()),
                                                   time.monotonic(), self.timeout_s)
        except NodesLostError as e:
            with self._lock:
                if not self._stopped.is_set():
                    self.lost = e
                    # a real SIGINT to the main thread (its handler: KeyboardInterrupt, or the CLI's Interrupted):
                    # it also wakes a wait blocked in a lock, which `_thread.interrupt_main` would not
                    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            return False
        return True

    def stop(self) -> None:
        with self._lock:
            self._stopped.set()


@contextmanager
def watching_nodes(placement: RunPlacement, ray_cfg, nodes=None):
    """`with watching_nodes(placement, cfg.ray) as watch:` around the main thread's loop over the stream: the
    node-loss watch (module docstring) over `placement.needs`, with the grace
    `ray.node_loss_timeout_s`, checked when it starts and every `ray.progress_interval_s` (or the grace, if
    shorter); `nodes` lists the nodes (default `ray.nodes`; a test's list where no node can be lost). After the
    block, `watch.seen.line()`: the line saying which nodes the run lost and went on without (listed once more
    at its end)."""
    import ray

    timeout_s = ray_cfg.node_loss_timeout_s
    watch = _NodeLossThread(placement.needs, timeout_s, min(ray_cfg.progress_interval_s, timeout_s),
                            nodes or ray.nodes)
    if threading.current_thread() is not threading.main_thread():
        log.warning("run_job off the main thread: the node-loss watch is off (it stops the run by interrupting "
                    "the main thread)")
        watch.listed()
        yield watch
        watch.listed()
        return
    watch.check()  # the first check: the nodes the run starts with
    # A background job of a non-interactive shell (`... &` in a script, cron) starts with SIGINT ignored, so the
    # watch's SIGINT would be lost and the run would hang: take the watch's own, keep ignoring everyone else's.
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, _only_the_watch(watch))
    watch.start()
    try:
        yield watch
    except BaseException:  # the interrupt (KeyboardInterrupt, or the CLI's Interrupted): the loss, if it was ours
        if watch.lost is not None:
            raise watch.lost from None
        raise
    finally:
        watch.stop()
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch.listed()  # the block ended normally: a node lost since the last check counts too


def _only_the_watch(watch: _NodeLossThread):
    """A SIGINT handler that acts only on the watch's own signal (it sets `lost` before it sends it)."""
    def handler(signum, frame) -> None:
        if watch.lost is not None:
            raise KeyboardInterrupt
    return handler
