"""Tensor-parallel worker groups: one worker's model sharded over N ranks
(mx.distributed), rank 0 facing the router, the others replaying its loop."""
