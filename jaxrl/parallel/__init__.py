"""The mesh and the processes: logical-axis sharding rules and multi-process helpers."""
