"""The data plane: the proxy's public port, on uvloop + httptools protocols, and the only path of /v1 completions.

Owns connections, bytes and deadlines, and one request's journey (journey.py); it asks
proxy/routing/service.py for decisions and knows nothing of policies.
"""
