"""The Ray layer and nothing else: the ingestion job over actor workers, parallel index builds,
local heads and job submission for the demo, shard actors placed across nodes, and the Ray Serve
deployment of the query service.

Ray is imported only inside this package; the packages below it are plain libraries that this
package schedules (shards/ holds the Ray-free sharded query these actors run, webapi/ the HTTP
app, cli/ the ``needle`` command).
"""
