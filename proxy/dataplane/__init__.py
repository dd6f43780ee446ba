"""The data plane: the proxy's public port, on uvloop + httptools protocols.

Owns connections, bytes and deadlines (server.py, pool.py, exchange.py) and one request's
journey (journey.py); it asks dispatch.py for decisions and knows nothing of policies.
"""
