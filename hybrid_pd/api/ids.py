"""The ids the wire carries, typed for the proxy and the api (which import nothing outside
`proto/` and `api/`). The same names as `kvcache.ids` gives the workers' side; both are
`str` at run time, so an id passes from one side to the other unchanged."""

from typing import NewType

#: A request as the workers name it (the proxy's legs, kv_transfer_params).
RequestId = NewType("RequestId", str)
#: A worker's engine as its peers name it (handshakes, kv_transfer_params).
EngineId = NewType("EngineId", str)
