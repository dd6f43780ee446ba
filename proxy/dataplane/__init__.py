"""The data plane: the proxy's public port, on uvloop + httptools protocols, and the only path of /v1 completions.

Owns connections, bytes and deadlines, and one request's journey; it asks proxy/routing/service.py for
decisions and knows nothing of policies. One completion's path: server.py (listener) -> connection.py
(HTTP/1.1, incoming.py parses and limits the request) -> journey.py: intake.py (admit, prepare the trip)
-> attempt.py (pick; head.py's request through exchange.py to the worker, relay.py back to the client)
-> classify.py (retry?) -> resume.py (migration) -> record.py. Where a lower module calls back up, it
defines a small Protocol of what it needs (pool.UpstreamListener, stall.Watched, relay.Client,
budget.BudgetWaiter, connection.Server).
"""
