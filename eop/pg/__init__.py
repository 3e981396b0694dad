"""PostgreSQL at the edge: eop's tables, its SQL (but the outbox's), the inbox, migrations."""
