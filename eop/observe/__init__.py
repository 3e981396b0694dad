"""What a worker tells about itself: the observer events, metrics, health, tracing."""
