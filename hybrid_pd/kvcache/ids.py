"""Typed ids shared across package boundaries."""

from typing import NewType

BlockId = NewType("BlockId", int)
RequestId = NewType("RequestId", str)
GroupId = NewType("GroupId", int)

#: Block id of the shared null block: skipped sliding-window / chunk positions point here.
NULL_BLOCK_ID = BlockId(0)
