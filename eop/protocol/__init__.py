"""The exactly-once protocol: one message, a batch, parked retries, compaction."""
