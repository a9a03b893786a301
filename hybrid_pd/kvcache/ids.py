"""Typed ids shared across package boundaries."""

from typing import NewType

BlockId = NewType("BlockId", int)
RequestId = NewType("RequestId", str)
GroupId = NewType("GroupId", int)
#: A worker's engine as its peers name it (handshakes, kv_transfer_params): "prefill-1a2b...".
EngineId = NewType("EngineId", str)

#: Block id of the shared null block: skipped sliding-window / chunk positions point here.
NULL_BLOCK_ID = BlockId(0)
