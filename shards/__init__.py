"""Sharded search without Ray: the coordinator of shards, the shard server class, the shard
channel and staging. cluster/ runs these in Ray actors; tests and one machine run them in process."""
