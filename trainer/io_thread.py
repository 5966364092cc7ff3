"""An asyncio (uvloop) event loop in a background thread, for the trainer's network I/O.

Compute stays in the main thread; it hands coroutines to `IoThread.submit` and gets
`concurrent.futures.Future`s back, which it waits on only when it needs the result. That is
how prefetches overlap forward/backward (docs/design.md#cache-and-overlap).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import uvloop

T = TypeVar("T")


class IoThread:
    def __init__(self, name: str = "trainer-io") -> None:
        self.loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule `coro` on the I/O loop; the future carries its result or exception."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the I/O loop and wait for it."""
        return self.submit(coro).result(timeout)

    def close(self) -> None:
        """Cancel what is still pending, stop the loop and join the thread."""
        if not self._thread.is_alive():
            return

        async def cancel_rest() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self.submit(cancel_rest()).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()
