"""Tenants: the teams or products one clawgate serves, each with its own keys and data.

- keys live in the database (``gateway/store/api_keys.py``: created, listed, revoked; only an HMAC of each is stored).
- ``cache.py``: each gateway process's short-lived memory of checked keys (revocations reach it within a second).
- ``principal.py``: who a request is (the global admin, a tenant's admin or user key, a rollout's own key).
"""
