"""PostgreSQL at the edge: eop's tables, all of its SQL, the inbox, migrations."""
