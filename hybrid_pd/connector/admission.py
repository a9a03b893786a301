"""Which prefill servers a decode server may dial.

Every control call carries the shared secret, so a decode server never dials an address
taken from a request unless it has reason to trust it:

- a *known* peer: the static `peers` allow-list, or the proxy's registry (`add`);
- an address that signed params vouch for (`api.signing`): the params were made by a holder
  of the secret, so the address they name is a real prefill server of this deployment. It
  is then trusted as a known peer until the signature expires (the pull, its release or
  abort, and other requests' pulls: the prefill server still checks each transfer token).

A signature whose pull succeeded is spent: the same params shown again are refused before
any connection is made (a replay moves no bytes), whichever address they name.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from hybrid_pd.api.params import KVTransferParams
from hybrid_pd.api.signing import refusal
from hybrid_pd.connector.base import TransferFailed

#: Spent signatures and vouched addresses remembered at most (oldest dropped first; a
#: spent signature expires with its params anyway).
MAX_REMEMBERED = 4096


class Admission:
    def __init__(
        self,
        peers: Iterable[str] = (),
        secret: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._secret = secret
        self._clock = clock
        self._lock = threading.Lock()
        self._known: set[str] = set(peers)
        self._vouched: dict[str, float] = {}  # address -> when its last voucher expires
        self._spent: OrderedDict[str, float] = OrderedDict()  # signature -> its expiry

    def add(self, addresses: Iterable[str]) -> None:
        """Prefill servers (control addresses) this server may dial from now on."""
        with self._lock:
            self._known.update(addresses)

    @property
    def known(self) -> list[str]:
        """The allow-list (static peers and the registry's), without vouched addresses."""
        with self._lock:
            return sorted(self._known)

    def may_dial(self, address: str) -> bool:
        with self._lock:
            return address in self._known or self._vouched.get(address, 0.0) > self._clock()

    def admit(self, params: KVTransferParams, address: str | None = None) -> None:
        """Allow the pull `params` describe, from `address` (default: theirs; a tensor-
        parallel rank pulls from its own rank's address, vouched for by the same params), or
        raise TransferFailed saying why not. Nothing is dialed here."""
        address = address or params.control_address
        now = self._clock()
        with self._lock:
            if params.signature and params.signature in self._spent:
                raise TransferFailed(
                    f"kv_transfer_params for {params.request_id} were already pulled once "
                    "(a replay): refused"
                )
            if address in self._known or self._vouched.get(address, 0.0) > now:
                return
        why = refusal(params, self._secret, now) if params.signature else None
        if why is not None or not params.signature:
            raise TransferFailed(
                f"{address} is not a known prefill worker of this decode worker "
                "(peers come from the proxy's registry or --peer, or signed params)"
                + (f": {why}" if why else "")
            )
        with self._lock:
            self._vouched[address] = max(self._vouched.get(address, 0.0), params.expires_at)
            self._prune(self._vouched, now)

    def spend(self, params: KVTransferParams) -> None:
        """The pull of signed `params` succeeded: the same params are refused from now on."""
        if not params.signature:
            return
        with self._lock:
            self._spent[params.signature] = params.expires_at
            self._prune(self._spent, self._clock())

    @staticmethod
    def _prune(entries: dict[str, float], now: float) -> None:
        for key in [k for k, until in entries.items() if until <= now]:
            del entries[key]
        while len(entries) > MAX_REMEMBERED:
            del entries[next(iter(entries))]
