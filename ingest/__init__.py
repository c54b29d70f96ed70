"""Reading WebDataset tar shards: shard lists, samples, image decoding and the Parquet schema.

Plain library code (no Ray): ``cluster/`` schedules it across workers.
"""
