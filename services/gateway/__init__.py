"""The HTTP front door: OpenAI-compatible routes and async jobs over Kafka and Redis."""
