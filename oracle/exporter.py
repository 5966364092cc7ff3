"""Exports while the job trains (``[export]``; `serving.chain`): the coordinator offers each
checkpoint it completes, and the first one due becomes the chain's next link, written in a
thread of its own so that completing checkpoints never waits for it.

A link is due at the first complete checkpoint at least `every_iterations` iterations, or
`every_s` seconds, after the last link (the first checkpoint makes the base); when the run
ends, its last complete checkpoint is exported too, if the chain does not hold it. One export runs
at a time; a checkpoint offered meanwhile is passed over, and the next one due is taken. The
checkpoint being exported is kept from pruning (`protected`). The oracle reads the shards'
snapshots from the checkpoint directory, so exports need it on a disk the oracle sees (one
machine, or a shared folder).
"""

from __future__ import annotations

import logging
import shutil
import threading
import time

from common.job import Job

# serving.chain is imported where it is used: serving reads checkpoints with torch, which
# an oracle that never exports need not import (2.5 CPU-seconds at each cold start).

log = logging.getLogger(__name__)


class Exporter:
    def __init__(self, job: Job) -> None:
        self.job = job
        self.section = job.spec.export
        self._lock = threading.Lock()
        self._busy: int | None = None  # the checkpoint being exported
        self._idle = threading.Condition(self._lock)  # notified when an export ends
        from serving.chain import ExportChain

        chain = ExportChain.read(self.section.dir)
        last = chain.links[-1] if chain.links else None
        self._last = (last.checkpoint, last.exported_s) if last is not None else None
        self.exported = len(chain.links)
        self.failures = 0

    @staticmethod
    def start_fresh(job: Job) -> None:
        """A fresh run's chain starts again: the links of an earlier run are deleted."""
        from serving.chain import ExportChain

        folder = job.spec.export.dir
        chain = ExportChain.read(folder)
        if chain.links:
            log.info("fresh run: removing the earlier run's exports in %s", folder)
        for link in chain.links:
            shutil.rmtree(folder / link.folder, ignore_errors=True)
        (folder / "chain.json").unlink(missing_ok=True)

    def protected(self) -> set[int]:
        """Checkpoints that must not be pruned now."""
        with self._lock:
            return set() if self._busy is None else {self._busy}

    def offer(self, checkpoint: int, *, final: bool = False) -> bool:
        """Checkpoint `checkpoint` is complete: export it if it is due (`final`: the run's
        last, exported once the export going on ends if it is newer than the last link);
        whether it will be."""
        if not self.section.enabled:
            return False
        if final and not self.wait_idle(60):
            return False
        with self._lock:
            newer = self._last is None or checkpoint > self._last[0]
            if self._busy is not None or not (self._due(checkpoint) or (final and newer)):
                return False
            self._busy = checkpoint
        threading.Thread(target=self._export, args=(checkpoint,), name="export", daemon=True).start()
        return True

    def wait_idle(self, timeout: float) -> bool:
        """Wait up to `timeout` s for the export in progress, if any (the oracle's end)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._busy is None, timeout)

    def _due(self, checkpoint: int) -> bool:
        # caller holds self._lock
        if self._last is None:
            return True
        last_checkpoint, last_s = self._last
        if checkpoint <= last_checkpoint:
            return False
        every_it, every_s = self.section.every_iterations, self.section.every_s
        return bool((every_it and checkpoint - last_checkpoint >= every_it)
                    or (every_s and time.time() - last_s >= every_s))

    def _export(self, checkpoint: int) -> None:
        from serving.chain import export_link
        from serving.export import DEFAULT_CHUNK_MB, chunk_rows_of

        started = time.perf_counter()
        try:
            link = export_link(self.job, checkpoint, self.section.dir,
                               chunk_rows=chunk_rows_of(DEFAULT_CHUNK_MB, self.job.dim))
        except Exception as exc:  # an export that fails costs the export, never the training
            log.error("the export of checkpoint %d failed: %s", checkpoint, exc)
            with self._lock:
                self.failures += 1
                self._busy = None
                self._idle.notify_all()
            return
        log.info("exported checkpoint %d as a %s (%d rows, %d bytes) in %.2f s", checkpoint, link.kind, link.rows,
                 link.bytes, time.perf_counter() - started)
        with self._lock:
            self._last = (link.checkpoint, link.exported_s)
            self.exported += 1
            self._busy = None
            self._idle.notify_all()
