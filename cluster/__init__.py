"""The Ray layer: the ingestion job, local heads for the demo, serving (one process, or shard
actors across nodes: serve, ray_shards, shard_actor, staging, coordinator), and the ``needle``
command.

Ray is imported only inside this package; ingest/, embed/, index/, rerank/ and eval/ are plain
libraries that this package schedules.
"""
