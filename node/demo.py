"""A demo upstream for docker-compose: the echo app as a standalone ASGI app.

uvicorn node.demo:app --port 9000
"""

from node.upstream import echo_app

app = echo_app("upstream")
