"""One RPC leg of a request on one worker, and the bridges from gRPC's blocking calls to
asyncio: a thread per decode stream feeding a queue, and awaiting a grpc.Future."""

from __future__ import annotations

import asyncio
import logging
import threading

import grpc

from hybrid_pd.api.ids import RequestId
from hybrid_pd.proxy.errors import ProxyError
from hybrid_pd.proxy.routing import WorkerPool, WorkerState

logger = logging.getLogger(__name__)

#: A worker answered this when its queue was full (alive, not an error: look again).
FULL = grpc.StatusCode.RESOURCE_EXHAUSTED
#: Sleep between looks for a worker with room (doubling up to the cap).
BACKOFF_S, BACKOFF_CAP_S = 0.02, 0.5


class Leg:
    """One RPC of a request on one worker: released once, aborted unless it completed."""

    def __init__(
        self,
        pool: WorkerPool,
        worker: WorkerState,
        rid: RequestId,
        kind: str,
        call,
        tokens: int = 0,
        abort_timeout_s: float = 2.0,
    ) -> None:
        self.pool, self.worker, self.rid, self.kind, self.call = pool, worker, rid, kind, call
        self.tokens = tokens
        self.abort_timeout_s = abort_timeout_s
        self.released = False
        self.aborted = False
        #: A prefill's kept KV: its token lets Abort drop it even on a worker without secret.
        self.transfer_token = ""
        if kind == "prefill":
            pool.begin_prefill(worker, tokens)
        else:
            pool.begin_decode(worker)

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        if self.kind == "prefill":
            self.pool.end_prefill(self.worker, self.tokens)
        else:
            self.pool.end_decode(self.worker)

    def abort(self) -> None:
        """Cancel the RPC (the worker drops the request) and send Abort too, in the
        background (it must not hold up the event loop). Once only."""
        self.release()
        if self.aborted:
            return
        self.aborted = True
        try:
            self.call.cancel()
        except Exception:  # already finished
            pass
        self._send_abort()

    def kept_after_abort(self, transfer_token: str) -> None:
        """The prefill answered after it was aborted, keeping KV under `transfer_token`:
        drop that too (the first Abort could not name it)."""
        self.transfer_token = transfer_token
        if transfer_token:
            self._send_abort()

    def _send_abort(self) -> None:
        client, rid, token = self.worker.client, self.rid, self.transfer_token
        timeout = self.abort_timeout_s

        def send() -> None:
            try:
                client.abort(rid, timeout_s=timeout, transfer_token=token)
            except Exception as e:  # the worker is gone: nothing left to free there
                logger.debug("abort of %s on %s failed: %s", rid, client.address, e)

        threading.Thread(target=send, name=f"abort-{rid}", daemon=True).start()


class Pump:
    """Iterates a blocking gRPC stream in a thread; the event loop reads a queue."""

    def __init__(self, stream, loop: asyncio.AbstractEventLoop) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.loop = loop
        self.stream = stream
        threading.Thread(target=self._run, name="decode-stream", daemon=True).start()

    def _run(self) -> None:
        try:
            for chunk in self.stream:
                self._put(("chunk", chunk))
            self._put(("end", None))
        except Exception as e:  # grpc.RpcError (cancelled, deadline, unavailable ...)
            self._put(("error", e))

    def _put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    async def get(self, timeout: float, address: str):
        try:
            return await asyncio.wait_for(self.queue.get(), timeout)
        except TimeoutError:
            raise ProxyError(
                504, f"decode worker {address} sent nothing for {timeout:g} s", kind="timeout"
            ) from None


async def wait_grpc_future(future):
    loop = asyncio.get_running_loop()
    done = asyncio.Event()

    def wake(_):
        try:
            loop.call_soon_threadsafe(done.set)
        except RuntimeError:  # loop closed
            pass

    future.add_done_callback(wake)
    await done.wait()
    return future.result()
