"""The hybrid KV cache manager: specs, grouping, block pool, managers, physical pool."""
