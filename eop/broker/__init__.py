"""NATS JetStream at the edge: connections, provisioning, fetching, acks, publishing."""
