"""FSDP2 sharding for ``LowPrecisionFSDPStrategy``: the device mesh, rows of meta-device modules, shard units."""
