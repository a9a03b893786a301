"""Data plane of the KV connector: tagged UCX messages between workers' KV pools (ucxx).

    ffi.py        the ucxx pieces and direct libucp calls (ctypes)
    tags.py       wire tags: the user's tag mixed with the sender's identity
    iov.py        regions as messages: contiguous tensors, scatter-gather (IOV) lists
    ops.py        a batch of UCP requests, and the receiver's handle on one
    poller.py     the loop thread's work: post, poll, settle after failure, drain
    rma.py        one-sided reads: memory mapped once, remote keys, ucp_get_nbx
    cma.py        same-host one-sided reads by the reader itself (process_vm_readv)
    transport.py  `UcxTransport`: threads, lifecycle, the blocking public API

One `UcxTransport` per worker process. The control plane (gRPC) ships `address` (the UCX
worker address, bytes) to peers; then

    sender:    transport.send(peer_address, tag, [region_0, region_1, ...], timeout)
    receiver:  handle = transport.post_recv(peer_address, tag, [dst_0, dst_1, ...])
               ...  (tell the sender to go, over gRPC)
               handle.wait(timeout)

or, one-sided (`rma.py`):

    owner:     mapped = transport.map_memory(address, nbytes)   # once; ship mapped.rkey
    reader:    transport.read(owner_address, [rkey, ...], rows, keep, timeout)
               or, the owner on this host: transport.read_local(owner_pid, rows)

where row i of `rows` reads NBYTES bytes at the owner's address REMOTE (inside the mapping
of key KEY) into this process's address LOCAL; the owner's threads take no part.

Entry i travels as one message with tag `tag + i`, straight from the source tensors into the
destination tensors (UCX rendezvous: the receiver reads the sender's memory with CMA on one
host, cuda_ipc between GPUs; no staging copy). An entry is a contiguous tensor of any dtype,
on CPU or CUDA, or a list of them: one scatter-gather message (UCX's IOV datatype; UCX 1.21
then has the sender write into the receiver's memory with CMA instead), so a transfer of
thousands of scattered blocks costs a few messages instead of one each. Entry i
on both sides must have the same number of bytes, however each side splits it into tensors
(a longer message fails with TransferError; a shorter one is NOT detected by UCX, so the plan
on both sides must agree; the connector derives both from the same block runs).

Threading. All UCX calls run in one asyncio event loop owned by the transport (a daemon
thread); the public methods are plain blocking calls, safe from any number of threads (gRPC
handler threads, the engine loop), but never from the transport's own loop thread. ucxx
progresses the UCX worker in its C++ progress thread (blocking mode, woken by UCX events, 1 ms
epoll timeout). The data messages bypass ucxx's request objects: the loop thread posts them
with `ucp_tag_send_nbx` / `ucp_tag_recv_nbx` on ucxx's worker and endpoints (ctypes, see
`ffi.Ucp`) and polls their status about every millisecond while any are in flight (a ucxx
request, its Python future and its completion notice cost tens of microseconds per message,
which dominated fragmented transfers of thousands of messages). Requests are freed only once
none of their batch is running: freeing takes the worker's spinlock, which the progress
thread holds while it copies. Requests are submitted immediately, which is what makes
cancelling a posted receive safe (`ucp_request_cancel`).

Tags (the rule callers must follow). UCX matches tags per *worker*, not per endpoint: a
receive posted "on" an endpoint matches a message from any peer. So the transport mixes the
sender's identity into every wire tag: wire tag = (tag + i) XOR h(sender's worker address),
h a 64-bit hash both sides compute from the same address bytes, and matching uses the full
mask. Hence:
  * for one (sender, receiver) pair, the tags `tag .. tag + len(regions) - 1` of transfers
    that are pending at the same time must not overlap (e.g. a per-peer counter times the
    largest message count, or a random base plus a counter, as the decode connector does);
    different senders may use the same tags freely;
  * after a failed or cancelled receive, do not reuse its tags with that peer for
    `drain_window_s` (default 5 minutes): late messages with those tags are consumed and
    dropped (see "Failure" below), and would otherwise land in a new transfer.
  * tags are integers with 0 <= tag and tag + len(regions) <= 2**64.

Endpoints are made from the peer's worker address with `endpoint_error_handling=False`: with
UCX peer error handling on, UCX uses TCP between two local processes (tcp/lo, 0.6-1.3 GB/s for
64 MiB on the 2-core dev VM), while without it sysv shared memory (eager, < 8 KiB) and CMA
(rendezvous) are used (7.5-8 GB/s for 64 MiB; CUDA memory goes by cuda_ipc, checked on an
H200). The price: UCX reports no peer failure. A dead or stuck peer shows up as a timeout
here (or as an error when its shared memory is already gone) and must be detected by the
control plane (gRPC), which can then call `forget_peer`. One endpoint per peer address is
created lazily in the loop thread and cached.

Failure. On timeout or error `send` and `RecvHandle.wait` raise TransferError and cancel the
UCX requests still pending. UCX can cancel a posted receive (then its destination is no
longer written) but not a rendezvous send whose receiver has not matched it yet: such sends
stay pending in UCX (their tensors are kept alive here, counted in stats()["orphan_sends"])
until the receiver consumes or drops the message, and until then the receiver may still read
the source memory. The receiver side drops such messages: after a receive is cancelled the
transport consumes messages with those wire tags into a small scratch buffer for
`drain_window_s`, which also completes the sender's orphaned send. `discard()` does the same
for tags whose receives were never posted. A sender whose message was drained sees success:
whether a transfer counts is the control plane's call (the puller's receive is the truth).

Environment. The first `start()` in a process sets UCX_WARN_UNUSED_ENV_VARS=n unless set, and
only if ucxx is not imported yet (UCX reads it when its library loads; ucxx sets
UCX_MEMTYPE_CACHE, which UCX 1.21 no longer knows and warns about). Nothing else is needed:
with the default UCX_TLS, endpoints without error handling pick sysv/posix (eager) and CMA
(rendezvous) on one host and cuda_ipc between GPUs. `ucx_options` (UCX options without the
UCX_ prefix) override the environment for this transport only. Note that UCX also opens TCP
interfaces on every network device it finds: where only loopback may be used (tests, the
benchmark), pass {"NET_DEVICES": "lo"}.

Latency. Progress runs in blocking mode and completions are polled about every millisecond
only while requests are in flight: no core is burnt, but each send() or wait() costs up to
~1 ms (a 64 KiB message moves at ~0.1-0.2 GB/s and 1 MiB at ~2 GB/s on the 2-core dev VM).
Per message the loop thread spends a few microseconds (posting, polling); the rest is UCX's
rendezvous (RTS, CMA read, ATS) in the progress threads. `polling=True` busy-polls the UCX
worker instead (one core per worker; slower on the 2-core VM, meant for GPU servers).

CUDA. `send`/`post_recv` synchronize the caller thread's current CUDA stream of each
region's device before handing regions to UCX; data produced on another stream must be
synchronized by the caller first. The progress thread makes the CUDA device current
(`cuda_device`, default: the current device when `start()` runs).
"""

from hybrid_pd.connector.ucx.errors import TransferError
from hybrid_pd.connector.ucx.ffi import UCX_ENV_DEFAULTS
from hybrid_pd.connector.ucx.iov import IovList
from hybrid_pd.connector.ucx.ops import RecvHandle
from hybrid_pd.connector.ucx.tags import TAG_SPACE, sender_key, wire_tags
from hybrid_pd.connector.ucx.transport import UcxTransport

__all__ = [
    "TAG_SPACE",
    "UCX_ENV_DEFAULTS",
    "IovList",
    "RecvHandle",
    "TransferError",
    "UcxTransport",
    "sender_key",
    "wire_tags",
]
