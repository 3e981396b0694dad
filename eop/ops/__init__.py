"""Operating eop: dead letters, the audit, status, the outbox (and the tables they print)."""
