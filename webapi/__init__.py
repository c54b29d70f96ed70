"""The HTTP query service (FastAPI app, web page) over any index; Ray-free (cluster/ deploys it
with Ray Serve)."""
