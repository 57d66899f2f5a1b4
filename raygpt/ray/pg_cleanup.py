"""The workers' placement group is removed even when Ray Train's controller dies without
removing it, watched through the controller's actor handle instead of Ray's State API.

Why not Ray's own: its detached `PlacementGroupCleaner` asks the State API once a second whether
the controller is alive (`ray.util.state.get_actor`); the State API is served by the dashboard and
found through the bootstrap address, so:
- without a dashboard (Ray installed without `ray[default]`) every query fails, and the cleaner
  logs "Failed to query Ray Train Controller actor state" every second of the run;
- with more than one Ray instance on the machine (two runs, a sweep beside a test) the client
  cannot tell which to ask, raises ConnectionError, and the cleaner's thread dies with a
  traceback on the console, leaving no cleaner at all.
`CleanupOnControllerDeath` takes the place of Ray's callback (`RaygptTrainer` drops Ray's from
its default callbacks): its detached `PlacementGroupReaper` holds the controller's actor handle
and waits on `__ray_ready__` calls, which fail with RayActorError exactly when the controller is
gone (killed, crashed, or its driver died, which ends it). Then the placement group is removed
and the reaper exits. On a normal end the controller stops the reaper before it shuts down.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import ray
from ray.util.placement_group import placement_group_table, remove_placement_group

from raygpt.ray.compat import ControllerCallback, WorkerGroupCallback

logger = logging.getLogger(__name__)

# seconds between liveness calls, and how long the controller waits for the reaper to stop
POLL_S = 1.0
STOP_TIMEOUT_S = 30.0


class PlacementGroupReaper:
    """Detached actor: removes the registered placement group once the controller is dead."""

    def __init__(self, controller, poll_s: float = POLL_S):
        self._controller, self._poll_s = controller, poll_s
        self._placement_group = None
        self._stop = threading.Event()
        threading.Thread(target=self._watch, name="raygpt-pg-reaper", daemon=True).start()

    def register(self, placement_group) -> None:
        self._placement_group = placement_group

    def stop(self) -> None:
        """The controller is ending in order and removes its placement group itself."""
        self._stop.set()
        ray.actor.exit_actor()

    def _watch(self) -> None:
        while not self._stop.is_set():
            ref = self._controller.__ray_ready__.remote()
            ready: list = []
            while not ready and not self._stop.is_set():
                ready, _ = ray.wait([ref], timeout=self._poll_s)
            if self._stop.is_set():
                return
            try:
                ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError):
                break  # the controller is gone (its owner's death ends it too)
            self._stop.wait(self._poll_s)
        else:
            return
        pg = self._placement_group
        if pg is not None and placement_group_table(pg).get("state") not in (None, "REMOVED"):
            logger.warning("raygpt: Ray Train's controller died; removing its workers' "
                           "placement group %s", pg.id.hex())
            remove_placement_group(pg)
        ray.actor.exit_actor()  # marks the actor to exit (this thread ends with SystemExit)


class CleanupOnControllerDeath(ControllerCallback, WorkerGroupCallback):
    """Ray Train's PlacementGroupCleanerCallback, with a reaper that needs no State API."""

    def __init__(self):
        self._reaper = None

    def after_controller_start(self, train_run_context) -> None:
        controller = ray.get_runtime_context().current_actor  # this runs on the controller
        self._reaper = ray.remote(num_cpus=0)(PlacementGroupReaper).options(
            lifetime="detached", max_restarts=0,
            # on the controller's node: it outlives the controller, not the node
            scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                node_id=ray.get_runtime_context().get_node_id(), soft=False),
        ).remote(controller)

    def after_worker_group_start(self, worker_group) -> None:
        if self._reaper is not None:
            pg = worker_group.get_worker_group_state().placement_group_handle.placement_group
            ray.get(self._reaper.register.remote(pg))

    async def before_controller_shutdown(self) -> None:
        await self._stop_reaper()

    def before_controller_abort(self) -> None:
        reaper, self._reaper = self._reaper, None
        if reaper is not None:
            ray.kill(reaper)  # an abort removes the placement group itself, and must be quick

    async def _stop_reaper(self) -> None:
        reaper, self._reaper = self._reaper, None
        if reaper is None:
            return
        try:
            await asyncio.wait_for(reaper.stop.remote(), STOP_TIMEOUT_S)
        except ray.exceptions.RayActorError:
            pass  # stop() ends the actor: its death is the expected answer
        except asyncio.TimeoutError:
            ray.kill(reaper)
