"""Alembic migrations: the only way clawgate's schema is created or changed.

Run them with ``gateway.store.db.upgrade(url)`` (which builds the Alembic config in code); ``env.py`` takes
the database URL from that config and works on SQLite and Postgres alike.
"""
