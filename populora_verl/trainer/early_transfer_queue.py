"""TransferQueue started by the launching process while verl's task runner starts.

``python -m verl.trainer.main_ppo`` starts Ray in the launching process, creates the task runner actor and waits for
it. The task runner's process imports verl, and only then does its ``run`` call ``tq.init``, which creates
TransferQueue's controller, waits for it to answer, then creates the storage units and waits for them: two rounds of
Ray processes, one after the other, each importing torch before it answers (the start-up line's "config +
TransferQueue", 20-28 s on an H200 host). TransferQueue lets a second process attach to a running controller: a
``tq.init`` that finds the controller by its name only builds a client once the controller holds the config.

With ``trainer.populora_early_transfer_queue`` (on in the recipes), the start-up callback
(:mod:`populora_verl.startup`) starts a thread in the launching process that waits for verl to start Ray and then
runs ``tq.init`` there with the section verl will pass (``transfer_queue``, resolved, ``enable`` set as the task
runner sets it). TransferQueue's processes then start beside the task runner's; the task runner's own ``tq.init``
attaches to them. The launching process owns the storage units, as verl's task runner does otherwise, and closes
them when the job ends.

Only the SimpleStorage backend (verl's default, and the recipes'): another backend may start processes of its own
where ``tq.init`` runs, so it keeps verl's order. If the early start fails, its controller is ended so that the task
runner's ``tq.init`` does not wait for a config that will never come: the task runner either starts TransferQueue
itself (it had not attached yet) or fails with Ray's error naming the ended actor.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["ENABLE_KEY", "EarlyTransferQueue", "tq_conf", "start"]

#: ``trainer.populora_early_transfer_queue``: true, TransferQueue started by the launching process as soon as Ray is
#: up; false or absent: verl's order (the task runner starts it).
ENABLE_KEY = "trainer.populora_early_transfer_queue"
BACKEND_KEY = "transfer_queue.backend.storage_backend"
SUPPORTED_BACKEND = "SimpleStorage"
#: TransferQueue's name for its controller actor, in its namespace (what a second ``tq.init`` looks up)
CONTROLLER = ("TransferQueueController", "transfer_queue")
#: How often the thread looks whether verl's ``ray.init`` has returned (it waits for nothing else)
POLL_S = 0.05


def tq_conf(config: Any) -> dict[str, Any] | None:
    """The ``transfer_queue`` section the task runner will pass to ``tq.init`` (resolved, ``enable`` true), or None
    where the early start does not apply: the key is off, or the backend is not SimpleStorage."""
    from omegaconf import OmegaConf

    if not bool(OmegaConf.select(config, ENABLE_KEY, default=False)):
        return None
    section = OmegaConf.select(config, "transfer_queue", default=None)
    backend = OmegaConf.select(config, BACKEND_KEY, default=None)
    if section is None or backend != SUPPORTED_BACKEND:
        print(
            f"[populora] {ENABLE_KEY}: only with {BACKEND_KEY}={SUPPORTED_BACKEND}; {backend} starts in the task "
            "runner (verl's order)",
            flush=True,
        )
        return None
    conf = OmegaConf.to_container(section, resolve=True)
    conf["enable"] = True  # verl's task runner sets it before its tq.init
    return conf


class EarlyTransferQueue:
    """The launching process's thread that starts TransferQueue once Ray is up (:func:`start`), and its end
    (:meth:`finish`, at the end of the job)."""

    def __init__(self, conf: dict[str, Any]) -> None:
        self.conf = conf
        self.created = False  # this process's tq.init returned: it closes TransferQueue at the end of the job
        self.error: BaseException | None = None
        self.seconds: float | None = None  # from Ray's start to TransferQueue's
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="populora-early-transfer-queue", daemon=True)

    def start(self) -> EarlyTransferQueue:
        self._thread.start()
        return self

    def _run(self) -> None:
        import ray

        while not ray.is_initialized():
            if self._stop.wait(POLL_S):  # the job ended before verl started Ray
                return
        t0 = time.monotonic()
        try:
            import transfer_queue as tq
            from omegaconf import OmegaConf

            tq.init(OmegaConf.create(self.conf))
            self.created, self.seconds = True, time.monotonic() - t0
            # a task runner that got there first started it, and this tq.init attached (TransferQueue's own handling)
            owner = getattr(sys.modules.get("transfer_queue.interface"), "_TQ_STORAGE", True) is not None
            what = "started by the launching process" if owner else "the task runner's, attached to"
            print(
                f"[populora] TransferQueue: {what} in {self.seconds:.0f} s, beside the task runner's start", flush=True
            )
        except BaseException as e:  # noqa: BLE001 - reported, and the controller ended, whatever it was
            self.error = e
            print(f"[populora] TransferQueue's early start failed: {type(e).__name__}: {e}", flush=True)
            _end_controller()

    def finish(self, timeout_s: float = 120.0) -> None:
        """At the end of the job: stop waiting for Ray, wait for a start in progress, close what this process
        started (the storage units it owns; the task runner's close has ended the controller already)."""
        self._stop.set()
        self._thread.join(timeout_s)
        if not self.created:
            return
        import transfer_queue as tq

        try:
            tq.close()
        except Exception as e:  # noqa: BLE001 - the job is over; a failed close must not hide its result
            logger.warning("closing the TransferQueue the launching process started: %s", e)
        self.created = False


def _end_controller() -> None:
    import ray

    try:
        ray.kill(ray.get_actor(CONTROLLER[0], namespace=CONTROLLER[1]))
    except Exception:  # noqa: BLE001 - none was created, or it has ended already
        pass


def start(config: Any) -> EarlyTransferQueue | None:
    """Start the thread where ``config`` turns the early start on (:func:`tq_conf`), else None."""
    conf = tq_conf(config)
    return EarlyTransferQueue(conf).start() if conf is not None else None
