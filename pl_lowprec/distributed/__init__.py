"""FSDP2 sharding for ``LowPrecisionFSDPStrategy``, one idea per file: ``mesh.py`` (the device mesh, DTensor rows),
``meta_init.py`` (a meta-device module made real one module at a time, each rank keeping its rows), ``shard.py``
(``fully_shard`` of the units and the root), ``precision.py`` (which precision plugins run sharded) and
``sharding.py`` (``Sharding``, what the model transform holds)."""
