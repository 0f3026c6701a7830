"""Tables the passes read: sharding rules per ATen op (sharding_table) and their helpers."""
from . import sharding_table  # noqa: F401  (registers the rules)
