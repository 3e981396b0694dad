"""Operating eop: dead letters, the audit, status."""
