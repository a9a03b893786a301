"""What Ray's actor table says of a worker actor: its state, why it died, whether its node
is gone; read by `serve`'s supervisor (launcher/serve.py)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger("hybrid_pd.launcher.serve")


def _one_line(text: object, limit: int = 300) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _death_cause(info: Mapping[str, Any]) -> str:
    """Ray's reason for an actor's death (actor table DeathCause), as one short line."""
    cause = info.get("DeathCause")
    try:
        which = cause.WhichOneof("context")
        context = getattr(cause, which)
        text = getattr(context, "error_message", "") or getattr(
            context, "formatted_exception_string", ""
        )
    except Exception:  # no cause recorded, or another shape of it
        return "no cause recorded"
    return _one_line(text).rstrip(".") or (which or "no cause recorded").replace("_", " ")


def _actor_state(actor) -> tuple[str | None, dict[str, Any]]:
    """The actor's state in Ray's actor table ("ALIVE", "RESTARTING", "DEAD", ...) and its
    entry; (None, {}) where the table cannot be read (the supervisor then only probes)."""
    try:
        from ray._private.state import actors as actor_table

        info = actor_table(actor_id=actor._actor_id.hex())
    except Exception as e:
        logger.debug("actor table unavailable: %s", e)
        return None, {}
    return (info.get("State"), info) if info else (None, {})


def _node_gone(info: Mapping[str, Any]) -> str:
    """A note that the node the actor last lived on is dead (", its node <ip> is gone"),
    else ""."""
    import ray

    node_id = (info.get("Address") or {}).get("NodeID")
    if not node_id or set(node_id) in ({"f"}, {"0"}):  # none recorded (nil id)
        return ""
    try:
        for node in ray.nodes():
            if node.get("NodeID") == node_id and not node.get("Alive", True):
                return f", its node {node.get('NodeManagerAddress', node_id)} is gone"
    except Exception:
        pass
    return ""
